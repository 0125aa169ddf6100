"""``fleet serve`` as a durable service, with real agents (onnxruntime backend) over a real
Mosquitto and the rollouts in SQLite.

Fault suite: staged rollouts are submitted to the service, which is killed with SIGKILL at
random points (10 times, and stopped with SIGTERM twice) and started again each time; a
device that is offline through the whole rollout comes back only after the last restart.
Every rollout ends SUCCEEDED on every device, no journal holds an unfinished job, the broker
keeps no job document and no job status of a finished job, and the report agrees with the
devices' own journals.
"""

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from agent.fleet.database.store import Store
from tests.integration.test_fleet_rollout import retained_jobs, wait_status

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP16 = os.path.join(ROOT, "examples", "fp16_max")


def fp16_args():
    return ["--model", os.path.join(FP16, "model.onnx"), "--inputs",
            os.path.join(FP16, "inputs.json"), "--golden", os.path.join(FP16, "golden.json"),
            "--precision", "fp16", "--layer-precisions", "Add:float32", "Sub:float32",
            "--check-error-stat", "median"]


class Service:
    """``jetson-agent fleet serve`` in a subprocess, killable and restartable."""

    def __init__(self, broker, db, workdir):
        self.args = [sys.executable, "-m", "agent", "fleet", "serve", "--broker", broker.url,
                     "--db", db, "--instance", "svc-1"]
        self.log = os.path.join(str(workdir), "serve.log")
        self.proc = None
        self.log_from = 0  # where this start's lines begin in the log

    def start(self):
        env = dict(os.environ, PYTHONPATH=ROOT)
        self.log_from = os.path.getsize(self.log) if os.path.exists(self.log) else 0
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen(self.args, stdout=logf, stderr=subprocess.STDOUT,
                                     env=env, cwd=ROOT)
        logf.close()
        return self

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def wait_ready(self, timeout=180):
        """Until this start said it serves (its log line; before that SIGTERM finds no
        handler yet: a process still importing on a loaded host just dies of it)."""
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log, "rb") as f:
                f.seek(self.log_from)
                if b"fleet service svc-1 (pid " in f.read():
                    return
            assert self.proc.poll() is None, self.tail()
            assert time.monotonic() < deadline, "not serving\n" + self.tail()
            time.sleep(0.1)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            return self.proc.wait(120)
        return None

    def tail(self, n=3000):
        with open(self.log, "rb") as f:
            return f.read()[-n:].decode("utf-8", "replace")


def fleet_cli(args, timeout=60, env=None):
    env = dict(os.environ if env is None else env, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "agent", "fleet"] + args, env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def wait_registered(db, devices, service, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        store = Store(db)
        try:
            known = {d["device"] for d in store.devices()}
        finally:
            store.close()
        if set(devices) <= known:
            return
        assert time.monotonic() < deadline, "not registered: {}\n{}".format(
            set(devices) - known, service.tail())
        time.sleep(0.3)


def rollout_state(db, rollout_id):
    store = Store(db)
    try:
        row = store.rollout(rollout_id)
        return row["state"] if row else None
    finally:
        store.close()


@pytest.mark.slow
def test_kill_9_at_random_points_and_an_offline_device_all_end_succeeded(
        mosquitto, agent_factory, tmp_path):
    rng = random.Random(int(os.environ.get("FAULT_SEED", "13")))
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    names = ["svc-a", "svc-b", "svc-c"]
    agents = [agent_factory(n).start() for n in names]
    offline = agent_factory("svc-off").start()
    wait_status(mosquitto, names + ["svc-off"], agents=agents + [offline], timeout=180)
    assert offline.stop() == 0
    wait_status(mosquitto, ["svc-off"], online=False, timeout=180)

    service = Service(mosquitto, db, tmp_path).start()
    try:
        wait_registered(db, names + ["svc-off"], service)
        # The offline device's rollout: it stays offline until the service was killed and
        # started again many times.
        out = fleet_cli(["rollout"] + fp16_args() + [
            "--devices", "svc-off", "--rollout-id", "ro-off", "--db", db, "--submit",
            "--detach", "--timeout", "600"])
        assert out.returncode == 0, out.stderr
        # The staged rollouts: one device per stage; another is submitted whenever one ends,
        # so that every kill lands in the middle of one.
        submitted, kills = [], 0
        while kills < int(os.environ.get("FAULT_KILLS", "10")):
            if not submitted or rollout_state(db, submitted[-1]) not in ("running", "paused"):
                rid = "ro-kill-{}".format(len(submitted))
                out = fleet_cli(["rollout"] + fp16_args() + [
                    "--devices"] + names + ["--batch", "1", "--rollout-id", rid, "--db", db,
                                            "--submit", "--detach", "--timeout", "600"])
                assert out.returncode == 0, out.stderr + service.tail()
                submitted.append(rid)
            time.sleep(rng.uniform(0.2, 2.5))
            service.kill()
            kills += 1
            assert all(a.alive() for a in agents), [a.log_tail() for a in agents]
            service.start()
            if kills in (4, 8):  # and an orderly stop now and then (SIGTERM)
                service.wait_ready()
                time.sleep(rng.uniform(0.5, 1.5))
                assert service.stop() == 0, service.tail()
                service.start()
        offline.start()  # back after the service restarted
        deadline = time.monotonic() + 480  # ten restarts of the service on a loaded host
        for rid in submitted + ["ro-off"]:
            while rollout_state(db, rid) in ("running", "paused"):
                assert service.proc.poll() is None, service.tail()
                assert time.monotonic() < deadline, "{} still running\n{}".format(
                    rid, service.tail())
                time.sleep(0.5)
        reports = {}
        for rid in submitted + ["ro-off"]:
            out = fleet_cli(["rollouts", "show", rid, "--db", db, "--json"])
            assert out.returncode == 0, out.stderr
            reports[rid] = json.loads(out.stdout)
        # The service clears each ended job's retained document and status on its ticks:
        # wait for the broker to hold none (not a fixed pause: a loaded host is slower).
        clear_by = time.monotonic() + 60
        while retained_jobs(mosquitto) or retained_job_statuses(mosquitto):
            assert time.monotonic() < clear_by, (retained_jobs(mosquitto), service.tail())
            time.sleep(0.5)
        assert service.stop() == 0
    finally:
        service.kill()

    for rid, report in reports.items():
        assert report["state"] == "succeeded", (rid, report, service.tail())
        for row in report["devices"]:
            assert row["state"] == "SUCCEEDED", (rid, row)
            assert row["precision"] == "fp16"
    # The report is true: each device's journal says the same, and nothing is stuck.
    for agent in agents + [offline]:
        with agent.journal() as journal:
            for rid in submitted + ["ro-off"]:
                row = journal.job(rid)
                if any(agent.device == d["device"] for d in reports[rid]["devices"]):
                    assert row is not None and row["state"] == "SUCCEEDED", (rid, row)
            assert not [j for j in journal.jobs() if j["state"] not in (
                "SUCCEEDED", "FAILED", "REJECTED", "CANCELED", "TIMED_OUT")]
        agent.assert_store_sound()
    assert retained_jobs(mosquitto) == {}
    assert retained_job_statuses(mosquitto) == {}


def retained_job_statuses(broker):
    from agent import fleet

    conn = fleet.FleetConnection(broker.url).connect()
    found = {}

    def on_message(info, msg):
        if info.kind == "job_status":
            found[(info.device, info.job_id)] = msg.get("state")

    try:
        conn.subscribe([conn.topics.prefix + "/devices/+/jobs/+/status"])
        conn.settle(on_message)
    finally:
        conn.close()
    return found


def fleet_main(args):
    """``jetson-agent fleet ARGS`` in this process -> (exit status, stdout, stderr): for poll
    loops and operator commands, where ``fleet_cli`` would start an interpreter (and its
    imports) every time; ``fleet_cli`` stays for what needs a process of its own."""
    from agent.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["fleet"] + args)
    return code, out.getvalue(), err.getvalue()


def show(db, rid):
    code, out, err = fleet_main(["rollouts", "show", rid, "--db", db, "--json"])
    assert code == 0, err
    return json.loads(out)


def wait_rollout(db, rid, predicate, service, timeout=90):
    deadline = time.monotonic() + timeout
    while True:
        report = show(db, rid)
        if predicate(report):
            return report
        assert service.proc.poll() is None, service.tail()
        assert time.monotonic() < deadline, "rollout {}: {}\n{}".format(rid, report,
                                                                        service.tail())
        time.sleep(0.3)


@pytest.mark.slow
def test_pause_resume_cancel_busy_devices_and_attach_to_an_existing_id(
        mosquitto, agent_factory, tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    first, second = agent_factory("pr-a").start(), agent_factory("pr-b").start()
    wait_status(mosquitto, ["pr-a", "pr-b"], agents=[first, second])
    assert first.stop() == 0
    wait_status(mosquitto, ["pr-a"], online=False)
    service = Service(mosquitto, db, tmp_path).start()
    try:
        wait_registered(db, ["pr-a", "pr-b"], service)
        submit = ["rollout"] + fp16_args() + ["--devices", "pr-a", "pr-b", "--batch", "1",
                                              "--rollout-id", "ro-p", "--db", db, "--submit"]
        out = fleet_cli(submit + ["--detach"])
        assert out.returncode == 0 and out.stdout.strip() == "ro-p", out.stderr
        assert fleet_cli(["rollouts", "pause", "ro-p", "--db", db]).returncode == 0
        wait_rollout(db, "ro-p", lambda r: r["state"] == "paused", service)
        # A device in an unfinished rollout is refused to another one, with a message.
        busy = fleet_cli(["rollout"] + fp16_args() + ["--devices", "pr-b", "--db", db,
                                                      "--submit", "--detach"])
        assert busy.returncode == 2 and "device_busy" in busy.stderr, busy.stderr
        assert "pr-b (ro-p)" in busy.stderr
        first.start()  # stage 1 ends while paused: stage 2 does not start
        report = wait_rollout(db, "ro-p", lambda r: r["devices"][0]["state"] == "SUCCEEDED",
                              service)
        time.sleep(1.5)
        report = show(db, "ro-p")
        assert report["state"] == "paused" and report["devices"][1]["state"] == "PENDING"
        assert fleet_cli(["rollouts", "resume", "ro-p", "--db", db]).returncode == 0
        wait_rollout(db, "ro-p", lambda r: r["state"] == "succeeded", service)
        # The same rollout id again: attached to, reported as it is (nothing re-sent).
        again = fleet_cli(submit + ["--json"])
        assert again.returncode == 0, again.stderr
        assert [r["state"] for r in json.loads(again.stdout)["devices"]] == ["SUCCEEDED"] * 2
        listed = fleet_cli(["rollouts", "ls", "--db", db])
        assert "ro-p" in listed.stdout and "succeeded" in listed.stdout
        devices = json.loads(fleet_cli(["devices", "--db", db, "--json"]).stdout)
        assert [d["device"] for d in devices] == ["pr-a", "pr-b"]
        assert devices[0]["board"]
        jobs = json.loads(fleet_cli(["jobs", "--db", db, "--json"]).stdout)
        assert {(j["device"], j["state"]) for j in jobs} == {("pr-a", "SUCCEEDED"),
                                                             ("pr-b", "SUCCEEDED")}
        # Cancel a rollout whose device is offline: its document leaves the broker.
        assert second.stop() == 0
        wait_status(mosquitto, ["pr-b"], online=False)
        out = fleet_cli(["rollout"] + fp16_args() + ["--devices", "pr-b", "--rollout-id",
                                                     "ro-c", "--db", db, "--submit",
                                                     "--detach"])
        assert out.returncode == 0, out.stderr
        wait_rollout(db, "ro-c", lambda r: r["devices"][0]["state"] == "QUEUED", service)
        assert fleet_cli(["rollouts", "cancel", "ro-c", "--db", db]).returncode == 0
        report = wait_rollout(db, "ro-c", lambda r: r["state"] == "cancelled", service)
        assert report["devices"][0]["state"] == "CANCELED"
        time.sleep(1.0)
        assert retained_jobs(mosquitto) == {}
    finally:
        service.kill()


def test_an_embedded_rerun_of_the_same_id_reports_what_the_devices_did(
        mosquitto, agent_factory):
    agent = agent_factory("rr-a").start()
    wait_status(mosquitto, ["rr-a"], agents=[agent])
    args = ["rollout"] + fp16_args() + ["--devices", "rr-a", "--rollout-id", "ro-rerun",
                                        "--broker", mosquitto.url, "--json", "--timeout"]
    first = fleet_cli(args + ["60"], timeout=90)
    assert first.returncode == 0, first.stderr
    # A new embedded run (a throw-away database) with the same id: the device ignores the
    # document as a duplicate and answers with its state again (a status still retained from
    # the earlier run would be adopted): SUCCEEDED, not TIMED_OUT.
    again = fleet_cli(args + ["20"], timeout=60)
    assert again.returncode == 0, again.stderr
    row = json.loads(again.stdout)["devices"][0]
    assert row["state"] == "SUCCEEDED" and row["precision"] == "fp16"


def test_artifacts_over_http_from_the_service(mosquitto, agent_factory, tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    agent = agent_factory("http-a").start()
    wait_status(mosquitto, ["http-a"], agents=[agent])
    service = Service(mosquitto, db, tmp_path)
    service.args += ["--http", "127.0.0.1:0", "--http-min-bytes", "1"]
    service.start()
    try:
        wait_registered(db, ["http-a"], service)
        out = fleet_cli(["rollout"] + fp16_args() + ["--devices", "http-a", "--rollout-id",
                                                     "ro-http", "--db", db, "--submit",
                                                     "--json"], timeout=120)
        assert out.returncode == 0, out.stderr + service.tail() + agent.log_tail()
        assert json.loads(out.stdout)["devices"][0]["state"] == "SUCCEEDED"
    finally:
        service.kill()
    assert "over HTTP from http://127.0.0.1:" in agent.log_tail(20000)
    agent.assert_store_sound()


def test_an_artifact_url_named_by_the_operator(mosquitto, agent_factory, tmp_path):
    """``--artifact-url model=URL`` (a CDN, an object store): the device fetches it there."""
    from agent.fleet.transfer.http_source import HttpSource
    from agent.wire.block_server import sha256_file

    model = os.path.join(FP16, "model.onnx")
    sha = sha256_file(model)
    cdn = HttpSource("127.0.0.1", 0, lambda: {sha: (model, os.path.getsize(model))}).start()
    agent = agent_factory("cdn-a").start()
    try:
        wait_status(mosquitto, ["cdn-a"], agents=[agent])
        url = "http://127.0.0.1:{}/artifacts/{}".format(cdn.port, sha)
        out = fleet_cli(["rollout"] + fp16_args() + [
            "--devices", "cdn-a", "--artifact-url", "model=" + url, "--broker", mosquitto.url,
            "--json", "-q", "--timeout", "60"], timeout=90)
    finally:
        cdn.stop()
    assert out.returncode == 0, out.stderr + agent.log_tail()
    assert "over HTTP from " + url in agent.log_tail(20000)
