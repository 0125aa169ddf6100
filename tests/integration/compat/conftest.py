"""Fixtures of the compatibility tests: ``previous_release`` (the previous release installed
from its commit, cached; skipped with the reason where git history is unavailable) and
``previous_agent_factory`` (its daemon, started like ``agent_factory``'s)."""

import os
import subprocess

import pytest

from tests.integration.compat import previous
from tests.integration.conftest import AgentProcess


@pytest.fixture(scope="session")
def previous_release():
    try:
        return previous.install()
    except previous.Unavailable as exc:
        pytest.skip(str(exc))


class PreviousAgentProcess(AgentProcess):
    """``jetson-agent run`` of the previous release (its venv's Python, no PYTHONPATH, started
    in its work directory so this checkout's ``agent`` is not on its path)."""

    def __init__(self, release, *args, **kwargs):
        AgentProcess.__init__(self, *args, **kwargs)
        self.release = release

    def start(self, *args, env_extra=None):
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [self.release.python, "-m", "agent", "-v", "run", "--config", self.config]
            + list(args), stdout=logf, stderr=subprocess.STDOUT,
            env=self.release.env(env_extra), cwd=self.workdir)
        logf.close()
        return self


@pytest.fixture
def previous_agent_factory(previous_release, mosquitto, tmp_path):
    made = []

    def make(device="old1", extra_config="", **kwargs):
        wd = tmp_path / ("old-agent-" + device)
        os.makedirs(str(wd), exist_ok=True)
        agent = PreviousAgentProcess(previous_release, mosquitto, wd, device, extra_config,
                                     **kwargs)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        try:
            agent.stop(timeout=20)
        except Exception:  # noqa: BLE001
            agent.kill()
