"""A running app through a fleet rollback by name: the example inference app (examples/app)
serves ``digits`` from a real daemon's models directory under load; v1 and v2 go out with
``fleet rollout --name digits`` (the app confirms each: ``models.app_confirms``), then ``fleet
rollback --name digits`` takes the device back to v1: ``current`` switches, the app serves v1
again, and no request fails on the way."""

import json
import os
import sys

import pytest

from tests.integration.test_fleet_rollout import wait_status
from tests.integration.test_fleet_service import fleet_cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, os.path.join(EXAMPLES, "app"))

import demo_flow  # noqa: E402
from loadgen import LoadGen  # noqa: E402

pytestmark = pytest.mark.slow


def rollout(broker, version, folder):
    out = fleet_cli(["rollout", "--name", "digits", "--version", version,
                     "--model", os.path.join(EXAMPLES, folder, "model.onnx"),
                     "--inputs", os.path.join(EXAMPLES, "digits", "inputs.json"),
                     "--golden", os.path.join(EXAMPLES, folder, "golden.json"),
                     "--precision", "fp32", "--atol", "0.5", "--rtol", "0.5",
                     "--check-error-stat", "mean", "--devices", "app-1",
                     "--broker", broker.url, "--timeout", "120", "--json"], timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_fleet_rollback_by_name_takes_a_running_app_back_to_v1(mosquitto, agent_factory,
                                                               tmp_path):
    agent = agent_factory("app-1", extra_config=(
        "models:\n  commit_timeout_s: 60\n  app_confirms: [digits]\n")).start()
    wait_status(mosquitto, ["app-1"], agents=[agent])
    models_dir = os.path.join(agent.state_dir, "models")
    app = demo_flow.AppProcess(str(tmp_path / "app"), "digits", models_dir,
                               os.path.join(agent.state_dir, "app.sock")).start()
    load = None
    try:
        rollout(mosquitto, "v1", "digits")  # ends SUCCEEDED once the app reported v1 healthy
        app.wait(lambda s: s["serving"] == "v1", 60, "v1 serving")
        load = LoadGen(app.url, threads=2, rate=50).start()
        rollout(mosquitto, "v2", "digits_v2")
        app.wait_serving("v2", 60)

        out = fleet_cli(["rollback", "--name", "digits", "--device", "app-1",
                         "--broker", mosquitto.url, "--json"])
        assert out.returncode == 0, out.stdout + out.stderr
        reply = json.loads(out.stdout)[0]
        assert reply["ok"] and reply["result"]["version"] == "v1", reply
        assert reply["result"]["replaced"] == "v2", reply
        assert demo_flow.current_version(models_dir) == "v1"
        app.wait_serving("v1", 60)
        served = load.stop()
        load = None
        stats = app.stats()
    finally:
        if load is not None:
            load.stop()
        app.stop()
    assert served["failed"] == 0 and served["ok"] > 0, served
    assert {"v1", "v2"} <= set(served["by_version"]), served
    assert not stats["rejected"], stats
    assert agent.stop() == 0
