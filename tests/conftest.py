import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _isolated_state_dir(tmp_path, monkeypatch):
    """No test touches the user's ~/.cache/jetson-agent."""
    monkeypatch.setenv("JETSON_AGENT_STATE_DIR", str(tmp_path / "state"))
