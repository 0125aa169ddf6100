"""``fleet rollout/devices/jobs/cancel`` as a newcomer meets them, through the real entry point
with real agents and Mosquitto: no rollout without an accuracy gate unless asked (and then the
table says "not gated"); ``--dry-run`` shows the plan and each device's decision and publishes
nothing; a halted stage names the device whose failure halted it; the table shows the gate's
statistic; finished jobs show no stage; offline devices keep their board; ``fleet cancel``
reports the device's own final state; Ctrl-C on an embedded rollout does what --help says."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from agent.cli import main
from tests.integration.test_daemon_cancel import (
    deep_files,  # noqa: F401 - fixture
    worker_pid,
)
from tests.integration.test_fleet_cli import JobSniffer, run_cli
from tests.integration.test_fleet_rollout import (
    DIGITS,
    FP16,
    NANO,
    ROOT,
    digits_args,
    wait_status,
)

UNGATED = ["--model", os.path.join(DIGITS, "model.onnx"), "--precision", "fp32"]
FP16_MEDIAN = ["--model", os.path.join(FP16, "model.onnx"), "--inputs",
               os.path.join(FP16, "inputs.json"), "--golden", os.path.join(FP16, "golden.json"),
               "--precision", "fp16", "--layer-precisions", "Add:float32", "Sub:float32",
               "--check-error-stat", "median"]


def test_no_gate_is_refused_and_dry_run_publishes_nothing(mosquitto, agent_factory, capsys):
    nano = agent_factory("nano-1", "platform_root: {}\n".format(NANO)).start("--backend",
                                                                             "auto")
    host = agent_factory("host-1").start()
    wait_status(mosquitto, ["nano-1", "host-1"], agents=[nano, host])
    broker = ["--broker", mosquitto.url]
    sniffer = JobSniffer(mosquitto)
    try:
        rc, out, err = run_cli(capsys, "fleet", "rollout", *UNGATED, "--devices", "host-1",
                               "--json", *broker)
        assert rc == 2 and json.loads(out)["error"]["code"] == "no_accuracy_gate"
        assert "--golden" in err and "--no-accuracy-gate" in err

        rc, out, err = run_cli(capsys, "fleet", "rollout", *digits_args(), "--devices",
                               "nano-1", "host-1", "--batch", "1", "--rollout-id", "ro-dry",
                               "--dry-run", "--json", *broker)
        assert rc == 0, err
        plan = json.loads(out)
        assert plan["dry_run"] is True and plan["published"] is False
        assert plan["stages"] == [["nano-1"], ["host-1"]]
        assert plan["job_ids"] == ["ro-dry"]
        assert set(plan["artifacts"]) >= {"model", "calibration", "inputs", "goldens",
                                          "labels"}
        assert plan["gate"]["gated"] and plan["gate"]["stat"] == "mean"
        decisions = {d["device"]: d for d in plan["devices"]}
        assert decisions["nano-1"]["board"] == "NVIDIA Jetson Nano Developer Kit"
        assert decisions["nano-1"]["decision"]["status"] == "rejected"
        assert "int8 is not supported" in decisions["nano-1"]["decision"]["reason"]
        assert decisions["host-1"]["decision"]["status"] == "accepted"
        assert decisions["host-1"]["decision"]["precision"] == "int8"

        rc, out, err = run_cli(capsys, "fleet", "rollout", *UNGATED, "--no-accuracy-gate",
                               "--fallback", "allow", "--all", "--dry-run", *broker)
        assert rc == 0, err
        assert "nothing was published" in out and "gate:      not gated" in out
        assert "WOULD" in out and "accepted fp32" in out
        sniffer.conn.pump(sniffer._on, 0.5)
    finally:
        sniffer.close()
    assert sniffer.seen == []  # neither the refused rollout nor the dry runs published


def test_halt_reason_gate_statistic_not_gated_jobs_and_devices(mosquitto, agent_factory,
                                                                capsys, tmp_path):
    nano = agent_factory("nano-2", "platform_root: {}\n".format(NANO)).start("--backend",
                                                                             "auto")
    late = agent_factory("ux-off").start()
    good = agent_factory("ux-b").start()
    wait_status(mosquitto, ["nano-2", "ux-off", "ux-b"], agents=[nano, late, good])
    assert late.stop() == 0
    wait_status(mosquitto, ["ux-off"], online=False)
    broker = ["--broker", mosquitto.url]
    db = ["--db", "sqlite:///" + str(tmp_path / "fleet.db")]  # embedded, kept: fleet jobs

    # The default success threshold (1.0): nano-2's REJECTED halts stage 1; the others say so.
    rc, out, err = run_cli(capsys, "fleet", "rollout", *digits_args(), "--devices", "nano-2",
                           "ux-off", "ux-b", "--batch", "2", "--timeout", "60",
                           "--rollout-id", "ro-halt", "-q", *broker)
    assert rc == 1, err
    assert "stage 1 halted by nano-2 REJECTED (unsupported_precision: " in out
    assert "ux-off: cancelled while queued: stage 1 halted by nano-2 REJECTED" in out
    assert "ux-b: not started: stage 1 halted by nano-2 REJECTED" in out
    assert "cancelled by the controller" not in out or "halted by nano-2" in out

    # The table shows the gate's statistic; an ungated rollout says "not gated".
    rc, out, err = run_cli(capsys, "fleet", "rollout", *FP16_MEDIAN, "--devices", "ux-b",
                           "--rollout-id", "ro-median", "-q", *db, *broker)
    assert rc == 0, err
    assert "median|err| " in out and "max|err|" not in out
    rc, out, err = run_cli(capsys, "fleet", "rollout", *UNGATED, "--no-accuracy-gate",
                           "--devices", "ux-b", "--rollout-id", "ro-ungated", "--json", *db,
                           *broker)
    assert rc == 0, err
    report = json.loads(out)
    assert report["gate"]["gated"] is False and report["devices"][0]["gated"] is False
    from agent import fleet

    assert "not gated" in fleet.results_table(report["devices"])

    # A finished job has no stage (the device's last one was "activating").
    rc, out, _ = run_cli(capsys, "fleet", "jobs", "--json", "--device", "ux-b", *db)
    jobs = [j for j in json.loads(out) if j["state"] == "SUCCEEDED"]
    assert rc == 0 and len(jobs) == 2 and all(j["stage"] is None for j in jobs), out
    rc, out, _ = run_cli(capsys, "fleet", "jobs", "--device", "ux-b", *db)
    assert "activating" not in out

    # Telemetry with units; after a shutdown the device keeps its board, with last seen.
    rc, out, _ = run_cli(capsys, "fleet", "devices", "--wait", "1.5", *broker)
    assert rc == 0 and "LAST SEEN" in out and " %" in out
    assert good.stop() == 0
    wait_status(mosquitto, ["ux-b"], online=False)
    rc, out, _ = run_cli(capsys, "fleet", "devices", "--json", *broker)
    rows = {d["device"]: d for d in json.loads(out)}
    assert rows["ux-b"]["online"] is False and rows["ux-b"]["board"]
    assert rows["ux-off"]["board"] and isinstance(rows["ux-b"]["last_seen"], float)


def _job_state(broker_url, device, job_id):
    from agent import fleet

    conn = fleet.FleetConnection(broker_url).connect()
    found = {}

    def on_message(info, msg):
        if info.kind == "job_status" and info.job_id == job_id and info.device == device:
            found["state"] = msg.get("state")

    try:
        conn.subscribe([conn.topics.job_status(device, job_id)])
        conn.settle(on_message)
    finally:
        conn.close()
    return found.get("state")


def _embedded_search(mosquitto, files, device, rollout_id):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.Popen(
        [sys.executable, "-m", "agent", "fleet", "rollout", "--model", files["model"],
         "--inputs", files["inputs"], "--golden", files["goldens"], "--precision", "fp16",
         "--atol", "1e-7", "--rtol", "1e-7", "--search", "linear", "--devices", device,
         "--rollout-id", rollout_id, "--embedded", "--broker", mosquitto.url, "--timeout",
         "120"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_running(mosquitto, device, job_id, proc):
    deadline = time.monotonic() + 60
    while _job_state(mosquitto.url, device, job_id) != "IN_PROGRESS":
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the search never started"
        time.sleep(0.3)


def _sigterm_pending(pid):
    """Whether a SIGTERM waits on the (stopped) process: the daemon has acted on the cancel."""
    with open("/proc/{}/status".format(pid)) as f:
        masks = [int(line.split()[1], 16) for line in f if line.startswith(("SigPnd:",
                                                                            "ShdPnd:"))]
    return any(m & (1 << (signal.SIGTERM - 1)) for m in masks)


@contextlib.contextmanager
def _held_search(agent, job_id):
    """The device's search worker stopped (SIGSTOP) until the daemon signals it to end, then
    resumed: the search cannot finish before the cancel lands, however loaded the host (a
    race on the search's length alone, which a loaded host can lose)."""
    pid = worker_pid(agent, job_id, timeout=120)
    os.killpg(pid, signal.SIGSTOP)
    done = threading.Event()

    def resume_once_signalled():
        try:
            while not done.is_set() and not _sigterm_pending(pid):
                done.wait(0.02)
        except OSError:  # already gone
            pass
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGCONT)

    thread = threading.Thread(target=resume_once_signalled, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10)


@pytest.mark.slow
def test_cancel_reports_the_final_state_and_ctrl_c_matches_help(
        mosquitto, agent_factory, deep_files, capsys):  # noqa: F811 - fixture
    agent = agent_factory("ux-c").start()
    wait_status(mosquitto, ["ux-c"], agents=[agent])
    broker = ["--broker", mosquitto.url]

    # fleet cancel while the device searches: the answer is its own final state.
    proc = _embedded_search(mosquitto, deep_files, "ux-c", "ro-cancel")
    try:
        with _held_search(agent, "ro-cancel.search"):
            _wait_running(mosquitto, "ux-c", "ro-cancel.search", proc)
            rc, out, err = run_cli(capsys, "fleet", "cancel", "ro-cancel", "--json", *broker)
        assert rc == 0, err
        row = json.loads(out)[0]
        assert row["outcome"] == "cancelled" and row["final_state"] == "CANCELED", row
        with agent.journal() as journal:
            assert journal.job("ro-cancel.search")["state"] == "CANCELED"
        _, ctl_err = proc.communicate(timeout=60)
        assert proc.returncode == 1, ctl_err
    finally:
        proc.kill()

    # Ctrl-C on an embedded rollout: as --help says, the running device is cancelled too.
    help_text = subprocess.run([sys.executable, "-m", "agent", "fleet", "rollout", "--help"],
                               capture_output=True, text=True, cwd=ROOT,
                               env=dict(os.environ, PYTHONPATH=ROOT)).stdout
    help_text = " ".join(help_text.split())
    assert "Ctrl-C embedded" in help_text and "running ones included" in help_text
    proc = _embedded_search(mosquitto, deep_files, "ux-c", "ro-intr")
    try:
        with _held_search(agent, "ro-intr.search"):
            _wait_running(mosquitto, "ux-c", "ro-intr.search", proc)
            proc.send_signal(signal.SIGINT)
            _, ctl_err = proc.communicate(timeout=60)
        assert proc.returncode == 130, ctl_err
        assert "cancelling 1 unfinished device(s), running ones included" in ctl_err
        deadline = time.monotonic() + 30
        while True:
            with agent.journal() as journal:
                if journal.job("ro-intr.search")["state"] == "CANCELED":
                    break
            assert time.monotonic() < deadline, "the device did not stop its search"
            time.sleep(0.3)
    finally:
        proc.kill()
    assert main(["fleet", "jobs", "--device", "ux-c", *broker]) == 0
