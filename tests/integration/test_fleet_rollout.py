"""Staged rollouts with real agents over a real Mosquitto (onnxruntime backend).

- One device on a recorded Jetson Nano platform root is asked for int8 (Nano has none): it
  answers REJECTED unsupported_precision, the abort threshold stops the rollout, and the
  devices still queued (one published but offline, one in a later stage) are cancelled; the
  offline one never runs the job when it comes back.
- A device that is offline when the rollout starts picks its job up when it comes online
  (the controller takes block requests through an MQTT v5 shared subscription).
"""

import json
import os
import subprocess
import sys
import time

from agent import fleet
from agent.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
NANO = os.path.join(ROOT, "tests", "fixtures", "platforms", "nano")
DIGITS = os.path.join(EXAMPLES, "digits")
FP16 = os.path.join(EXAMPLES, "fp16_max")


def digits_args():
    return ["--model", os.path.join(DIGITS, "model.onnx"), "--calib",
            os.path.join(DIGITS, "calib"), "--inputs", os.path.join(DIGITS, "inputs.json"),
            "--golden", os.path.join(DIGITS, "golden.json"), "--labels",
            os.path.join(DIGITS, "labels.npy"), "--precision", "int8", "--atol", "0.5",
            "--rtol", "0.5", "--check-error-stat", "mean", "--min-top1", "0.95"]


def directory(broker):
    conn = fleet.FleetConnection(broker.url).connect()
    try:
        return fleet.discover(conn).status
    finally:
        conn.close()


def wait_status(broker, devices, online=True, timeout=40, agents=()):
    """Until each of ``devices`` says ``online`` in its retained status: one subscription,
    woken by each message (a test's fleet fits the broker's queue: no roll call needed, and
    no new connection and settle per look)."""
    deadline = time.monotonic() + timeout
    conn = fleet.FleetConnection(broker.url).connect()
    try:
        conn.subscribe([conn.topics.prefix + "/devices/+/status"])
        while True:
            seen = dict(conn.directory.status)
            if all((seen.get(d) or {}).get("online") is online for d in devices):
                return seen
            for agent in agents:
                assert agent.alive() or not online, agent.log_tail()
            assert time.monotonic() < deadline, "devices {} not online={}: {}".format(
                devices, online, seen)
            conn.pump(lambda info, msg: None, 0.1)
    finally:
        conn.close()


def retained_jobs(broker):
    """(device, job id) -> job document still retained on the broker."""
    conn = fleet.FleetConnection(broker.url).connect()
    found = {}

    def on_message(info, ev):
        if info.kind == "job" and ev.payload:
            found[(info.device, info.job_id)] = json.loads(ev.payload)

    try:
        conn.subscribe([conn.topics.prefix + "/devices/+/jobs/+"])
        conn.settle(on_message)
    finally:
        conn.close()
    return found


def test_abort_threshold_stops_the_rollout_and_cancels_queued_devices(
        mosquitto, agent_factory, capsys):
    nano = agent_factory("nano-1", "platform_root: {}\n".format(NANO)).start("--backend",
                                                                             "auto")
    late = agent_factory("dev-off").start()
    good = agent_factory("dev-b").start()
    wait_status(mosquitto, ["nano-1", "dev-off", "dev-b"], agents=[nano, late, good])
    assert late.stop() == 0  # known to the broker, offline when the rollout starts
    wait_status(mosquitto, ["dev-off"], online=False)

    code = main(["fleet", "rollout"] + digits_args() + [
        "--devices", "nano-1", "dev-off", "dev-b", "--batch", "2",
        "--abort-failure-rate", "0.5", "--min-executed", "1", "--timeout", "60",
        "--rollout-id", "ro-abort", "--broker", mosquitto.url, "--json"])
    out, err = capsys.readouterr()
    assert code == 1, err
    report = json.loads(out)
    assert report["outcome"] == "aborted"
    assert "exceeds the abort threshold 50%" in report["reason"]
    assert report["stages"] == [["nano-1", "dev-off"], ["dev-b"]]
    rows = {r["device"]: r for r in report["devices"]}
    assert rows["nano-1"]["state"] == "REJECTED"
    assert rows["nano-1"]["error_code"] == "unsupported_precision"
    assert "int8" in rows["nano-1"]["error_message"]
    assert rows["nano-1"]["board"] == "NVIDIA Jetson Nano Developer Kit"
    assert rows["dev-off"]["state"] == "CANCELED"
    assert rows["dev-off"]["note"].startswith("cancelled while queued: failure rate 1/1")
    assert rows["dev-b"]["state"] == "CANCELED"
    assert rows["dev-b"]["note"].startswith("not started: failure rate 1/1")
    assert "dev-off: QUEUED deploy (device offline)" in err  # the live progress said so
    assert retained_jobs(mosquitto) == {}  # every job document was cleared

    # The text table says why.
    table = fleet.results_table(report["devices"])
    assert "unsupported_precision [1]" in table and "not started: failure rate" in table

    # The offline device comes back. Its MQTT session kept the job document, then the cancel
    # command: the job is cancelled before it starts (or never seen), and nothing is fetched.
    late.start()
    wait_status(mosquitto, ["dev-off"], agents=[late])
    time.sleep(1.0)
    with late.journal() as journal:
        row = journal.job("ro-abort")
        assert row is None or (row["state"] == "CANCELED" and row["result"] is None), row
        assert journal.transfers() == []
    assert not os.listdir(os.path.join(late.state_dir, "artifacts")) or all(
        not files for _, _, files in os.walk(os.path.join(late.state_dir, "artifacts")))
    with good.journal() as journal:
        assert journal.job("ro-abort") is None


def test_offline_device_picks_up_its_job_when_it_comes_online(mosquitto, agent_factory):
    agent = agent_factory("dev-late").start()
    wait_status(mosquitto, ["dev-late"], agents=[agent])
    assert agent.stop() == 0
    wait_status(mosquitto, ["dev-late"], online=False)

    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "fleet", "rollout", "--model",
         os.path.join(FP16, "model.onnx"), "--inputs", os.path.join(FP16, "inputs.json"),
         "--golden", os.path.join(FP16, "golden.json"), "--precision", "fp16",
         "--layer-precisions", "Add:float32", "Sub:float32", "--check-error-stat", "median",
         "--devices", "dev-late", "--timeout", "90", "--rollout-id", "ro-late",
         "--share-group", "controllers",
         "--broker", mosquitto.url, "--json"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=ROOT, text=True)
    try:
        deadline = time.monotonic() + 30
        while ("dev-late", "ro-late") not in retained_jobs(mosquitto):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the job document was never published"
            time.sleep(0.3)
        agent.start()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, (out, err, agent.log_tail())
    report = json.loads(out)
    row = report["devices"][0]
    assert report["outcome"] == "succeeded"
    assert row["state"] == "SUCCEEDED" and row["precision"] == "fp16"
    assert row["layers_kept"] == {"Add": "float32", "Sub": "float32"}
    assert row["accuracy"]["passed"] is True
    assert row["throughput_qps"] > 0 and row["latency_p99_ms"] > 0
    assert "dev-late: QUEUED deploy (device offline)" in err
    assert retained_jobs(mosquitto) == {}
