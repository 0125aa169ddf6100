"""Pins, attempts and revisions decided by the service's runner over the fleet database
(SQLite and a real PostgreSQL), the devices' side played by writing what the service would
record (as in test_fleet_deployments_store): a fleet pin and a device's own pin hold a
device out of its deployment, unpin lets it converge; a device that times out is retried
after a backoff and, its attempts spent, halts the deployment with its reason until a retry;
``undo`` returns a deployment (and the one it superseded) to the previous revision; the
figures leave out rejected devices and superseded deployments."""

import pytest

from agent.errors import AgentError
from agent.fleet.database import device_models
from agent.fleet.deployments import deployments, pins, revisions
from agent.fleet.deployments.deployment_runner import CATCHUP_S, DeploymentRunner
from tests.integration.postgres import postgres  # noqa: F401 - fixture
from tests.integration.test_fleet_deployments_store import (
    SHA3,
    SHA4,
    Clock,
    devices_of,
    end_jobs,
    models,
    spec,
    states,
    status,
)


def converged(store, runner, clock, rollout, devices):
    end_jobs(store, rollout)
    for d in devices:
        device_models.save(store, {d: models(d, det=(rollout_version(store, rollout),
                                                     SHA3 if rollout_version(store, rollout)
                                                     == "3" else SHA4))})
    runner.touch(devices)
    clock.t += CATCHUP_S
    runner.tick()


def rollout_version(store, rollout):
    return store.rollout(rollout)["spec"]["model_version"]


def test_pins_hold_a_device_and_unpin_releases_it(store):
    clock = Clock()
    runner = DeploymentRunner(store, "svc-1", clock=clock)
    store.upsert_devices({d: status(d, site="w3") for d in "abc"})
    deployments.insert(store, "d4", "det", "4", "site=w3", spec("4", SHA4))
    runner.tick()
    converged(store, runner, clock, "d4-w", "abc")
    assert {s[0] for s in states(store, "d4").values()} == {"converged"}
    # a: rolled back (a pin in flight, then settled by the reply); b: the device's own pin
    pins.rollback_pins(store, [{"request_id": "r1", "device": "a", "name": "det",
                                "version": None}], None)
    store.db.execute("INSERT INTO rollbacks (request_id, device_id, name, sent) VALUES "
                     "('r1', 'a', 'det', 1)")
    pins.on_rollback_reply(store, "a", {"request_id": "r1", "ok": True,
                                        "result": {"version": "3"}})
    device_models.save(store, {"a": models("a", boot=1, det=("3", SHA3))})
    msg = models("b", boot=1, det=("3", SHA3))
    msg["pins"] = {"det": "3", "bad name!": "1"}
    device_models.save(store, {"b": msg})
    runner.touch(["a", "b"])
    for _ in range(3):
        clock.t += CATCHUP_S
        runner.tick()
    assert deployments.rollouts_of(store, "d4") == ["d4-w"]  # neither is sent @4 again
    assert states(store, "d4")["a"] == ("waiting", "pinned to det@3")
    assert states(store, "d4")["b"] == ("waiting", "pinned to det@3")
    listed = {(p["device_id"], p["source"]): p for p in pins.list_pins(store)}
    assert set(listed) == {("a", "fleet"), ("b", "device")}
    assert [(p["device_id"], p["source"]) for p in pins.list_pins(store, ["b", "c"])] == [
        ("b", "device")]
    assert listed[("a", "fleet")]["version"] == "3" and listed[("a", "fleet")]["actor"]
    s = deployments.summary(store, ["d4"])["d4"]
    assert (s["converged"], s["pinned"], s["waiting_by"]) == (1, 2, {"pinned": 2})
    # a service restart (a new runner on the same database) keeps them
    runner = DeploymentRunner(store, "svc-1", clock=clock, lease_s=0.0)
    clock.t += 60
    runner.tick()
    assert deployments.rollouts_of(store, "d4") == ["d4-w"]
    # unpin: a converges again
    assert pins.unpin(store, "a", "det") and not pins.unpin(store, "a", "det")
    clock.t += CATCHUP_S
    runner.tick()
    clock.t += CATCHUP_S
    runner.tick()
    assert devices_of(store, "d4-c1") == ["a"]
    # a fleet pin to the deployment's own version on a device that holds it: converged
    pins.pin(store, "c", "det", "4", "ops", "hold")
    clock.t += CATCHUP_S
    runner.tick()
    assert states(store, "d4")["c"] == ("converged", None)
    # a rollback of a model no deployment governs makes no pin
    assert pins.rollback_pins(store, [{"request_id": "r2", "device": "c", "name": "other",
                                       "version": None}]) == {}


def test_timeouts_back_off_then_halt_with_their_reason_until_retried(store):
    import time

    clock = Clock()
    clock.t = time.time()  # the jobs' ends are stamped with the real time
    runner = DeploymentRunner(store, "svc-1", clock=clock)
    store.upsert_devices({"a": status("a", site="w3")})
    sp = dict(spec("3", SHA3), max_attempts=2, retry_backoff=10.0)
    deployments.insert(store, "d3", "det", "3", "site=w3", sp)
    runner.tick()
    assert devices_of(store, "d3-w") == ["a"]
    store.upsert_devices({"a": status("a", online=False, site="w3")})  # gone mid-wave
    runner.touch(["a"])
    end_jobs(store, "d3-w", "TIMED_OUT")
    store.db.execute("UPDATE rollouts SET state = 'timed_out' WHERE rollout_id = 'd3-w'")
    runner.tick()
    assert deployments.get(store, "d3")["state"] == "active"
    state, reason = states(store, "d3")["a"]
    assert state == "retrying" and reason.startswith("attempt 2 at "), reason
    clock.t += CATCHUP_S
    runner.tick()
    assert deployments.rollouts_of(store, "d3") == ["d3-w"]  # backing off
    clock.t += 10.0
    runner.tick()
    clock.t += CATCHUP_S
    runner.tick()
    assert devices_of(store, "d3-c1") == ["a"]  # sent again: the job waits for it
    end_jobs(store, "d3-c1", "TIMED_OUT")
    runner.touch(["a"])
    clock.t += 100
    runner.tick()
    dep = deployments.get(store, "d3")
    assert dep["state"] == "halted" and "a (offline)" in dep["reason"], dep
    assert states(store, "d3")["a"] == ("failed", "offline")
    assert deployments.summary(store, ["d3"])["d3"]["failed_by"] == {"offline": 1}
    clock.t += 1000
    runner.tick()
    assert len(deployments.rollouts_of(store, "d3")) == 2  # halted: no more catch-ups
    # back, and retried: sent again
    from agent.fleet.deployments.controls import apply

    store.upsert_devices({"a": status("a", site="w3")})
    runner.touch(["a"])
    clock.t += 1
    apply(store, "d3", "retry")
    assert deployments.get(store, "d3")["state"] == "active"
    clock.t += CATCHUP_S
    runner.tick()
    clock.t += CATCHUP_S
    runner.tick()
    assert devices_of(store, "d3-c2") == ["a"]


def test_undo_returns_to_the_previous_revision(store):
    clock = Clock()
    runner = DeploymentRunner(store, "svc-1", clock=clock)
    store.upsert_devices({d: status(d, site="w3") for d in "ab"})
    deployments.insert(store, "d3", "det", "3", "site=w3", spec("3", SHA3))
    with pytest.raises(AgentError) as exc:
        revisions.undo(store, "d3")
    assert exc.value.code == "no_previous_revision"
    runner.tick()
    converged(store, runner, clock, "d3-w", "ab")
    deployments.insert(store, "d4", "det", "4", "site=w3", spec("4", SHA4))
    runner.tick()
    converged(store, runner, clock, "d4-w", "ab")
    # d3, superseded, counts its devices as superseded, not converged
    assert deployments.summary(store, ["d3"])["d3"]["waiting_by"] == {"superseded": 2}
    assert [r["version"] for r in revisions.history(store, "d4")] == ["3", "4"]
    with pytest.raises(AgentError) as exc:
        revisions.undo(store, "d3")
    assert exc.value.code == "bad_state_transition"
    row = revisions.undo(store, deployments.get(store, "d4"), actor="ops")
    assert (row["version"], row["state"]) == ("3", "active")
    assert [(r["version"], r["actor"]) for r in revisions.history(store, "d4")][-1] == \
        ("3", "ops")
    clock.t += CATCHUP_S
    runner.tick()
    clock.t += CATCHUP_S
    runner.tick()
    catchup = deployments.rollouts_of(store, "d4")[-1]
    assert devices_of(store, catchup) == ["a", "b"]
    assert rollout_version(store, catchup) == "3"
    # a rejected device is left out of the figures; a re-keyed one too, shown as waiting
    store.put_device_key("b", {"device": "b", "state": "rejected"})
    assert deployments.summary(store, ["d4"])["d4"]["desired"] == 1
    store.put_device_key("a", {"device": "a", "state": "pending",
                               "pending_status": status("a", site="w3")})
    assert deployments.summary(store, ["d4"]).get("d4", {}).get("desired", 0) == 0
    assert states(store, "d4") == {"a": ("waiting", "pending admission (fleet devices accept "
                                         "a)")}


def test_a_pin_to_a_version_the_device_lacks_sends_it(store):
    from agent.fleet.commands.deploy import send_pinned
    from agent.fleet.deployments import registry
    from tests.integration.test_fleet_deployments_store import record

    clock = Clock()
    runner = DeploymentRunner(store, "svc-1", clock=clock)
    store.upsert_devices({d: status(d, site="w3") for d in "ab"})
    for v, sha in (("3", SHA3), ("4", SHA4)):
        registry.put(store, "det", v, record(sha))
    deployments.insert(store, "d4", "det", "4", "site=w3", spec("4", SHA4))
    runner.tick()
    converged(store, runner, clock, "d4-w", "ab")
    pins.pin(store, "a", "det", "4")
    assert send_pinned(store, "a", registry.get(store, "det", "4")) is None  # runs it
    pins.pin(store, "a", "det", "3")
    rid = send_pinned(store, "a", registry.get(store, "det", "3"))
    ro = store.rollout(rid)
    assert ro["stages"] == [["a"]] and ro["spec"]["model_version"] == "3"
    assert ro["spec"]["artifacts"]["model"]["sha256"] == SHA3
    assert ro["spec"]["precision"] == "fp16"  # the deployment's settings
    with pytest.raises(AgentError) as exc:  # in that rollout still
        send_pinned(store, "a", registry.get(store, "det", "3"))
    assert exc.value.code == "device_busy"


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_revision_0008_gives_existing_deployments_their_first_revision(kind, tmp_path,
                                                                      request):
    import json

    from agent.fleet.database import migrate
    from agent.fleet.database.store import Store

    url = request.getfixturevalue("postgres").url if kind == "postgresql" else \
        "sqlite:///" + str(tmp_path / "fleet.db")
    migrate.upgrade(url, target="0004")
    from agent.fleet.database.db import Db

    db = Db(url)
    try:
        db.execute("INSERT INTO deployments (deployment_id, name, version, selector, spec, "
                   "state, created, updated) VALUES ('d3', 'det', '3', 'site=w3', ?, 'active', "
                   "1, 1)", (json.dumps(spec("3", SHA3)),))
    finally:
        db.close()
    migrate.upgrade(url)
    store = Store(url)
    try:
        assert [(r["revision"], r["version"]) for r in revisions.history(store, "d3")] == [
            (1, "3")]
        deployments.insert(store, "d4", "det", "4", "site=w3", spec("4", SHA4))
        assert revisions.undo(store, "d4")["version"] == "3"
        assert pins.list_pins(store) == []
    finally:
        store.close()


def test_pin_unpin_and_undo_commands_check_their_input(tmp_path):
    from agent.fleet.database.store import Store
    from agent.fleet.deployments import registry
    from tests.integration.test_fleet_deployments_store import record
    from tests.integration.test_fleet_service import fleet_cli

    db = "sqlite:///" + str(tmp_path / "fleet.db")
    store = Store(db)
    try:
        store.upsert_devices({"a": status("a", site="w3")})
        registry.put(store, "det", "3", record(SHA3))
        deployments.insert(store, "d3", "det", "3", "site=w3", spec("3", SHA3))
    finally:
        store.close()
    for args, code in ((["pin", "a", "det"], "bad_argument"),
                       (["pin", "nobody", "det@3"], "unknown_device"),
                       (["pin", "a", "det@9"], "unknown_model_version"),
                       (["pin", "a", "det@3", "--reason", "x" * 600], "bad_argument"),
                       (["unpin", "a", "det"], "not_pinned"),
                       (["deployments", "undo", "d3"], "no_previous_revision"),
                       (["deployments", "undo", "d9"], "unknown_deployment"),
                       (["deploy", "det@3", "--to", "site=w3", "--no-accuracy-gate",
                         "--max-attempts", "0"],
                        "bad_argument")):
        out = fleet_cli(args + ["--db", db])
        assert out.returncode == 2 and code in out.stderr, (args, out.stdout, out.stderr)
    out = fleet_cli(["pin", "a", "det@3", "--reason", "hold", "--db", db])
    assert out.returncode == 0 and "rollout pin-a-" in out.stdout, out.stdout + out.stderr
    assert "a" in fleet_cli(["pin", "--db", db]).stdout
    assert fleet_cli(["unpin", "a", "det", "--db", db]).returncode == 0
    out = fleet_cli(["deployments", "history", "d3", "--db", db])
    assert out.returncode == 0 and "site=w3" in out.stdout, out.stderr


def test_a_refused_rollback_leaves_no_pin(store):
    clock = Clock()
    runner = DeploymentRunner(store, "svc-1", clock=clock)
    store.upsert_devices({"a": status("a", site="w3")})
    deployments.insert(store, "d4", "det", "4", "site=w3", spec("4", SHA4))
    runner.tick()
    converged(store, runner, clock, "d4-w", "a")
    for rid, version in (("r1", None), ("r2", "2")):
        store.db.execute("INSERT INTO rollbacks (request_id, device_id, name, version, sent) "
                         "VALUES (?, 'a', 'det', ?, 1)", (rid, version))
        assert pins.rollback_pins(store, [{"request_id": rid, "device": "a", "name": "det",
                                           "version": version}], "why") == {rid: "d4"}
        assert pins.list_pins(store)[0]["version"] == version
        pins.on_rollback_reply(store, "a", {"request_id": rid, "ok": False,
                                            "error": {"code": "no_previous_version"}})
        assert pins.list_pins(store) == []
    # a malformed answer leaves the pin in flight as it was
    pins.rollback_pins(store, [{"request_id": "r1", "device": "a", "name": "det",
                                "version": None}])
    pins.on_rollback_reply(store, "a", {"request_id": "r1", "ok": True,
                                        "result": {"version": "../x"}})
    assert [p["version"] for p in pins.list_pins(store)] == [None]
