"""Deployments converging, decided by the service's runner over the fleet database (SQLite and
a real PostgreSQL), the devices' side played by writing what the service would record (job
ends, statuses, models messages): a first wave of the online devices matching the selector,
an offline device when it returns, a new device, a re-imaged device (its models message shows
no version), relabelling in and out, an app's rejection held until an operator retries, a
failure by reason, a superseding deployment that leaves the devices already on @4 alone; the
model registry (immutable versions, rm refused while used)."""

import json

import pytest

from agent.errors import AgentError
from agent.fleet.database import device_models
from agent.fleet.deployments import deployments, labels, registry
from agent.fleet.deployments.deployment_runner import CATCHUP_S, DeploymentRunner
from tests.integration.postgres import postgres  # noqa: F401 - fixture

SHA3, SHA4 = "3" * 64, "4" * 64




def status(dev, online=True, boot=1, **lab):
    return {"device": dev, "online": online, "boot": boot,
            "platform": {"board": "Jetson Orin Nano 8GB", "jetpack": "6.0",
                         "tensorrt": "8.6.2", "backend": "tensorrt",
                         "features": ["named_models"], "labels": lab}}


def models(dev, boot=1, **held):
    """held: name -> (version, sha[, rejected])"""
    out = []
    for name, v in held.items():
        m = {"name": name, "version": v[0], "state": "committed", "model": v[1],
             "precision": "fp16"}
        if len(v) > 2:
            m["rejected"] = list(v[2])
        out.append(m)
    return {"device": dev, "boot": boot, "models": out}


def record(sha):
    return {"artifacts": {"model": {"sha256": sha, "size": 10, "name": "m.onnx"}},
            "defaults": {"precision": "fp16"}, "notes": ""}


def spec(version, sha):
    return {"precision": "fp16", "model_name": "det", "model_version": version,
            "artifacts": {"model": {"sha256": sha, "size": 10}}, "timeout": 600.0,
            "policy": {"success_threshold": 1.0}, "percent": 50}


class Clock:
    t = 1000.0

    def __call__(self):
        return self.t


def end_jobs(store, rollout_id, state="SUCCEEDED", error=None, only=None):
    """What the service records when the devices answer and the rollout ends."""
    import time

    for dev, in store.db.query("SELECT device_id FROM jobs WHERE rollout_id = ?",
                               (rollout_id,)):
        if only is None or dev in only:
            store.db.execute("UPDATE jobs SET state = ?, data = ?, updated = ? WHERE "
                             "rollout_id = ? AND device_id = ?",
                             (state, json.dumps({"error": error}), time.time(), rollout_id,
                              dev))
    if only is None:
        store.db.execute("UPDATE rollouts SET state = 'succeeded' WHERE rollout_id = ?",
                         (rollout_id,))


def devices_of(store, rollout_id):
    return sorted(r[0] for r in store.db.query("SELECT device_id FROM jobs WHERE rollout_id = ?",
                                               (rollout_id,)))


def states(store, dep):
    return {d["device"]: (d["state"], d["reason"]) for d in deployments.device_states(store, dep)}


def test_a_deployment_converges_and_stays_converged(store):
    clock = Clock()
    runner = DeploymentRunner(store, "svc-1", clock=clock)
    store.upsert_devices({d: status(d, site="w3") for d in "abc"})
    store.upsert_devices({"d": status("d", online=False, site="w3"),
                          "e": status("e", site="lab")})
    assert registry.put(store, "det", "3", record(SHA3))
    deployments.insert(store, "d3", "det", "3", "site=w3", spec("3", SHA3))
    runner.tick()
    assert deployments.get(store, "d3")["state"] == "rolling"
    assert devices_of(store, "d3-w") == ["a", "b", "c"]  # d offline, e elsewhere
    assert len(store.rollout("d3-w")["stages"]) == 2  # --percent 50
    assert states(store, "d3")["d"] == ("waiting", "offline")
    end_jobs(store, "d3-w")
    runner.tick()
    assert deployments.get(store, "d3")["state"] == "active"
    assert {d: s[0] for d, s in states(store, "d3").items()} == {
        "a": "converged", "b": "converged", "c": "converged", "d": "waiting"}
    # d returns; f is registered: one catch-up each (gathered CATCHUP_S apart at most)
    store.upsert_devices({"d": status("d", site="w3")})
    runner.touch(["d"])
    runner.tick()
    assert devices_of(store, "d3-c1") == ["d"]
    store.upsert_devices({"f": status("f", site="w3")})
    runner.touch(["f"])
    runner.tick()
    assert deployments.rollouts_of(store, "d3") == ["d3-w", "d3-c1"]  # not yet: gathered
    clock.t += CATCHUP_S
    runner.tick()
    assert devices_of(store, "d3-c2") == ["f"]
    end_jobs(store, "d3-c1")
    end_jobs(store, "d3-c2")
    # a device that says nothing new gets nothing: no scan, no rollout
    runner.touch(["b", "c"])
    clock.t += CATCHUP_S
    runner.tick()
    assert len(deployments.rollouts_of(store, "d3")) == 3
    # a re-imaged device (same id, empty journal): its models message shows no version
    device_models.save(store, {"a": models("a", boot=1)})
    runner.touch(["a"])
    clock.t += CATCHUP_S
    runner.tick()
    assert devices_of(store, "d3-c3") == ["a"]
    end_jobs(store, "d3-c3")
    device_models.save(store, {"a": models("a", boot=1, det=("3", SHA3))})
    runner.touch(["a"])
    runner.tick()
    assert states(store, "d3")["a"] == ("converged", None)
    # relabelled in (an operator's label wins over the device's claim) and out
    labels.assign(store, "e", {"site": "w3"})
    labels.assign(store, "b", {"site": "lab"})
    clock.t += CATCHUP_S
    runner.tick()
    assert devices_of(store, "d3-c4") == ["e"]
    assert "b" not in states(store, "d3")
    # the app rejected the version on c: not sent again until an operator retries
    device_models.save(store, {"c": models("c", boot=2, det=("2", "2" * 64, ["3"]))})
    runner.touch(["c"])
    clock.t += CATCHUP_S
    runner.tick()
    assert states(store, "d3")["c"] == ("failed", "version_rejected")
    assert len(deployments.rollouts_of(store, "d3")) == 5
    deployments.retry(store, "d3", ["c"])
    clock.t += CATCHUP_S
    runner.tick()
    assert devices_of(store, "d3-c5") == ["c"]
    end_jobs(store, "d3-c5", "FAILED", {"code": "accuracy_gate_failed", "message": "x"})
    runner.touch(["c"])
    runner.tick()
    assert states(store, "d3")["c"] == ("failed", "accuracy_gate_failed: x")
    summary = deployments.summary(store, ["d3"])["d3"]
    assert summary["failed_by"] == {"accuracy_gate_failed": 1}
    # rm of a version refused while deployed and kept; a different push refused
    with pytest.raises(AgentError) as exc:
        registry.remove(store, "det", "3")
    assert exc.value.code == "model_in_use"
    assert not registry.put(store, "det", "3", record(SHA3))
    with pytest.raises(AgentError) as exc:
        registry.put(store, "det", "3", record(SHA4))
    assert exc.value.code == "model_version_exists"
    with pytest.raises(AgentError) as exc:  # the devices' models layout: current -> version
        registry.put(store, "det", "current", record(SHA4))
    assert exc.value.code == "bad_argument"


def test_a_newer_deployment_supersedes_without_touching_devices_on_it(store):
    clock = Clock()
    runner = DeploymentRunner(store, "svc-1", clock=clock)
    store.upsert_devices({d: status(d, site="w3") for d in "abcd"})
    deployments.insert(store, "d3", "det", "3", "site=w3", spec("3", SHA3))
    runner.tick()
    end_jobs(store, "d3-w")
    runner.tick()
    for d in "ab":
        device_models.save(store, {d: models(d, det=("3", SHA3))})
    for d in "cd":  # already on @4 (a rollout by hand)
        device_models.save(store, {d: models(d, det=("4", SHA4))})
    runner.touch("abcd")
    runner.tick()
    older = deployments.insert(store, "d4", "det", "4", "site = w3", spec("4", SHA4))
    assert older == ["d3"] and deployments.get(store, "d3")["state"] == "superseded"
    runner.tick()
    assert devices_of(store, "d4-w") == ["a", "b"]
    assert {d: s[0] for d, s in states(store, "d4").items()} == {
        "a": "in_progress", "b": "in_progress", "c": "converged", "d": "converged"}
    # a second runner (another instance) waits for the lease
    other = DeploymentRunner(store, "svc-2", clock=clock)
    other.tick()
    assert not other.leader



def test_on_leave_remove_is_sent_to_devices_that_leave_not_to_those_handed_over(store):
    runner = DeploymentRunner(store, "svc-1", clock=Clock())
    sent = []
    runner.send_command = lambda dev, cmd: sent.append((dev, cmd["command"], cmd["name"]))

    def st(dev, online=True, old=False):
        s = status(dev, online=online, site="w3")
        s["platform"]["features"] = ["named_models"] + ([] if old else ["remove_model"])
        return s

    store.upsert_devices({"a": st("a"), "b": st("b"), "c": st("c", old=True),
                          "d": st("d", online=False)})
    deployments.insert(store, "d3", "det", "3", "site=w3", dict(spec("3", SHA3),
                                                                  on_leave="remove"))
    deployments.insert(store, "d3x", "det", "3", "site=w4", spec("3", SHA3))
    runner.tick()
    end_jobs(store, "d3-w")
    for d in "abcd":
        device_models.save(store, {d: models(d, det=("3", SHA3))})
    runner.touch("abcd")
    runner.tick()
    labels.assign(store, "a", {"site": "lab"})  # leaves: removed
    labels.assign(store, "b", {"site": "w4"})  # handed over to d3x (same name): kept
    labels.assign(store, "c", {"site": "lab"})  # a daemon without remove_model: kept
    labels.assign(store, "d", {"site": "lab"})  # offline: when it is back
    runner.tick()
    assert sent == [("a", "remove", "det")]
    store.upsert_devices({"d": st("d")})
    runner.touch(["d"])
    runner.tick()
    assert sent == [("a", "remove", "det"), ("d", "remove", "det")]
    runner.touch("abcd")
    runner.tick()
    assert len(sent) == 2  # once each


def test_the_preview_judges_devices_as_the_runner_does(store):
    from agent.fleet.admission import admission
    from agent.fleet.deployments import preview, selectors

    store.upsert_devices({"a": status("a", site="w3"), "b": status("b", site="w3"),
                          "c": status("c", online=False, site="w3"),
                          "e": status("e", site="lab"), "p": status("p", site="w3")})
    device_models.save(store, {"b": models("b", det=("3", SHA3)),
                               "a": models("a", det=("2", "2" * 64))})
    store.put_device_key("p", {"device": "p", "state": "pending"})
    labels.assign(store, "e", {"site": "w3"})  # the operator's word over its claim
    dep = {"deployment_id": "d3", "name": "det", "version": "3", "selector": "site=w3",
           "spec": spec("3", SHA3)}
    plan = {r["device"]: (r["action"], r["current"])
            for r in preview.plan(store, dep, selectors.parse("site=w3"))}
    assert plan == {"a": ("install", "2"), "b": ("converged", "3"), "c": ("offline", None),
                    "e": ("install", None), "p": ("not_eligible", None)}
    assert [d["device"] for d in preview.matching(store, selectors.parse("site=lab"))] == []
    admission.decommission(store, "a")
    assert "a" not in {d["device"] for d in preview.matching(store, selectors.parse(
        "site=w3"), eligible_only=True)}
    assert deployments.rows(store) == []  # nothing recorded
    assert store.db.query("SELECT COUNT(*) FROM rollouts")[0][0] == 0


def test_metrics_and_dashboard_show_deployments(store):
    from agent.fleet.web import metrics, pages, views

    runner = DeploymentRunner(store, "svc-1", clock=Clock())
    store.upsert_devices({d: status(d, site="w3") for d in "ab"})
    store.upsert_devices({"c": status("c", online=False, site="w3")})
    deployments.insert(store, "d3", "det", "3", "site=w3", spec("3", SHA3))
    runner.tick()
    end_jobs(store, "d3-w", "FAILED", {"code": "accuracy_gate_failed"}, only=["a"])
    end_jobs(store, "d3-w", only=["b"])
    store.db.execute("UPDATE rollouts SET state = 'failed' WHERE rollout_id = 'd3-w'")
    runner.tick()
    body = metrics.exposition(store)[0].decode()
    assert 'jetson_fleet_deployment_devices{deployment="d3",state="converged"} 1.0' in body
    assert 'jetson_fleet_deployment_devices{deployment="d3",state="offline"} 1.0' in body
    assert ('jetson_fleet_deployment_failed_devices{deployment="d3",'
            'reason="accuracy_gate_failed"} 1.0') in body
    assert 'jetson_fleet_deployment_info{deployment="d3",model="det",selector="site=w3",' \
        'state="active",version="3"} 1.0' in body
    rows = views.deployment_rows(store)
    html = pages.fleet_page([], [], False, rows).decode()
    assert "Deployments" in html and "det@3" in html and "1 accuracy_gate_failed" in html


def test_pause_resume_and_rm(store):
    from agent.fleet.deployments.controls import apply

    clock = Clock()
    runner = DeploymentRunner(store, "svc-1", clock=clock)
    store.upsert_devices({d: status(d, site="w3") for d in "ab"})
    deployments.insert(store, "d3", "det", "3", "site=w3", spec("3", SHA3))
    apply(store, "d3", "pause")
    runner.tick()  # paused before its first wave: nothing sent
    assert deployments.rollouts_of(store, "d3") == []
    apply(store, "d3", "resume")
    runner.tick()
    assert devices_of(store, "d3-w") == ["a", "b"]
    end_jobs(store, "d3-w")
    runner.tick()
    apply(store, "d3", "pause")
    store.upsert_devices({"c": status("c", site="w3")})
    runner.touch(["c"])
    clock.t += CATCHUP_S
    runner.tick()
    assert deployments.rollouts_of(store, "d3") == ["d3-w"]
    assert states(store, "d3")["c"] == ("waiting", "paused")
    apply(store, "d3", "resume")
    clock.t += CATCHUP_S
    runner.tick()
    assert devices_of(store, "d3-c1") == ["c"]
    apply(store, "d3", "rm")
    assert store.rollout("d3-c1")["control"] == "cancel"
    with pytest.raises(AgentError) as exc:
        apply(store, "d3", "resume")
    assert exc.value.code == "bad_state_transition"


def test_models_push_is_immutable_and_deploy_checks_its_input(tmp_path):
    import os

    from tests.integration.test_fleet_service import ROOT, fleet_cli

    fp16 = os.path.join(ROOT, "examples", "fp16_max")
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    push = ["models", "push", os.path.join(fp16, "model.onnx"), "--name", "det", "--version",
            "3", "--inputs", os.path.join(fp16, "inputs.json"), "--golden",
            os.path.join(fp16, "golden.json"), "--precision", "fp16", "--db", db]
    assert "stored" in fleet_cli(push).stdout
    again = fleet_cli(push)
    assert again.returncode == 0 and "already stored, identical" in again.stdout
    other = fleet_cli(push + ["--notes", "not the same"])
    assert other.returncode == 2 and "model_version_exists" in other.stderr, other.stderr
    shown = fleet_cli(["models", "show", "det@3", "--json", "--db", db])
    assert json.loads(shown.stdout)["defaults"] == {"precision": "fp16"}
    for args, code in ((["deploy", "det@9", "--to", "a=b"], "unknown_model_version"),
                       (["deploy", "det@3", "--to", "a in b"], "bad_selector"),
                       (["deploy", "det", "--to", "a"], "bad_argument"),
                       (["label", "nobody", "a=b"], "unknown_device")):
        out = fleet_cli(args + ["--db", db])
        assert out.returncode == 2 and code in out.stderr, (args, out.stderr)
    deployed = fleet_cli(["deploy", "det@3", "--to", "site=w3", "--id", "d3", "--db", db,
                          "--allow-empty"])
    assert deployed.returncode == 0, deployed.stderr
    refused = fleet_cli(["models", "rm", "det@3", "--db", db])
    assert refused.returncode == 2 and "model_in_use" in refused.stderr
    assert fleet_cli(["deployments", "rm", "d3", "--db", db]).returncode == 0
    assert "removed" in fleet_cli(["models", "rm", "det@3", "--db", db]).stdout
    assert "no model versions" in fleet_cli(["models", "ls", "--db", db]).stdout
