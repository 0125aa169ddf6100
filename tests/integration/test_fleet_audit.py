"""The audit trail (docs/fleet.md, "Audit trail"): a sequence of operator actions through the
real ``fleet`` CLI and the dashboard, on SQLite and PostgreSQL, is listed by ``fleet audit`` in
order, each with its actor, target and outcome (an error's code included); commands that only
read are not recorded, nor secrets; ``--since`` filters; the table stays bounded."""

import getpass
import json
import os
import time

import pytest

from agent.fleet.database import audit
from agent.fleet.database.store import Store
from agent.fleet.web.server import Dashboard
from tests.integration.postgres import postgres  # noqa: F401 - fixture
from tests.integration.test_dashboard import TOKEN, post
from tests.integration.test_fleet_service import ROOT, fleet_cli


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    if request.param == "sqlite":
        return "sqlite:///" + str(tmp_path / "fleet.db")
    return request.getfixturevalue("postgres").url


def ok(args):
    out = fleet_cli(args)
    assert out.returncode == 0, (args, out.stderr)
    return out


def test_every_action_is_listed_in_order_with_its_actor(db, tmp_path):
    from agent.wire.device_identity import create_device_key

    store = Store(db)
    try:
        store.upsert_devices({"cam-1": {"device": "cam-1", "online": True, "boot": 1}})
        key = create_device_key(str(tmp_path / "new-1.key"))
        store.put_device_key("new-1", {
            "device": "new-1", "state": "pending", "pending_key_id": key.key_id,
            "pending_public_key": key.public_base64, "pending_since": time.time(),
            "pending_status": {"device": "new-1", "online": True, "boot": 1}})
    finally:
        store.close()
    fp16 = os.path.join(ROOT, "examples", "fp16_max")
    ok(["models", "push", os.path.join(fp16, "model.onnx"), "--name", "det", "--version", "3",
        "--inputs", os.path.join(fp16, "inputs.json"), "--golden",
        os.path.join(fp16, "golden.json"), "--precision", "fp16", "--db", db])
    ok(["models", "ls", "--db", db])  # reads: not recorded
    ok(["label", "cam-1", "site=w3", "--db", db])
    ok(["label", "cam-1", "--db", db])  # shows: not recorded
    ok(["deploy", "det@3", "--to", "site=w3", "--id", "d3", "--db", db])
    ok(["deployments", "pause", "d3", "--db", db])
    ok(["deployments", "show", "d3", "--db", db])
    ok(["deployments", "resume", "d3", "--db", db])
    failed = fleet_cli(["label", "nobody", "a=b", "--db", db])
    assert failed.returncode == 2
    dash = Dashboard(db, token=TOKEN).start()
    try:
        store = Store(db)
        try:
            kid = store.device_keys()["new-1"]["pending_key_id"]
        finally:
            store.close()
        assert post(dash, "/pending/new-1/accept", {"token": "wrong"})[0] == 401  # not recorded
        assert post(dash, "/pending/new-1/accept", {"token": TOKEN, "key_id": kid})[0] == 303
        assert post(dash, "/rollouts/nope/pause", {"token": TOKEN})[0] == 404
    finally:
        dash.stop()
    ok(["deployments", "rm", "d3", "--db", db])
    ok(["models", "rm", "det@3", "--db", db])

    listed = json.loads(ok(["audit", "--json", "--db", db]).stdout)
    me = getpass.getuser()
    assert [(r["actor"], r["via"], r["action"], r["target"], r["outcome"]) for r in listed] == [
        (me, "cli", "models push", "det@3", "ok"),
        (me, "cli", "label", "cam-1", "ok"),
        (me, "cli", "deploy", "det@3", "ok"),
        (me, "cli", "deployments pause", "d3", "ok"),
        (me, "cli", "deployments resume", "d3", "ok"),
        (me, "cli", "label", "nobody", "unknown_device"),
        ("dashboard", "dashboard", "pending accept", "new-1", "ok"),
        ("dashboard", "dashboard", "rollouts pause", "nope", "unknown_job"),
        (me, "cli", "deployments rm", "d3", "ok"),
        (me, "cli", "models rm", "det@3", "ok")]
    assert [r["id"] for r in listed] == sorted(r["id"] for r in listed)
    assert listed[1]["args"]["assignments"] == ["site=w3"] and listed[2]["args"]["id"] == "d3"
    assert listed[5]["message"] and "nobody" in listed[5]["message"]
    assert all("token" not in json.dumps(r["args"]) for r in listed)
    assert listed[6]["args"] == {"key_id": kid}
    text = ok(["audit", "--db", db]).stdout
    assert text.count(me) == 8 and "deployments pause" in text
    assert json.loads(ok(["audit", "--json", "--since", "1h", "--db", db]).stdout) == listed
    future = str(int(time.time()) + 3600)
    assert json.loads(ok(["audit", "--json", "--since", future, "--db", db]).stdout) == []
    bad = fleet_cli(["audit", "--since", "yesterday", "--db", db])
    assert bad.returncode == 2 and "bad_argument" in bad.stderr


def test_the_trail_is_bounded_by_age_and_count(db):
    store = Store(db)
    try:
        now = time.time()
        for i in range(5):
            assert audit.record(store, "op", "cli", "label", "cam-{}".format(i),
                                {"password_file": "/x", "api_token": "t", "note": "x" * 999,
                                 "n": i}, now=now - 100 + i, max_rows=3)
        got = audit.rows(store)
        assert [r["target"] for r in got] == ["cam-2", "cam-3", "cam-4"]
        assert set(got[0]["args"]) == {"note", "n"} and len(got[0]["args"]["note"]) == 200
        audit.record(store, "op", "cli", "pin", "cam-9", now=now, retention_s=50)
        assert [r["target"] for r in audit.rows(store)] == ["cam-9"]
    finally:
        store.close()
