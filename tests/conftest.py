import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# A suite started in the background by a shell without job control (`./scripts/test &` in a
# script) inherits SIGINT ignored, and so would every process a test starts: Python then
# installs no KeyboardInterrupt handler, and the Ctrl-C tests' SIGINT is lost. Ignoring it is
# the launcher's choice for the suite, not the behaviour under test.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _isolated_state_dir(tmp_path, monkeypatch):
    """No test touches the user's ~/.cache/jetson-agent."""
    monkeypatch.setenv("JETSON_AGENT_STATE_DIR", str(tmp_path / "state"))
