"""The dashboard server over a real fleet database, SQLite and PostgreSQL (no broker): every
page renders and escapes what devices reported, ``/metrics`` parses with prometheus_client's
parser and says what the database holds, actions are refused without the token (read-only by
default), with a wrong token, or with an oversized body, and a right token requests the
control in the database; the telemetry history downsamples, keeps only numbers, and honours
its retention and per-device cap."""

import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.fleet.database import history
from agent.fleet.database.store import Store
from agent.fleet.web.server import Dashboard
from tests.integration.postgres import postgres  # noqa: F401 - fixture

TOKEN = "t0ken-for-the-dashboard-tests"
MODEL = "ab" * 32


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    if request.param == "sqlite":
        url = "sqlite:///" + str(tmp_path / "fleet.db")
    else:
        url = request.getfixturevalue("postgres").url
    store = Store(url)
    now = time.time()
    store.upsert_devices({
        "orin-1": {"device": "orin-1", "online": True, "boot": 1, "agent_version": "0.1",
                   "platform": {"board": "Orin <script>x</script>", "jetpack": "6.0",
                                "tensorrt": "10.3", "backend": "tensorrt"},
                   "active_engines": [{"model": MODEL, "engine_key": "k-new",
                                       "precision": "fp16", "job_id": "ro-1",
                                       "activated": now}]},
        "nano-1": {"device": "nano-1", "online": False, "boot": 2,
                   "reason": "connection_lost"}})
    store.touch_devices({"orin-1": {"ts": now, "metrics": {
        "temp_cpu_c": 91.5, "power_total_mw": 7300, "gpu_percent": 55.0,
        "ram_fraction": 0.4, "int8_clip_rate.det": 0.125,
        "int8_input_drift.det": 0.39}}})
    rec = history.TelemetryHistory(store)
    for i in range(4):
        rec.record({"orin-1": {"metrics": {"temp_cpu_c": 50 + i, "gpu_percent": 10.0 * i}}},
                   now=now - 40 + 10 * i)
    store.insert_rollout("ro-1", {"precision": "fp16", "artifacts": {"model": {
        "sha256": MODEL, "name": "model.onnx", "size": 10}}}, [["orin-1"], ["nano-1"]], 9e9)
    store.save_rollout("ro-1", {"current_stage": 1}, {
        "orin-1": (0, "SUCCEEDED", {"job_id": "ro-1", "finished": now, "result": {
            "precision": "fp16", "throughput_qps": 812.5, "latency_ms": {"median": 1.2,
                                                                        "p99": 2.5},
            "accuracy": {"passed": True, "max_abs_error": 0.002, "top1_agreement": 1.0},
            "live_check": {"passed": True, "agreement": 0.984, "samples": 64}}}),
        "nano-1": (1, "REJECTED", {"job_id": "ro-1", "error": {
            "code": "unsupported_precision", "message": "int8 <needs> DLA"}})})
    store.close()
    return url


@pytest.fixture
def dash(db):
    d = Dashboard(db, token=TOKEN).start()
    try:
        yield d
    finally:
        d.stop()


def get(d, path):
    with urllib.request.urlopen(d.url + path, timeout=10) as r:
        return r.status, r.headers, r.read().decode("utf-8")


def post(d, path, fields, raw=None):
    data = raw if raw is not None else urllib.parse.urlencode(fields).encode()
    req = urllib.request.Request(d.url + path, data=data, method="POST")
    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(req, timeout=10) as r:
            return r.status, r.headers.get("Location"), r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Location"), err.read().decode()


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def test_pages_render_and_escape_what_devices_reported(dash):
    status, headers, body = get(dash, "/")
    assert status == 200 and "script-src 'self'" in headers["Content-Security-Policy"]
    assert "<script>x</script>" not in body and "&lt;script&gt;x&lt;/script&gt;" in body
    assert "812.5" in body and "max|err| 0.002, pass; live top-1 98.4% on 64" in body
    assert "b-hot" in body and "cpu at 92 C" in body  # 91.5 C is hot
    assert "ro-1" in body and "2/2" in body  # the active rollout, its stage and progress
    _, _, body = get(dash, "/rollouts")
    assert "unsupported_precision: int8 &lt;needs&gt; DLA" in body
    assert "older rollouts" not in body  # one page holds them all
    _, _, body = get(dash, "/rollouts?limit=1")
    assert "ro-1" in body and "/rollouts?limit=1&amp;offset=1" in body
    _, _, body = get(dash, "/rollouts?limit=1&offset=1")
    assert "/rollouts/ro-1" not in body and "newer rollouts" in body
    assert get(dash, "/rollouts?limit=x&offset=-5")[2] == get(dash, "/rollouts")[2]
    _, _, body = get(dash, "/rollouts/ro-1")
    assert "Cancel rollout" in body and "/rollouts/ro-1/pause" in body
    _, _, body = get(dash, "/devices/orin-1")
    assert 'id="chart-data"' in body and "Roll back to the previous engine" in body
    assert "sha-" + MODEL[:12] in body  # its models, by the name a newer daemon gives them
    assert '"label":"cpu"' in body and "uPlot.iife.min.js" in body
    for path in ("/devices/nope", "/rollouts/..", "/static/../server.py"):
        with pytest.raises(urllib.error.HTTPError) as err:
            get(dash, path)
        assert err.value.code == 404


def test_metrics_parse_with_prometheus_client(dash):
    status, headers, text = get(dash, "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    samples = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("jetson_fleet_devices", (("board", "Orin <script>x</script>"),
                                             ("state", "online")))] == 1
    assert samples[("jetson_fleet_devices", (("board", "unknown"), ("state", "offline")))] == 1
    assert samples[("jetson_fleet_rollout_progress_ratio", (("rollout", "ro-1"),))] == 1.0
    assert samples[("jetson_fleet_rollout_devices", (("rollout", "ro-1"),
                                                     ("state", "REJECTED")))] == 1
    # An older daemon's engine carries the name its model gets on a newer one.
    name = ("model", "sha-" + MODEL[:12])
    assert samples[("jetson_fleet_engine_throughput_qps", (("device", "orin-1"), name,
                                                           ("precision", "fp16")))] == 812.5
    assert samples[("jetson_fleet_engine_latency_seconds", (("device", "orin-1"), name,
                                                            ("stat", "p99")))] == 0.0025
    assert samples[("jetson_fleet_engine_accuracy", (("device", "orin-1"),
                                                     ("metric", "max_abs_error"), name))] == 0.002
    assert samples[("jetson_fleet_device_model_info", (("device", "orin-1"), name,
                                                       ("state", "active"),
                                                       ("version", MODEL[:12])))] == 1
    assert samples[("jetson_fleet_device_temperature_celsius", (("device", "orin-1"),
                                                                ("sensor", "cpu")))] == 91.5
    assert samples[("jetson_fleet_device_power_watts", (("device", "orin-1"),
                                                        ("rail", "total")))] == 7.3
    assert samples[("jetson_fleet_devices_by_health", (("health", "hot"),))] == 1
    assert samples[("jetson_fleet_engine_accuracy", (("device", "orin-1"),
                                                     ("metric", "live_agreement"), name))] == 0.984
    assert samples[("jetson_fleet_device_model_int8_clip_ratio", (("device", "orin-1"),
                                                                  ("model", "det")))] == 0.125
    assert samples[("jetson_fleet_device_model_int8_input_drift", (("device", "orin-1"),
                                                                   ("model", "det")))] == 0.39


def test_metrics_pass_promtool_check_metrics(dash):
    """Prometheus' own linter: base units, counters ending in _total, no quantile label on a
    gauge (Debian's prometheus package ships promtool; scripts/test installs it)."""
    import shutil
    import subprocess

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    status, _, text = get(dash, "/metrics")
    assert status == 200
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_actions_need_the_token(db, dash):
    ro = Dashboard(db).start()  # no token: read-only
    try:
        assert "Cancel rollout" not in get(ro, "/rollouts/ro-1")[2]
        code, _, body = post(ro, "/rollouts/ro-1/pause", {"token": TOKEN})
        assert code == 403 and "read-only" in body
    finally:
        ro.stop()
    code, _, body = post(dash, "/rollouts/ro-1/pause", {"token": "wrong"})
    assert code == 401 and "unauthorized" in body
    code, _, body = post(dash, "/rollouts/ro-1/pause", {}, raw=b"token=" + b"x" * 5000)
    assert code == 413
    code, where, _ = post(dash, "/rollouts/ro-1/pause", {"token": TOKEN})
    assert code == 303 and where.startswith("/rollouts/ro-1?done=")
    store = Store(db)
    try:
        assert store.rollout("ro-1")["control"] == "pause"
    finally:
        store.close()
    assert "pause requested" in get(dash, where)[2]
    assert "<b>" not in get(dash, "/rollouts/ro-1?done=%3Cb%3E")[2]  # no text from the URL
    code, _, body = post(dash, "/rollouts/nope/cancel", {"token": TOKEN})
    assert code == 404 and "unknown_job" in body
    code, _, body = post(dash, "/devices/orin-1/rollback", {"token": TOKEN, "model": "x"})
    assert code == 409 and "bad_argument" in body
    code, _, body = post(dash, "/devices/orin-1/rollback", {"token": TOKEN, "model": MODEL})
    assert code == 503 and "broker_unreachable" in body  # no MQTT connection here


def test_telemetry_history_bounds(db):
    store = Store(db)
    try:
        store.db.execute("DELETE FROM telemetry_history")
        rec = history.TelemetryHistory(store, retention_s=100.0, max_rows_per_device=3,
                                       min_interval_s=1.0)
        hostile = {"temp_cpu_c": 40.0, "nvpmodel": "MAXN", "flag": True, "nan": float("nan"),
                   "k" * 100: 1.0}
        assert rec.record({"d": {"metrics": hostile}}, now=1000.0) == 1
        assert rec.record({"d": {"metrics": hostile}}, now=1000.5) == 0  # downsampled
        assert rec.record({"d": {"metrics": "not a dict"}}, now=1002.0) == 0
        assert history.series(store, "d") == [(1000.0, {"temp_cpu_c": 40.0})]
        for t in range(1, 6):
            rec.record({"d": {"metrics": {"gpu_percent": t}}, "e": {"metrics": {"x": t}}},
                       now=1000.0 + 2 * t)
        assert rec.prune(now=1011.0) == 5  # d: 6 rows, cap 3; e: 5 rows, cap 3
        assert [m for _, m in history.series(store, "d")] == [{"gpu_percent": t}
                                                              for t in (3.0, 4.0, 5.0)]
        assert history.count(store, "e") == 3
        rec.prune(now=1200.0)  # everything is older than 100 s
        assert history.count(store) == 0
    finally:
        store.close()


def test_the_grafana_dashboard_only_uses_metrics_the_service_exports(dash):
    import json
    import os
    import re

    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "grafana",
                        "jetson-fleet.json")
    with open(path) as f:
        board = json.load(f)
    used = {m for p in board["panels"] for t in p["targets"]
            for m in re.findall(r"jetson_fleet_[a-z_]+", t["expr"])}
    exported = {f.name for f in text_string_to_metric_families(get(dash, "/metrics")[2])}
    assert used and used <= exported, used - exported


def test_a_busy_port_is_a_clear_error(db):
    import socket

    from agent.errors import AgentError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        with pytest.raises(AgentError) as err:
            Dashboard(db, port=busy.getsockname()[1])
    assert err.value.code == "bad_argument" and "cannot listen there" in err.value.message


def test_fleet_rollback_needs_a_target(capsys):
    from agent.cli import main

    assert main(["fleet", "rollback", "--broker", "mqtt://127.0.0.1:1"]) == 2
    assert "needs --device ID (repeatable) or --rollout ID" in capsys.readouterr().err


def test_pending_devices_are_listed_accepted_and_rejected_with_the_token(db, dash, tmp_path):
    """Devices waiting for admission (docs/security.md): listed on their own page (not in the
    fleet), accepted (key pinned, the status it announced enters the registry) or rejected,
    each only with the token and only for the key the page showed."""
    from agent.wire.device_identity import create_device_key

    store = Store(db)
    try:
        for dev in ("new-1", "new-2"):
            key = create_device_key(str(tmp_path / (dev + ".key")))
            store.put_device_key(dev, {
                "device": dev, "state": "pending", "pending_key_id": key.key_id,
                "pending_public_key": key.public_base64, "pending_since": time.time(),
                "pending_status": {"device": dev, "online": True, "boot": 1,
                                   "platform": {"board": "Orin <b>", "identity":
                                                key.identity()}}})
        kid = store.device_keys()["new-1"]["pending_key_id"]
    finally:
        store.close()
    _, _, body = get(dash, "/pending")
    assert "new-1" in body and "new-2" in body and kid in body and "<b>" not in body
    assert "new-1" not in get(dash, "/")[2]  # not a fleet member
    assert post(dash, "/pending/new-1/accept", {"token": "wrong", "key_id": kid})[0] == 401
    code, _, body = post(dash, "/pending/new-1/accept", {"token": TOKEN})  # no key id shown
    assert code == 409 and "admission_key_changed" in body
    code, _, body = post(dash, "/pending/new-1/accept", {"token": TOKEN, "key_id": "0" * 16})
    assert code == 409 and "admission_key_changed" in body and "the one shown" in body
    code, where, _ = post(dash, "/pending/new-1/accept", {"token": TOKEN, "key_id": kid})
    assert code == 303 and where == "/pending?done=accept"
    code, _, _ = post(dash, "/pending/new-2/reject", {"token": TOKEN})
    assert code == 303
    store = Store(db)
    try:
        keys = store.device_keys()
        assert keys["new-1"]["state"] == "admitted" and keys["new-1"]["key_id"] == kid
        assert keys["new-2"]["state"] == "rejected"
        assert store.device("new-1") is not None and store.device("new-2") is None
    finally:
        store.close()
    assert "accepted" in get(dash, where)[2] and "new-1" not in get(dash, "/pending")[2]
    # A birth for new-1 signed by another key: an impostor event, shown on its page.
    from agent.fleet.admission import identity_events

    store = Store(db)
    try:
        identity_events.Records(store).impostor("new-1", "badc0ffee0ddf00d", "x", time.time())
    finally:
        store.close()
    _, _, body = get(dash, "/devices/new-1")
    assert "impostor events" in body and "badc0ffee0ddf00d" in body and kid in body
