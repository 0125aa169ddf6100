"""The dashboard of a real ``fleet serve`` (real agents on the onnxruntime backend, a real
Mosquitto, SQLite) in a real headless Chromium.

Two devices get an fp32 engine (rollout ``ro-a``), a Nano refuses int8 (``ro-nano``: the
failure and its reason show), then a staged fp16 rollout (``ro-b``) is paused from the
dashboard with the token as its first stage starts, so that the pages show the fleet of a
running rollout. Every page loads with no console error, uncaught exception or failed request;
a screenshot of each is kept (``$DASHBOARD_SCREENSHOTS``: also copied there, for the docs).
Then the rollout is resumed from the dashboard, one device is rolled back from the dashboard
and one with ``fleet rollback``: each goes back to its ``ro-a`` engine; a second rollback has
no previous engine left. ``/metrics`` parses with prometheus_client's parser.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.fleet.database import history
from agent.fleet.database.store import Store
from agent.fleet.web.server import Dashboard
from tests.integration.browser import Browser, find_chromium
from tests.integration.conftest import free_port
from tests.integration.test_fleet_rollout import NANO, digits_args, wait_status

pytestmark = pytest.mark.skipif(find_chromium() is None, reason="needs chromium "
                                "(./scripts/test installs it)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP16 = os.path.join(ROOT, "examples", "fp16_max")
TOKEN = "dashboard-token-0123456789"


def fp16_max(precision):
    return ["--model", os.path.join(FP16, "model.onnx"), "--inputs",
            os.path.join(FP16, "inputs.json"), "--golden", os.path.join(FP16, "golden.json"),
            "--precision", precision, "--layer-precisions", "Add:float32", "Sub:float32",
            "--check-error-stat", "median"]


def cli(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "agent", "fleet"] + args,
                          env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT, timeout=timeout,
                          capture_output=True, text=True)


def with_store(db, fn):
    store = Store(db)
    try:
        return fn(store)
    finally:
        store.close()


def wait_for(what, fn, timeout=120, log=None):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out waiting for {}\n{}".format(
            what, log() if log else "")
        time.sleep(0.3)


def post(base, path, fields):
    req = urllib.request.Request(base + path, urllib.parse.urlencode(fields).encode(),
                                 method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:  # follows the 303 to the page
        return r.read().decode()


def active_job(db, device):
    def read(store):
        engines = (store.device(device) or {}).get("status", {}).get("active_engines") or []
        return engines[0]["job_id"] if len(engines) == 1 else None
    return with_store(db, read)


def test_dashboard_of_a_running_rollout_in_chromium(mosquitto, agent_factory, tmp_path):
    agents = [agent_factory("cam-1").start(), agent_factory("cam-2").start(),
              agent_factory("nano-1", "platform_root: {}\n".format(NANO)).start(
                  "--backend", "auto")]
    wait_status(mosquitto, ["cam-1", "cam-2", "nano-1"], agents=agents)
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    port = free_port()
    base = "http://127.0.0.1:{}".format(port)
    log_path = tmp_path / "serve.log"

    def start_serve():
        with open(log_path, "ab") as logf:
            return subprocess.Popen(
                [sys.executable, "-m", "agent", "fleet", "serve", "--broker", mosquitto.url,
                 "--db", db, "--instance", "svc", "--dashboard", "127.0.0.1:{}".format(port),
                 "--dashboard-token-file", str(token_file)], stdout=logf,
                stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)

    serve = start_serve()

    def tail():
        return log_path.read_bytes()[-3000:].decode("utf-8", "replace")

    def state(rid):
        return with_store(db, lambda s: (s.rollout(rid) or {}).get("state"))

    try:
        wait_for("the dashboard", lambda: _up(base), 60, tail)
        wait_for("the registry", lambda: len(with_store(db, lambda s: s.devices())) == 3,
                 60, tail)
        common = ["--db", db, "--submit", "--detach", "--timeout", "300"]
        out = cli(["rollout"] + fp16_max("fp32") + ["--devices", "cam-1", "cam-2",
                                                    "--rollout-id", "ro-a"] + common)
        assert out.returncode == 0, out.stderr
        out = cli(["rollout"] + digits_args() + ["--devices", "nano-1", "--rollout-id",
                                                 "ro-nano"] + common)
        assert out.returncode == 0, out.stderr
        wait_for("ro-a", lambda: state("ro-a") == "succeeded", 180, tail)
        wait_for("ro-nano", lambda: state("ro-nano") not in (None, "running"), 60, tail)

        # Stage 1 of ro-b must not be over before the pause lands (a tiny model builds in
        # well under a tick): with the service stopped, ro-b is submitted and paused from a
        # dashboard on the same database; the service, started again, takes ro-b over,
        # starts stage 1 and applies the pause in the same step.
        serve.terminate()
        assert serve.wait(30) == 0, tail()
        out = cli(["rollout"] + fp16_max("fp16") + ["--devices", "cam-1", "cam-2", "--batch",
                                                    "1", "--rollout-id", "ro-b"] + common)
        assert out.returncode == 0, out.stderr
        side = Dashboard(db, token=TOKEN).start()
        try:
            assert "pause requested" in post(side.url, "/rollouts/ro-b/pause",
                                             {"token": TOKEN})
        finally:
            side.stop()
        serve = start_serve()
        wait_for("the dashboard again", lambda: _up(base), 60, tail)
        wait_for("ro-b paused", lambda: state("ro-b") == "paused", 30, tail)
        wait_for("stage 1 of ro-b", lambda: active_job(db, "cam-1") == "ro-b", 180, tail)
        wait_for("telemetry history", lambda: with_store(
            db, lambda s: history.count(s, "cam-1")) >= 3, 60, tail)

        shots = tmp_path / "screenshots"
        shots.mkdir()
        pages = [("fleet", "/", None, ["cam-1", "cam-2", "nano-1", "ro-b", "paused"]),
                 ("rollouts", "/rollouts", None, ["ro-a", "ro-b", "unsupported_precision"]),
                 ("rollout", "/rollouts/ro-b", None, ["Resume", "cam-2", "PENDING"]),
                 ("device", "/devices/cam-1",
                  "document.getElementById('charts').dataset.ready", ["ro-a", "ro-b",
                                                                      "CPU load",
                                                                      "Job status changes",
                                                                      "IN_PROGRESS"]),
                 ("labels", "/labels", None, ["cam-1", "nano-1", "Pins"]),
                 # the CLI's rollouts and the dashboard's pause, in the audit trail
                 ("audit", "/audit", None, ["rollouts pause", "ro-b", "dashboard", "ro-nano"])]
        with Browser() as browser:
            for name, path, ready, expect in pages:
                page = browser.load(base + path, ready)
                assert page["errors"] == [], (path, page["errors"])
                for text in expect:
                    assert text in page["text"], (path, text, state("ro-b"), page["text"])
                browser.screenshot(str(shots / "{}.png".format(name)))
        assert all((shots / "{}.png".format(n)).stat().st_size > 10000 for n, *_ in pages)
        keep = os.environ.get("DASHBOARD_SCREENSHOTS")
        if keep:
            os.makedirs(keep, exist_ok=True)
            for n, *_ in pages:
                shutil.copyfile(str(shots / "{}.png".format(n)), os.path.join(keep, n + ".png"))

        post(base, "/rollouts/ro-b/resume", {"token": TOKEN})
        wait_for("ro-b", lambda: state("ro-b") == "succeeded", 180, tail)
        model = with_store(db, lambda s: s.rollout("ro-b")["spec"]["artifacts"]["model"][
            "sha256"])
        wait_for("cam-2 on ro-b", lambda: active_job(db, "cam-2") == "ro-b", 30, tail)

        # Rollback: cam-1 from the dashboard, cam-2 with the CLI.
        page = post(base, "/devices/cam-1/rollback", {"token": TOKEN, "model": model})
        assert "rollback sent (request r" in page
        wait_for("cam-1 back on ro-a", lambda: active_job(db, "cam-1") == "ro-a", 30, tail)
        out = cli(["rollback", "--broker", mosquitto.url, "--device", "cam-2", "--json"])
        assert out.returncode == 0, out.stdout + out.stderr
        reply = json.loads(out.stdout)[0]
        assert reply["ok"] and reply["result"]["job_id"] == "ro-a", reply
        out = cli(["rollback", "--broker", mosquitto.url, "--rollout", "ro-b", "--db", db])
        # Both devices list named_models: the rollback goes by name, and nothing older is kept.
        assert out.returncode == 1 and out.stdout.count("no_previous_version") == 2, out.stdout
        wait_for("cam-2 back on ro-a", lambda: active_job(db, "cam-2") == "ro-a", 30, tail)

        with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        names = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
        assert {"jetson_fleet_devices", "jetson_fleet_rollout_progress_ratio",
                "jetson_fleet_engine_throughput_qps", "jetson_fleet_device_load_percent"} <= \
            set(names), sorted(names)
        serve.terminate()
        assert serve.wait(30) == 0, tail()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(10)


def _up(base):
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False
