"""Live inputs on a real daemon (real Mosquitto, onnxruntime, the digits classifier in INT8):
the app donates its inputs through ``agent.client``; a version whose classes are rotated (its
own goldens pass the gate) is refused by the live check (``live_check_failed``) and the running
version stays; an identical version commits with the figures in its job result and meta.json;
with no samples the check is skipped and says so; a version pending across a kill -9 before
its check ended is checked again after the restart. Inputs squeezed into a sub-range of the
calibration data (nothing clipped) drift, inputs scaled beyond it clip: either gives the name
the ``calibration_stale`` problem (in-distribution inputs none); ``models recalibrate`` /
``models samples export`` turn the donations into files."""

import json
import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from agent import client
from agent.wire import protocol
from scripts.make_examples import rotate_classes
from tests.integration.conftest import ROOT
from tests.integration.test_daemon_deploy import deploy_doc
from tests.unit.device.test_model_sets_pins import assert_meta_valid

CONFIG = ("telemetry_interval: 0.5\nmodels:\n  commit_timeout_s: 60\n  live_check:\n"
          "    min_samples: 16\n    keep: 128\n    every_s: 1\n    max_clip_rate: 0.01\n"
          "    max_drift: 0.2\n")


def deploy(controller, files, job_id, version, precision="int8"):
    doc = deploy_doc(controller, files, job_id, precision, model_name="digits",
                     model_version=version)
    doc["bench"] = {"iterations": 3, "warmup": 1}
    controller.send_job(doc)
    return controller.wait_state(job_id, protocol.TERMINAL_STATES, timeout=120)


def cli(agent, *args):
    out = subprocess.run([sys.executable, "-m", "agent", "models"] + list(args) +
                         ["--state-dir", agent.state_dir, "--json"], capture_output=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return json.loads(out.stdout.decode())


@pytest.fixture(scope="module")
def rotated(tmp_path_factory, digits_files):
    """The digits model with its classes rotated, and goldens of its own (so the gate passes)."""
    import onnx
    import onnxruntime as ort

    d = tmp_path_factory.mktemp("rotated")
    model = rotate_classes(onnx.load(digits_files["model"]))
    onnx.save(model, str(d / "model.onnx"))
    x = np.load(digits_files["inputs"])["input"]
    sess = ort.InferenceSession(str(d / "model.onnx"), providers=["CPUExecutionProvider"])
    np.savez(str(d / "goldens.npz"), logits=sess.run(["logits"], {"input": x})[0])
    return dict(digits_files, model=str(d / "model.onnx"), goldens=str(d / "goldens.npz"))


def test_live_check_refuses_rotated_commits_identical_and_watches_int8_ranges(
        controller, agent_factory, digits_files, rotated, tmp_path):
    files = {k: digits_files[k] for k in ("model", "calibration", "inputs", "goldens")}
    agent = agent_factory(extra_config=CONFIG).start()
    controller.wait_online()
    sock = os.path.join(agent.state_dir, "app.sock")
    current = os.path.join(agent.state_dir, "models", "digits", "current")

    first = deploy(controller, files, "live-1", "v1")
    assert first["state"] == "SUCCEEDED", agent.log_tail()
    assert "no committed version" in first["result"]["live_check"]["skipped"]
    # No samples yet: v2 is not checked, and says so.
    second = deploy(controller, files, "live-2", "v2")
    assert second["state"] == "SUCCEEDED", agent.log_tail()
    assert "0 donated samples" in second["result"]["live_check"]["skipped"]

    # The app donates its real inputs: a batch, then one sample (never blocking), and a
    # hostile one is refused with the reason.
    x = np.load(digits_files["inputs"])["input"][:64]
    reply = client.donate("digits", {"input": x}, socket_path=sock, wait=True)
    assert reply["kept"] == 64 and reply["samples"] == 64, reply
    with pytest.raises(client.ClientError) as bad:
        client.donate("digits", {"input": x.astype(np.float64)}, socket_path=sock, wait=True)
    assert bad.value.code == "bad_donation" and "float32" in bad.value.message
    with pytest.raises(client.ClientError) as bad:
        client.donate("digits", {"image": x}, socket_path=sock, wait=True)
    assert bad.value.code == "bad_donation" and "expected inputs input" in bad.value.message
    queued = client.donate("digits", {"input": x[0]}, socket_path=sock)
    assert queued.get("queued") or queued.get("dropped"), queued

    refused = deploy(controller, dict(rotated, calibration=files["calibration"]), "live-3", "v3")
    assert refused["state"] == "FAILED", refused
    assert refused["error"]["code"] == "live_check_failed", refused["error"]
    figures = refused["error"]["details"]["live_check"]
    assert figures["agreement"] < 0.5 and figures["running"] == "v2" and figures["worst"]
    assert os.readlink(current) == "v2"

    same = deploy(controller, files, "live-4", "v4")
    assert same["state"] == "SUCCEEDED", (same, agent.log_tail())
    live = same["result"]["live_check"]
    assert live["passed"] and live["agreement"] == 1.0 and live["samples"] >= 64, live
    assert os.readlink(current) == "v4"
    with open(os.path.join(current, "meta.json")) as f:  # what the app reads
        assert json.load(f)["live_check"]["agreement"] == 1.0

    # INT8 ranges in the field: in-distribution inputs clip little; inputs scaled 4x beyond
    # the calibration data clip more than max_clip_rate and the name has calibration_stale.
    def field():
        listed = client.request({"op": "list"}, sock)["models"]
        return next(m for m in listed if m["name"] == "digits")

    calm = controller.wait_for(lambda: field().get("field"), 30, "field figures")
    assert calm["clip_max"] <= 0.01 and calm["drifted"] == [], calm
    assert field()["health"] == "ok"
    # Drift alone: the same inputs squeezed into a quarter of their range clip nothing, but
    # their histogram is not the calibration set's.
    for rows in (x, x):
        client.donate("digits", {"input": rows * 0.25}, socket_path=sock, wait=True)
    drifted = controller.wait_for(
        lambda: field() if field()["health"].startswith("calibration_stale") else None, 30,
        "calibration_stale by drift")
    assert drifted["field"]["drifted"] == ["input"] and drifted["field"]["stale"] == []
    assert drifted["field"]["clip_max"] <= 0.01 and "drifted" in drifted["health"], drifted
    assert "input 0.3" in drifted["health"], drifted["health"]
    controller.wait_for(lambda: any(t["metrics"].get("int8_input_drift.digits", 0) > 0.3
                                    for t in controller.telemetry), 30, "drift in telemetry")
    client.donate("digits", {"input": x * 4.0}, socket_path=sock, wait=True)
    client.donate("digits", {"input": x[:64] * 4.0}, socket_path=sock, wait=True)
    stale = controller.wait_for(lambda: field() if field()["field"]["stale"] else None, 30,
                                "calibration_stale by clipping")
    assert stale["health"].startswith("calibration_stale"), stale
    assert stale["field"]["clip_max"] > 0.01 and stale["field"]["stale"], stale
    controller.wait_for(lambda: any(t["metrics"].get("int8_clip_rate.digits", 0) > 0.01
                                    for t in controller.telemetry), 30, "telemetry")
    shown = cli(agent, "show", "digits")
    assert shown["live_check"]["passed"] and shown["meta"]["live_check"]["agreement"] == 1.0
    assert_meta_valid(shown["meta"])
    assert shown["field"]["stale"] and "calibration_inputs" in shown["meta"]
    assert shown["field"]["inputs"]["input"]["drift"]["hist_distance"] > 0.3

    made = cli(agent, "recalibrate", "digits", "--out", str(tmp_path / "calib"))
    assert made["samples"] == 128 and made["shards"] == ["shard_000.npz", "shard_001.npz"]
    shard = np.load(os.path.join(made["dir"], "shard_000.npz"))
    assert shard["input"].shape == (64, 64) and shard["input"].dtype == np.float32
    built = subprocess.run([sys.executable, "-m", "agent", "build", digits_files["model"],
                            "--int8", "--calib", made["dir"], "--state-dir",
                            str(tmp_path / "build"), "--json"], capture_output=True,
                           env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert built.returncode == 0, built.stderr.decode()  # the next build calibrates on it
    assert json.loads(built.stdout.decode())["precision"] == "int8"
    out = cli(agent, "samples", "export", "digits", "--out", str(tmp_path / "s.npz"))
    assert np.load(out["out"])["input"].shape == (128, 64)
    assert agent.stop() == 0


HELD = """#!{python}
# The live check's child process waits while HOLD exists, after touching STARTED (its parent
# killed meanwhile: it gives up); every other child runs straight through.
import json, os, subprocess, sys, time
if sys.argv[1:3] == ["-m", "agent.worker.live"]:
    request, parent = sys.stdin.buffer.read(), os.getppid()
    if json.loads(request.decode()).get("op") == "check" and os.path.exists({hold!r}):
        open({started!r}, "w").close()
        while os.path.exists({hold!r}):
            if os.getppid() != parent:
                sys.exit(1)
            time.sleep(0.05)
    sys.exit(subprocess.run([sys.executable] + sys.argv[1:], input=request).returncode)
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


def test_a_version_pending_across_a_kill_is_live_checked_again(
        controller, agent_factory, digits_files, rotated, tmp_path):
    """kill -9 while the rotated version's live check runs: after the restart the check runs
    again (nothing recorded its end), refuses the version and the running one stays."""
    hold, started, python = tmp_path / "hold", tmp_path / "started", tmp_path / "python"
    python.write_text(HELD.format(python=sys.executable, hold=str(hold), started=str(started)))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    agent = agent_factory(extra_config=CONFIG + "worker_python: {}\n".format(python)).start()
    controller.wait_online()
    sock = os.path.join(agent.state_dir, "app.sock")
    plain = {k: digits_files[k] for k in ("model", "inputs", "goldens")}
    assert deploy(controller, plain, "kill-1", "v1", "fp32")["state"] == "SUCCEEDED", \
        agent.log_tail()
    x = np.load(digits_files["inputs"])["input"][:64]
    assert client.donate("digits", {"input": x}, socket_path=sock, wait=True)["kept"] == 64

    hold.touch()
    controller.send_job(deploy_doc(controller, {k: rotated[k] for k in plain}, "kill-2",
                                   "fp32", model_name="digits", model_version="v2"))
    controller.wait_for(started.exists, 120, "the live check under way")
    agent.kill()
    with agent.journal() as journal:
        assert journal.model_version("digits", "v2")["state"] == "pending"
    hold.unlink()
    agent.start()
    final = controller.wait_state("kill-2", protocol.TERMINAL_STATES, timeout=120)
    assert final["state"] == "FAILED", (final, agent.log_tail())
    assert final["error"]["code"] == "live_check_failed", final["error"]
    figures = final["error"]["details"]["live_check"]
    assert figures["agreement"] < 0.5 and figures["running"] == "v1", figures
    assert os.readlink(os.path.join(agent.state_dir, "models", "digits", "current")) == "v1"
    assert agent.stop() == 0
