"""This release against the previous one (ARCHITECTURE.md: the protocol evolves without breaking
a fleet mid-upgrade), over a real Mosquitto, the previous release installed from its commit in a
venv of its own (``previous.py``):

- this release's daemon, the previous release's controller: ``fleet devices`` decodes its
  status, two rollouts of one model (fp32, then fp16) succeed, ``fleet rollback --device`` (by
  the model's sha, the only form it knows) takes it back to the first engine;
- the previous release's daemon, this release's controller: the same, with rollouts that carry
  no model name (the daemon does not advertise named models) and a rollback by sha; its
  births are unsigned: enrolled as *legacy* by the documented upgrade path (``--admission
  open`` for devices the controller never saw), listed as such by ``fleet devices``.

This release's daemon signs its reports in MQTT v5 user properties, which the previous
controller ignores (its payloads are unchanged).
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
FP16 = os.path.join(ROOT, "examples", "fp16_max")

pytestmark = pytest.mark.slow


def fp16_max(precision):
    return ["--model", os.path.join(FP16, "model.onnx"), "--inputs",
            os.path.join(FP16, "inputs.json"), "--golden", os.path.join(FP16, "golden.json"),
            "--precision", precision, "--layer-precisions", "Add:float32", "Sub:float32",
            "--check-error-stat", "median"]


def new_cli(args, cwd, timeout=180):
    """This release's ``jetson-agent``."""
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("JETSON_AGENT_STATE_DIR", None)
    return subprocess.run([sys.executable, "-m", "agent"] + list(args), cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def ok_json(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


def exercise(run, broker, device, tmp_path):
    """devices, two rollouts, rollback; ``run(args, cwd)`` is one side's CLI."""
    cwd = str(tmp_path)
    devices = ok_json(run(["fleet", "devices", "--broker", broker.url, "--json",
                           "--wait", "0.5"], cwd))
    row = next(d for d in devices if d["device"] == device)
    assert row["online"] is True and row["backend"] == "onnxruntime", row
    for rid, precision in (("ro-a", "fp32"), ("ro-b", "fp16")):
        report = ok_json(run(["fleet", "rollout"] + fp16_max(precision) + [
            "--devices", device, "--rollout-id", rid, "--timeout", "120",
            "--broker", broker.url, "--json"], cwd))
        assert [(r["device"], r["state"]) for r in report["devices"]] == [
            (device, "SUCCEEDED")], report
    devices = ok_json(run(["fleet", "devices", "--broker", broker.url, "--json",
                           "--wait", "0.5"], cwd))
    row = next(d for d in devices if d["device"] == device)
    assert any(e.get("job_id") == "ro-b" for e in row["active_engines"]), row
    replies = ok_json(run(["fleet", "rollback", "--broker", broker.url, "--device", device,
                           "--json"], cwd))
    assert len(replies) == 1 and replies[0]["ok"], replies
    assert replies[0]["result"]["job_id"] == "ro-a", replies


def test_previous_controller_with_this_daemon(previous_release, mosquitto, agent_factory,
                                              controller, tmp_path):
    agent = agent_factory("new-dev").start()
    controller.wait_online("new-dev")
    exercise(lambda args, cwd: previous_release.cli(args, cwd), mosquitto, "new-dev",
             tmp_path)
    assert agent.alive(), agent.log_tail()


def test_this_controller_with_previous_daemon(previous_release, mosquitto,
                                              previous_agent_factory, controller, tmp_path,
                                              monkeypatch):
    """Admission on: the old daemon's births are unsigned. Under ``--admission keys`` (this
    suite's default) plain ``fleet devices`` shows it as no fleet member (``unsigned``); the
    upgrade path of docs/security.md ("Upgrading a fleet", step 1) enrols unsigned devices
    the controller has not seen yet with ``--admission open`` (an embedded rollout's
    database is new each time: every command is such a first start), as *legacy*: served
    as before, listed as legacy."""
    agent = previous_agent_factory("old-dev").start()
    controller.wait_online("old-dev")
    listed = ok_json(new_cli(["fleet", "devices", "--broker", mosquitto.url, "--json",
                              "--wait", "0"], str(tmp_path)))
    assert [(d["device"], d["admission"]) for d in listed] == [("old-dev", "unsigned")]
    monkeypatch.setenv("JETSON_AGENT_FLEET_ADMISSION", "open")
    exercise(new_cli, mosquitto, "old-dev", tmp_path)
    listed = ok_json(new_cli(["fleet", "devices", "--broker", mosquitto.url, "--json",
                              "--wait", "0"], str(tmp_path)))
    assert [(d["device"], d["admission"]) for d in listed] == [("old-dev", "legacy")]
    assert agent.alive(), agent.log_tail()
    # The device ran the previous release's code, not this checkout's.
    assert previous_release.agent_file(str(tmp_path)).startswith(previous_release.root)


def test_the_previous_release_is_pinned_and_installed_apart(previous_release, tmp_path):
    from tests.integration.compat import previous

    assert previous_release.commit == previous.PREVIOUS_RELEASE
    where = previous_release.agent_file(str(tmp_path))
    assert where.startswith(os.path.join(previous_release.root, "venv")), where
    proc = previous_release.cli(["--version"], str(tmp_path))
    assert proc.returncode == 0, proc.stderr


def test_a_clone_without_the_commit_is_told_so():
    """What the fixture skips with where git history is unavailable (a shallow clone)."""
    from tests.integration.compat import previous

    with pytest.raises(previous.Unavailable, match="git history unavailable: commit 000000000000"):
        previous.check_history("0" * 40)
