"""The operator's dashboard pages over a real fleet database (SQLite and PostgreSQL): the
deployments list and one deployment (each device's state and reason, actions pause, resume,
retry and undo with the token, refused without it), the model registry (versions, their
deployments and the devices holding them), labels and pins, the audit trail, all linked from
the nav bar and the device and rollout pages. A device whose deployment was removed is not
"failing". Every device- or operator-supplied string with HTML is escaped on every page, in
the HTML and in a real headless Chromium (no script runs, no element is injected)."""

import time
import urllib.error

import pytest

from agent.fleet.database import audit, device_models
from agent.fleet.database.store import Store
from agent.fleet.deployments import deployments, registry
from agent.fleet.web.server import Dashboard
from tests.integration.browser import Browser, find_chromium
from tests.integration.postgres import postgres  # noqa: F401 - fixture
from tests.integration.test_dashboard import TOKEN, db, get, post  # noqa: F401 - fixture

PAYLOAD = '<script>window.__xss=1</script><img src=x onerror="window.__xss=2">'
ESCAPED = "&lt;script&gt;window.__xss=1&lt;/script&gt;"
EVIL_ID = "evil" + PAYLOAD
SHA = "5" * 64


def spec(version):
    return {"precision": "fp16", "model_name": "det", "model_version": version,
            "artifacts": {"model": {"sha256": SHA, "size": 10, "name": "m.onnx"}},
            "timeout": 600.0, "policy": {"success_threshold": 1.0}}


@pytest.fixture
def operator_db(db):  # noqa: F811 - the fixture of test_dashboard, extended
    store = Store(db)
    try:
        store.upsert_devices({
            "cam-1": {"device": "cam-1", "online": True, "boot": 1,
                      "reason": PAYLOAD, "platform": {"board": PAYLOAD, "labels": {
                          "site": "w3"}, "features": ["named_models"]}},
            EVIL_ID: {"device": EVIL_ID, "online": True, "boot": 1}})
        registry.put(store, "det", "3", {"artifacts": {"model": {"sha256": SHA, "size": 10,
                                                                  "name": "m.onnx"}},
                                          "defaults": {"precision": "fp16"}, "notes": PAYLOAD})
        device_models.save(store, {"cam-1": {"device": "cam-1", "boot": 1, "models": [
            {"name": "det", "version": "3", "state": "committed", "model": SHA,
             "precision": "fp16"}]}})
        deployments.insert(store, "d3", "det", "3", "site=w3", spec("3"))
        deployments.record_devices(store, "d3", {
            "cam-1": {"state": "failed", "reason": "bad_model: " + PAYLOAD},
            "orin-1": {"state": "converged"}})
        deployments.insert(store, "gone", "det", "3", "site=lab", spec("3"))
        deployments.set_state(store, "gone", "removed", PAYLOAD)
        audit.record(store, "op" + PAYLOAD, "cli", "label", "cam-1" + PAYLOAD,
                     {"assignments": [PAYLOAD]}, "bad_argument", PAYLOAD)
    finally:
        store.close()
    return db


@pytest.fixture
def dash(operator_db):
    d = Dashboard(operator_db, token=TOKEN).start()
    try:
        yield d
    finally:
        d.stop()


PAGES = ("/", "/deployments", "/deployments/d3", "/deployments/gone", "/models", "/labels",
         "/audit", "/rollouts", "/rollouts/ro-1", "/devices/cam-1", "/devices/orin-1",
         "/pending")


def test_operator_pages_show_deployments_models_labels_and_the_trail(dash):
    _, _, body = get(dash, "/")
    for href in ("/deployments", "/models", "/labels", "/audit", "/rollouts", "/pending"):
        assert 'href="{}"'.format(href) in body  # the nav bar
    assert 'href="/deployments/d3"' in body and "<td><code>site=w3</code></td><td>" \
        "<a" not in body  # the labels column
    assert body.count("<code>site=w3</code>") == 2  # the selector, and cam-1's labels
    _, _, body = get(dash, "/deployments")
    assert 'href="/deployments/d3"' in body and 'href="/deployments/gone"' in body
    assert "b-removed" in body
    _, _, body = get(dash, "/deployments/d3")
    assert "bad_model: " + ESCAPED in body and 'href="/devices/cam-1"' in body
    assert "/deployments/d3/pause" in body and "/deployments/d3/retry" in body
    assert "/deployments/d3/undo" in body
    _, _, body = get(dash, "/deployments/gone")
    assert "/deployments/gone/pause" not in body  # an ended deployment offers no action
    _, _, body = get(dash, "/models")
    assert 'id="det"' in body and 'href="/deployments/d3"' in body and SHA[:12] in body
    _, _, body = get(dash, "/labels")
    assert "site=w3" in body and 'href="/devices/cam-1"' in body
    _, _, body = get(dash, "/audit")
    assert "bad_argument" in body and "assignments=" in body
    _, _, body = get(dash, "/devices/cam-1")
    assert 'href="/deployments/d3"' in body and 'href="/deployments/gone"' not in body
    assert get(dash, "/rollouts/ro-1")[0] == 200
    with pytest.raises(urllib.error.HTTPError) as err:
        get(dash, "/deployments/nope")
    assert err.value.code == 404


def test_deployment_actions_need_the_token_and_are_recorded(dash, operator_db):
    assert post(dash, "/deployments/d3/pause", {"token": "wrong"})[0] == 401
    code, where, _ = post(dash, "/deployments/d3/pause", {"token": TOKEN})
    assert code == 303 and where == "/deployments/d3?done=pause"
    assert "pause requested" in get(dash, where)[2]
    store = Store(operator_db)
    try:
        assert deployments.get(store, "d3")["state"] == "paused"
    finally:
        store.close()
    assert post(dash, "/deployments/d3/resume", {"token": TOKEN})[0] == 303
    assert post(dash, "/deployments/d3/retry", {"token": TOKEN})[0] == 303
    code, _, body = post(dash, "/deployments/gone/resume", {"token": TOKEN})
    assert code == 409 and "bad_state_transition" in body
    code, _, body = post(dash, "/deployments/d3/undo", {"token": TOKEN})
    assert code == 409 and "no_previous_revision" in body  # its first revision: refused
    store = Store(operator_db)
    try:
        assert deployments.get(store, "d3")["state"] != "paused"
        assert deployments.retries(store, "d3")
        trail = [(r["actor"], r["action"], r["target"], r["outcome"])
                 for r in audit.rows(store)][1:]
    finally:
        store.close()
    assert trail == [("dashboard", "deployments pause", "d3", "ok"),
                     ("dashboard", "deployments resume", "d3", "ok"),
                     ("dashboard", "deployments retry", "d3", "ok"),
                     ("dashboard", "deployments resume", "gone", "bad_state_transition"),
                     ("dashboard", "deployments undo", "d3", "no_previous_revision")]


def test_a_device_of_a_removed_deployment_is_not_failing(dash, operator_db):
    store = Store(operator_db)
    try:
        store.insert_rollout("gone-w", spec("3"), [["cam-1"]], time.time() + 600)
        store.db.execute("INSERT INTO deployment_rollouts (rollout_id, deployment_id, kind, "
                         "created) VALUES (?, ?, ?, ?)", ("gone-w", "gone", "wave", time.time()))
        store.save_rollout("gone-w", {"state": "failed"}, {"cam-1": (0, "FAILED", {
            "job_id": "gone-w", "error": {"code": "bad_model", "message": "no"}})})
    finally:
        store.close()
    body = get(dash, "/devices/cam-1")[2]
    assert "b-failing" not in body and "gone-w" in body


def test_html_from_devices_and_operators_is_escaped_on_every_page(dash):
    for path in PAGES:
        status, _, body = get(dash, path)
        assert status == 200, path
        assert PAYLOAD not in body and "<img" not in body, path
        assert "window.__xss" not in body or "&lt;script&gt;" in body, path
    assert ESCAPED in get(dash, "/")[2]  # the hostile device id, as text
    for path in ("/deployments/d3", "/audit", "/devices/cam-1", "/labels", "/models"):
        assert ESCAPED in get(dash, path)[2], path


@pytest.mark.skipif(find_chromium() is None, reason="needs chromium")
def test_no_script_from_a_device_runs_in_chromium(dash):
    with Browser() as browser:
        for path in PAGES:
            page = browser.load(dash.url + path)
            assert browser.evaluate("window.__xss === undefined"), path
            assert browser.evaluate(
                "document.querySelectorAll('img, script:not([src]):not("
                "[type=\"application/json\"])').length") == 0, path
            assert not [e for e in page["errors"] if "Content Security Policy" in e], path
        page = browser.load(dash.url + "/deployments/d3")
        assert "bad_model: " + PAYLOAD in page["text"]  # shown as text


def test_each_operator_token_is_named_in_the_trail(operator_db):
    d = Dashboard(operator_db, tokens={"alice": "a" * 20, "bob": "b" * 20}).start()
    try:
        assert post(d, "/deployments/d3/pause", {"token": "a" * 20})[0] == 303
        assert post(d, "/deployments/d3/resume", {"token": "b" * 20})[0] == 303
        assert post(d, "/deployments/d3/retry", {"token": "c" * 20})[0] == 401
    finally:
        d.stop()
    store = Store(operator_db)
    try:
        trail = [(r["actor"], r["action"]) for r in audit.rows(store)][1:]
    finally:
        store.close()
    assert trail == [("alice", "deployments pause"), ("bob", "deployments resume")]


def test_blob_usage_shows_once_the_registry_keeps_blobs(dash, operator_db):
    body = get(dash, "/models")[2]
    assert "<th>blobs</th>" in body and '<code title="{}">'.format(SHA) in body
    assert "(det@3)" in body  # the versions that use the blob
