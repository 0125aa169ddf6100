"""``jetson-agent fleet`` as a user runs it: bad input is caught on the controller before
anything is published; devices, telemetry, jobs and cancel against a real Mosquitto."""

import json
import os
import subprocess
import sys
import threading

from agent import fleet
from agent.cli import main
from agent.wire import protocol, status_messages
from tests.integration.conftest import free_port
from tests.integration.test_fleet_rollout import DIGITS, FP16, ROOT, wait_status


class JobSniffer:
    """Records every job document published (live or retained) under the prefix."""

    def __init__(self, broker):
        self.conn = fleet.FleetConnection(broker.url).connect()
        self.seen = []
        self.conn.subscribe([self.conn.topics.prefix + "/devices/+/jobs/+"])
        self.conn.settle(self._on)
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _on(self, info, ev):
        if info.kind == "job":
            self.seen.append((info.device, info.job_id, ev.payload))

    def _run(self):
        while not self._stop:
            self.conn.pump(self._on, 0.1)

    def close(self):
        self._stop = True
        self.thread.join(5)
        self.conn.close()


def fp16_args(*extra):
    return ["fleet", "rollout", "--model", os.path.join(FP16, "model.onnx"), "--inputs",
            os.path.join(FP16, "inputs.json"), "--golden", os.path.join(FP16, "golden.json"),
            "--precision", "fp16"] + list(extra)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_unreachable_broker_is_a_clear_error_without_traceback():
    port = free_port()  # nothing listens there
    env = dict(os.environ, PYTHONPATH=ROOT)
    for argv in (fp16_args("--devices", "d1"), ["fleet", "devices"]):
        proc = subprocess.run([sys.executable, "-m", "agent"] + argv + [
            "--broker", "mqtt://127.0.0.1:{}".format(port), "--connect-timeout", "3"],
            capture_output=True, text=True, cwd=ROOT, env=env, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert "error [broker_unreachable]: cannot connect to the MQTT broker at " \
               "127.0.0.1:{}".format(port) in proc.stderr
        assert "Traceback" not in proc.stderr


BAD_INPUT = [
    (fp16_args("--devices", "ghost"), "unknown_device", ["ghost", "never reported"]),
    (["fleet", "rollout", "--model", "/nonexistent/model.onnx", "--precision", "fp16",
      "--devices", "d1"], "file_not_found", ["/nonexistent/model.onnx"]),
    (["fleet", "rollout", "--model", os.path.join(FP16, "model.onnx"), "--inputs",
      os.path.join(DIGITS, "inputs.json"), "--golden", os.path.join(DIGITS, "golden.json"),
      "--precision", "fp16", "--devices", "d1"], "golden_mismatch", ["input", "x"]),
    (["fleet", "rollout", "--model", os.path.join(DIGITS, "model.onnx"), "--inputs",
      os.path.join(DIGITS, "inputs.json"), "--golden", os.path.join(FP16, "golden.json"),
      "--precision", "fp16", "--devices", "d1"], "golden_mismatch", ["golden"]),
    (["fleet", "rollout", "--model", os.path.join(DIGITS, "model.onnx"), "--golden",
      os.path.join(DIGITS, "golden.json"), "--precision", "fp16", "--devices", "d1"],
     "golden_mismatch", ["--inputs"]),
    (["fleet", "rollout", "--model", os.path.join(DIGITS, "model.onnx"), "--precision", "int8",
      "--devices", "d1"], "bad_argument", ["--calib"]),
    (["fleet", "rollout", "--model", os.path.join(DIGITS, "model.onnx"), "--calib",
      os.path.join(FP16, "inputs.json"), "--precision", "int8", "--devices", "d1"],
     "bad_calibration_data", []),
    (fp16_args("--labels", os.path.join(DIGITS, "labels.npy"), "--devices", "d1"),
     "golden_mismatch", ["labels"]),
    (fp16_args("--layer-precisions", "Nope:float32", "--devices", "d1"), "unknown_layer",
     ["Nope"]),
    (fp16_args("--search", "minimal", "--precision", "fp32", "--devices", "d1"),
     "bad_argument", ["fp32"]),
    (fp16_args("--abort-failure-rate", "1.5", "--devices", "d1"), "bad_argument",
     ["--abort-failure-rate"]),
    (fp16_args("--devices", "d1", "--batch", "0"), "bad_argument", ["--batch"]),
    # the devices' models directory links current -> the active version
    (fp16_args("--name", "det", "--version", "current", "--devices", "d1"), "bad_argument",
     ["'current'", "link to the active version"]),
]


def test_bad_input_is_caught_before_anything_is_published(mosquitto, capsys, monkeypatch):
    # d1 is a hand-made, unsigned birth: a lab controller admits it (--admission open).
    monkeypatch.setenv("JETSON_AGENT_FLEET_ADMISSION", "open")
    sniffer = JobSniffer(mosquitto)
    try:
        status = protocol.encode(status_messages.status_message("d1", True, 1))
        sniffer.conn.publish(sniffer.conn.topics.status("d1"), status, retain=True, wait=5)
        for argv, code, words in BAD_INPUT:
            rc, out, err = run_cli(capsys, *(argv + ["--broker", mosquitto.url, "--json"]))
            assert rc == 2, (argv, out, err)
            assert json.loads(out)["error"]["code"] == code, (argv, out)
            for word in words:
                assert word in err, (argv, err)
        sniffer.conn.pump(sniffer._on, 0.5)
    finally:
        sniffer.close()
    assert sniffer.seen == []


def test_devices_telemetry_jobs_and_cancel(mosquitto, agent_factory, capsys):
    agent = agent_factory("dev1").start()
    gone = agent_factory("dev-gone").start()
    wait_status(mosquitto, ["dev1", "dev-gone"], agents=[agent, gone])
    assert gone.stop() == 0
    wait_status(mosquitto, ["dev-gone"], online=False)
    broker = ["--broker", mosquitto.url]

    rc, out, _ = run_cli(capsys, "fleet", "devices", "--json", "--wait", "1.5", *broker)
    devices = {d["device"]: d for d in json.loads(out)}
    assert rc == 0 and set(devices) == {"dev1", "dev-gone"}
    assert devices["dev1"]["online"] is True and devices["dev-gone"]["online"] is False
    assert devices["dev-gone"]["reason"] == "shutdown"
    assert devices["dev1"]["backend"] == "onnxruntime"
    assert "int8" in devices["dev1"]["precisions"]
    assert devices["dev1"]["telemetry"]["source"] == "host"  # telemetry every second
    rc, out, _ = run_cli(capsys, "fleet", "devices", *broker)
    assert rc == 0 and out.startswith("DEVICE") and "no (shutdown)" in out

    rc, out, _ = run_cli(capsys, "fleet", "telemetry", "dev1", "--json", *broker)
    assert rc == 0 and json.loads(out)["device"] == "dev1"
    rc, _, err = run_cli(capsys, "fleet", "telemetry", "dev-gone", "--timeout", "1", *broker)
    assert rc == 1 and "offline" in err
    rc, out, _ = run_cli(capsys, "fleet", "telemetry", "nobody", "--json", *broker)
    assert rc == 2 and json.loads(out)["error"]["code"] == "unknown_device"

    # A rollout to an offline device gives up after --timeout: the document is cleared.
    rc, out, _ = run_cli(capsys, *fp16_args("--devices", "dev-gone", "--timeout", "2",
                                            "--rollout-id", "ro-t", "--json", *broker))
    report = json.loads(out)
    assert rc == 1 and report["outcome"] == "timed_out"
    assert report["devices"][0]["state"] == "TIMED_OUT"
    rc, out, _ = run_cli(capsys, "fleet", "jobs", "--json", *broker)
    assert [j for j in json.loads(out) if j["pending_document"]] == []

    # A job document left for an offline device: jobs lists it, cancel clears it.
    conn = fleet.FleetConnection(mosquitto.url).connect()
    doc = fleet.job_document("left-1", "deploy", "dev-gone", {"model": {
        "sha256": "b" * 64, "size": 1}}, {"precision": "fp16"})
    conn.publish(conn.topics.job("dev-gone", "left-1"), protocol.encode(doc), retain=True,
                 wait=5)
    conn.close()
    rc, out, _ = run_cli(capsys, "fleet", "jobs", *broker)
    assert rc == 0 and "left-1" in out and "SENT" in out
    rc, out, _ = run_cli(capsys, "fleet", "cancel", "left-1", "--wait", "1", *broker)
    assert rc == 0 and "dev-gone left-1: no reply (device offline" in out
    assert "retained job document cleared" in out
    rc, out, _ = run_cli(capsys, "fleet", "jobs", "--json", *broker)
    assert [j for j in json.loads(out) if j["job_id"] == "left-1"] == []
    rc, out, _ = run_cli(capsys, "fleet", "cancel", "left-1", "--json", *broker)
    assert rc == 2 and json.loads(out)["error"]["code"] == "unknown_job"
