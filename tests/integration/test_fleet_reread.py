"""No job left behind (issue 37, item 2): with a broker whose session queue drops what does
not fit (here 600 + 20, below the shipped 1000 + 100 so that 1,500 simulated devices overflow
it), some devices' final statuses never reach the controller, although the broker retains
them. The controller reads those retained statuses again (agent.fleet.rollouts.reread) once
the rollout's statuses stop coming, and the stage ends with every job final, none timed out."""

import json
import os
import sys

import pytest

from tests.integration.conftest import limited_broker
from tests.integration.test_fleet_service import ROOT, fleet_cli, fp16_args

sys.path.insert(0, os.path.join(ROOT, "scripts"))

from simulate_devices import SimulatedFleet  # noqa: E402

COUNT = 1500


@pytest.fixture
def dropping_broker(tmp_path):
    # Below the burst of 1,500 final statuses: the broker drops some of them on their way.
    with limited_broker(tmp_path, 600, 20) as broker:
        yield broker


@pytest.mark.slow
def test_final_statuses_the_broker_dropped_are_read_back_from_its_retained_copy(
        dropping_broker, tmp_path):
    fleet = SimulatedFleet(dropping_broker.host, dropping_broker.port, COUNT, name="rr")
    fleet.start()
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    try:
        out = fleet_cli(["rollout"] + fp16_args() + [
            "--match", "rr-*", "--rollout-id", "ro-reread", "--broker", dropping_broker.url,
            "--db", db, "--admission", "open", "--embedded", "--json", "-q", "--timeout",
            "400"], timeout=460,
            # A run unchanged for 10 s is read again (default 30 s; each later attempt waits
            # twice as long, so a slow stage on a loaded host still has three chances).
            env=dict(os.environ, JETSON_AGENT_FLEET_REREAD_AFTER_S="10"))
    finally:
        fleet.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["counts"] == {"SUCCEEDED": COUNT}, report["counts"]
    assert fleet.succeeded == COUNT
    # The broker did drop final statuses on their way, and they were read back once the
    # rollout went quiet (seconds after the burst, not the 30 s a busy rollout waits):
    assert "the rollout quiet for 1 s: reading the devices' retained statuses again" in \
        out.stderr, out.stderr[-3000:]
