"""The controller with named models, over real databases (SQLite and PostgreSQL) and a real
Mosquitto. Devices are stood in for by ``model_responder`` (the daemon's side is tested with
the daemon): one device of this release (``platform.features: ["named_models"]``, a retained
``models`` message) and one of an earlier release (no features, ``active_engines`` only).

- views: every model a device holds as ``name@version (state)`` on the dashboard and in
  ``/metrics`` (a ``model`` label), a model health problem makes the device ``unhealthy``, the
  rollouts list names models by name@version, a rollback from the dashboard goes by name and
  is recorded against the rollout, and a refusal's reason shows on the rollout's page and the
  device's page;
- ``fleet rollout --name --version`` through ``fleet serve``: the job document carries
  ``model_name``/``model_version`` to the new device only; the service stores the devices'
  models messages; ``fleet devices`` shows them; ``fleet rollback --name --rollout`` sends the
  new device the name and the old one the sha256, prints the old device's refusal, and the
  rollout shows it rolled back (not ``succeeded`` only).
"""

import json
import time
import urllib.parse
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.fleet.database import device_models
from agent.fleet.database.store import Store
from agent.fleet.rollouts import rollback_log
from agent.fleet.web import pages, views
from agent.fleet.web.server import Dashboard
from tests.integration.model_responder import Device, Responder
from tests.integration.postgres import postgres  # noqa: F401 - fixture
from tests.integration.test_fleet_service import (
    Service,
    fleet_cli,
    fp16_args,
    rollout_state,
    wait_registered,
)

TOKEN = "t0ken-for-the-named-model-tests"
V1, V2, OLD_SHA = "11" * 32, "22" * 32, "ab" * 32


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    if request.param == "sqlite":
        return "sqlite:///" + str(tmp_path / "fleet.db")
    return request.getfixturevalue("postgres").url


def _seed(url):
    store = Store(url)
    now = time.time()
    try:
        store.upsert_devices({
            "new-1": {"device": "new-1", "online": True, "boot": 4, "platform": {
                "board": "Orin", "features": ["named_models"]}, "active_engines": [
                {"model": V2, "engine_key": "k2", "job_id": "det-v2"},
                {"model": OLD_SHA, "engine_key": "k9", "job_id": "cls-1"}]},
            "old-1": {"device": "old-1", "online": True, "boot": 1, "platform": {
                "board": "Nano"}, "active_engines": [
                {"model": V2, "engine_key": "k2", "precision": "fp16", "job_id": "det-v2",
                 "activated": now}]}})
        device_models.save(store, {"new-1": {"device": "new-1", "boot": 4, "models": [
            {"name": "detector", "version": "v2", "state": "committed", "previous": "v1",
             "job_id": "det-v2", "health": "ok", "model": V2},
            {"name": "classifier", "version": "c<7>", "state": "pending", "previous": None,
             "job_id": "cls-1", "health": "engine <missing>"}]}})
        # A late retained copy of an older boot changes nothing.
        device_models.save(store, {"new-1": {"device": "new-1", "boot": 3, "models": []}})
        store.insert_rollout("det-v2", {"precision": "fp16", "model_name": "detector",
                                        "model_version": "v2", "artifacts": {"model": {
                                            "sha256": V2, "name": "model.onnx", "size": 9}}},
                             [["new-1", "old-1"]], 9e9, state="succeeded")
        store.save_rollout("det-v2", {"current_stage": 0}, {
            d: (0, "SUCCEEDED", {"job_id": "det-v2", "finished": now, "result": {
                "precision": "fp16", "throughput_qps": 50.0}}) for d in ("new-1", "old-1")})
    finally:
        store.close()


def _get(d, path):
    with urllib.request.urlopen(d.url + path, timeout=10) as r:
        return r.read().decode("utf-8")


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def _post(d, path, fields):
    req = urllib.request.Request(d.url + path, data=urllib.parse.urlencode(fields).encode(),
                                 method="POST")
    try:
        with urllib.request.build_opener(_NoRedirect).open(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_views_name_every_model_and_record_rollbacks(db):
    _seed(db)
    sent = []  # the commands the dashboard handed to its MQTT connection
    dash = Dashboard(db, token=TOKEN, rollback=lambda dev, cmd: sent.append((dev, cmd))).start()
    store = Store(db)
    try:
        rows = {r["device"]: r for r in views.fleet_rows(store)}
        assert rows["new-1"]["models_text"] == \
            "classifier@c<7> (pending), detector@v2 (committed)"
        assert rows["new-1"]["health"] == "unhealthy"
        assert "classifier@c<7>: engine <missing>" in rows["new-1"]["health_reason"]
        assert rows["old-1"]["models_text"] == "sha-{0}@{0} (active)".format(V2[:12])
        assert rows["old-1"]["health"] == "ok"
        body = _get(dash, "/")
        assert "classifier@c&lt;7&gt; (pending)" in body and "detector@v2 (committed)" in body
        assert "b-unhealthy" in body and "<missing>" not in body
        listed = _get(dash, "/rollouts")
        assert "detector@v2" in listed and ">model.onnx<" not in listed
        samples = {}
        for fam in text_string_to_metric_families(_get(dash, "/metrics")):
            for s in fam.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        info = {k[1] for k in samples if k[0] == "jetson_fleet_device_model_info"}
        assert (("device", "new-1"), ("model", "detector"), ("state", "committed"),
                ("version", "v2")) in info and len(info) == 3  # one per name a device holds
        assert samples[("jetson_fleet_device_model_healthy", (("device", "new-1"),
                                                              ("model", "classifier")))] == 0
        assert samples[("jetson_fleet_engine_throughput_qps", (
            ("device", "new-1"), ("model", "detector"), ("precision", "fp16")))] == 50.0
        assert samples[("jetson_fleet_devices_by_health", (("health", "unhealthy"),))] == 1

        # Which rollout a rollback undoes: by the job that activated it, the name, the sha256.
        assert rollback_log.rollout_for(store, "new-1", "detector") == "det-v2"
        assert rollback_log.rollout_for(store, "old-1", None, V2) == "det-v2"
        assert rollback_log.rollout_for(store, "old-1", job_id="det-v2.search") == "det-v2"
        assert rollback_log.rollout_for(store, "old-1", "classifier") is None
        # The dashboard's rollback: by name to the new device, by sha256 to the old one.
        code, _ = _post(dash, "/devices/new-1/rollback", {"token": TOKEN, "name": "detector"})
        assert code == 303
        code, _ = _post(dash, "/devices/old-1/rollback", {"token": TOKEN, "model": V2})
        assert code == 303
        code, body = _post(dash, "/devices/new-1/rollback", {"token": TOKEN, "name": "Bad"})
        assert code == 409 and "bad_model_name" in body
        (d1, c1), (d2, c2) = sent
        assert (d1, c1["name"], "model" in c1) == ("new-1", "detector", False)
        assert (d2, c2["model"], "name" in c2) == ("old-1", V2, False)
        # The devices answer (fleet serve records replies the same way): one refuses.
        assert rollback_log.on_reply(store, "new-1", {"request_id": c1["request_id"],
                                                      "command": "rollback", "ok": True,
                                                      "result": {"name": "detector",
                                                                 "version": "v1"}})
        assert not rollback_log.on_reply(store, "old-1", {"request_id": c1["request_id"],
                                                          "ok": True})  # not its request
        assert rollback_log.on_reply(store, "old-1", {
            "request_id": c2["request_id"], "command": "rollback", "ok": False,
            "error": {"code": "no_previous_engine", "message": "no <previous> engine kept"}})
        detail = views.rollout_detail(store, store.rollout("det-v2"))
        assert detail["rolled_back"] == ["new-1"] and detail["rollback_refused"] == ["old-1"]
        assert detail["state_text"] == "succeeded, rolled back on 1 device"
        assert [b["origin"] for b in detail["rollbacks"]] == ["dashboard", "dashboard"]
        page = _get(dash, "/rollouts/det-v2")
        assert "refused: no_previous_engine: no &lt;previous&gt; engine kept" in page
        assert "b-rolled back" in page or "rolled back" in page
        assert "refused: no_previous_engine" in _get(dash, "/devices/old-1")
        assert "rolled back" in _get(dash, "/devices/new-1")
        assert "rolled back" in pages.rollouts_page(views.rollout_rows(store), False).decode()
    finally:
        store.close()
        dash.stop()


def _docs(dev):
    return [d for d in dev.docs if d["kind"] == "deploy"]


def test_rollout_by_name_and_rollback_by_name_through_the_service(mosquitto, tmp_path,
                                                                  monkeypatch):
    # The stand-in devices speak the protocol without identity keys: an open admission.
    monkeypatch.setenv("JETSON_AGENT_FLEET_ADMISSION", "open")
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    new = Device("new-1", named=True, models={"detector": {
        "version": "v1", "previous": None, "job_id": "det-v1", "model": V1}})
    old = Device("old-1", named=False,
                 refuse=("no_previous_engine", "no previous engine of the model is kept"))
    responder = Responder(mosquitto, [new, old]).start()
    service = Service(mosquitto, db, tmp_path).start()
    try:
        wait_registered(db, ["new-1", "old-1"], service)
        out = fleet_cli(["rollout"] + fp16_args() + [
            "--name", "detector", "--version", "v2", "--devices", "new-1", "old-1",
            "--rollout-id", "det-v2", "--db", db, "--submit", "--json"], timeout=120)
        assert out.returncode == 0, out.stderr + service.tail()
        assert rollout_state(db, "det-v2") == "succeeded"
        (doc_new,), (doc_old,) = _docs(new), _docs(old)
        assert (doc_new["model_name"], doc_new["model_version"]) == ("detector", "v2")
        assert "model_name" not in doc_old and "model_version" not in doc_old
        bad = fleet_cli(["rollout"] + fp16_args() + ["--name", "Detector", "--devices",
                                                     "new-1", "--db", db, "--dry-run"])
        assert bad.returncode == 2 and "bad_model_name" in bad.stderr
        dry = fleet_cli(["rollout"] + fp16_args() + ["--name", "detector", "--devices",
                                                     "new-1", "old-1", "--db", db, "--dry-run",
                                                     "--json"])
        plan = json.loads(dry.stdout)
        assert (plan["model_name"], plan["model_version"]) == (
            "detector", doc_old["artifacts"]["model"]["sha256"][:12])
        assert [(d["device"], d["named"]) for d in plan["devices"]] == [("new-1", True),
                                                                       ("old-1", False)]
        # The service stored the models message the device published after the job.
        deadline = time.monotonic() + 20
        while True:
            store = Store(db)
            try:
                held = device_models.load(store).get("new-1") or {}
            finally:
                store.close()
            if [m["version"] for m in held.get("models", [])] == ["v2"]:
                break
            assert time.monotonic() < deadline, (held, service.tail())
            time.sleep(0.2)
        devices = json.loads(fleet_cli(["devices", "--db", db, "--json"]).stdout)
        texts = {d["device"]: d["models_text"] for d in devices}
        assert texts["new-1"] == "detector@v2 (committed)"
        assert texts["old-1"] == "sha-{0}@{0} (active)".format(doc_old["artifacts"]["model"][
            "sha256"][:12])
        table = fleet_cli(["devices", "--db", db])
        assert "MODELS" in table.stdout and "detector@v2 (committed)" in table.stdout
        listed = fleet_cli(["rollouts", "ls", "--db", db])
        assert "detector@v2" in listed.stdout

        back = fleet_cli(["rollback", "--broker", mosquitto.url, "--rollout", "det-v2",
                          "--name", "detector", "--db", db, "--wait", "20"])
        assert back.returncode == 1, back.stderr  # one device refused
        assert "new-1 detector: rolled back to detector@v1 (from v2)" in back.stdout
        assert "old-1 " in back.stdout and "refused: no_previous_engine no previous engine" \
            in back.stdout
        (cmd_new,), (cmd_old,) = new.commands, old.commands
        assert cmd_new["name"] == "detector" and "model" not in cmd_new
        assert cmd_old["model"] == doc_old["artifacts"]["model"]["sha256"]
        assert "name" not in cmd_old
        shown = fleet_cli(["rollouts", "show", "det-v2", "--db", db])
        assert "succeeded, rolled back on 1 device" in shown.stdout, shown.stdout
        assert "refused: no_previous_engine" in shown.stdout
        report = json.loads(fleet_cli(["rollouts", "show", "det-v2", "--db", db,
                                       "--json"]).stdout)
        assert report["rolled_back"] == ["new-1"] and report["model"] == "detector@v2"
        # --version to an older device is refused before anything is sent.
        again = fleet_cli(["rollback", "--broker", mosquitto.url, "--device", "old-1",
                           "--name", "detector", "--version", "v1", "--db", db])
        assert again.returncode == 2 and "named_models" in again.stderr
        assert len(old.commands) == 1
    finally:
        service.kill()
        responder.stop()
