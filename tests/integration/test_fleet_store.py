"""The fleet database on SQLite and on a real PostgreSQL: the device registry (the last known
board survives a Will), rollouts saved and loaded with their jobs, status history and outbox,
refusing a device already in an unfinished rollout, signing sequences reserved in blocks, and
leases between two service instances."""

import pytest

from agent import fleet
from agent.errors import AgentError
from agent.fleet.rollouts import durable
from agent.wire.topics import Topics
from tests.integration.postgres import postgres  # noqa: F401 - fixture


def docs(device, job_id, kind, layers):
    return {"job_id": job_id, "device": device, "kind": kind, "layers": layers}


def status(job_id, device, state, version, **extra):
    msg = {"protocol": 1, "job_id": job_id, "device": device, "kind": "deploy",
           "state": state, "version": version, "statusDetails": {}}
    msg.update(extra)
    return msg


def test_registry_keeps_the_last_known_board_and_has_no_limit(store):
    births = {"d{:04d}".format(i): {"device": "d{:04d}".format(i), "online": True, "boot": 1,
                                    "platform": {"board": "Orin"}} for i in range(1500)}
    store.upsert_devices(births)
    store.upsert_devices({"d0001": {"device": "d0001", "online": False, "boot": 1,
                                    "reason": "connection_lost"}})
    devices = store.devices()
    assert len(devices) == 1500
    d1 = store.device("d0001")
    assert d1["online"] is False and d1["board"] == "Orin" and d1["reason"] == "connection_lost"
    assert store.statuses()["d0001"]["platform"] == {"board": "Orin"}
    store.touch_devices({"d0002": {"ts": 5.0, "metrics": {"cpu_percent": 3}}})
    assert store.device("d0002")["telemetry"]["metrics"] == {"cpu_percent": 3}


def test_a_rollout_round_trips_with_its_jobs_history_and_outbox(store):
    spec = {"precision": "fp16", "artifacts": {}, "policy": {"success_threshold": 1.0}}
    store.insert_rollout("ro-1", spec, [["a"], ["b"]], deadline=9e9)
    with pytest.raises(AgentError) as err:
        store.insert_rollout("ro-1", spec, [["c"]], deadline=9e9)
    assert err.value.code == "bad_argument"
    ro = durable.load(store, "ro-1", docs)
    msgs = durable.messages(Topics(), ro, ro.start())
    ids = durable.save(store, ro, msgs)
    assert len(ids) == 1 and store.outbox()[0][1].endswith("/devices/a/jobs/ro-1")
    ro.on_job_status("a", status("ro-1", "a", "IN_PROGRESS", 2, stage="building"))
    durable.save(store, ro)
    store.outbox_done(ids)
    assert store.outbox() == []

    again = durable.load(store, "ro-1", docs)  # what a restarted service sees
    run = again.runs["a"]
    assert (run.state, run.job_stage, run.versions, run.published) == (
        "IN_PROGRESS", "building", {"ro-1": 2}, ["ro-1"])
    assert again.current == 0 and again.runs["b"].state == fleet.PENDING
    assert durable.republish(Topics(), again)[0][0].endswith("/a/jobs/ro-1")
    acts = again.on_job_status("a", status("ro-1", "a", "SUCCEEDED", 3, result={}))
    assert [a.kind for a in acts] == ["clear", "publish"]  # stage 2 starts
    durable.save(store, again, durable.messages(Topics(), again, acts))
    history = store.job_history("ro-1")
    assert [(h["device"], h["version"], h["state"]) for h in history] == [
        ("a", 2, "IN_PROGRESS"), ("a", 3, "SUCCEEDED")]
    row = store.rollout("ro-1")
    assert row["state"] == "running" and row["current_stage"] == 1
    assert row["stage_progress"][0]["counts"] == {"SUCCEEDED": 1}
    assert store.busy_devices(["a", "b", "z"]) == {"b": "ro-1"}
    # Messages a finished rollout still owes are found by whoever starts next.
    store.save_rollout("ro-1", {"state": "succeeded"}, {}, outbox=[("t/x", b"", True)])
    owed = [(t, r) for _, t, _, r in store.outbox_of_finished()]
    assert owed[-1] == ("t/x", True) and len(owed) == len(store.outbox())
    assert [j["device"] for j in store.device_jobs()] == ["a", "b"]


def test_sequences_are_reserved_in_blocks_and_never_reused(store):
    seq = durable.DbSequence(store, block=10)
    got = [seq.next("k1") for _ in range(25)]
    assert got == list(range(1, 26))
    other = durable.DbSequence(store, block=10)  # a restarted service: a fresh block
    assert other.next("k1") == 31
    assert other.next("k2", floor=1000) == 1000


def test_leases_pass_to_another_instance_only_when_they_expire(store):
    store.insert_rollout("ro-a", {"artifacts": {}}, [["a"]], deadline=9e9)
    store.insert_rollout("ro-b", {"artifacts": {}}, [["b"]], deadline=9e9)
    assert store.claim("one", 30, now=100.0, only=["ro-a"]) == ["ro-a"]
    assert store.claim("two", 30, now=101.0) == ["ro-b"]
    assert store.claim("two", 30, now=140.0) == ["ro-a", "ro-b"]  # one went silent
    store.request_control("ro-a", "pause")
    assert store.rollout("ro-a")["control"] == "pause"
    store.save_rollout("ro-b", {"state": "succeeded"}, {})
    with pytest.raises(AgentError) as err:
        store.request_control("ro-b", "cancel")
    assert err.value.code == "bad_state_transition"


def test_signed_documents_stay_valid_until_the_rollouts_deadline(store, tmp_path):
    import time

    from agent.wire import job_signer, signing

    keys = job_signer.generate_keypair(str(tmp_path / "keys"), "k")
    signer = job_signer.Signer(keys["private_key"], str(tmp_path / "seq.json"), validity_s=3600)
    signer.sequence = durable.DbSequence(store, mirror=signer.sequence)
    deadline = time.time() + 5 * 86400  # a device may be offline for days
    spec = {"precision": "fp16", "policy": {}, "artifacts": {
        "model": {"sha256": "a" * 64, "size": 10}}}
    store.insert_rollout("ro-s", spec, [["dev"]], deadline=deadline)
    doc = durable.factory_for(store, "ro-s", signer)("dev", "ro-s", "deploy", None)
    assert doc["signature"]["expires"] >= int(deadline)
    trust = signing.TrustStore.from_entries([keys["public_key"]])
    accepted = signing.check_job(doc, "dev", trust, allow_unsigned=False,
                                 last_seq=lambda kid: 0, now=deadline - 60)
    assert accepted.seq == doc["signature"]["seq"] >= int(time.time() * 1000) - 60000


def _history(store, now):
    """Five rollouts of two stages, newest first: e (running), d (paused), c (failed an hour
    ago), b (succeeded two days ago), a (succeeded three days ago)."""
    jobs = {"a": "SUCCEEDED", "b": "SUCCEEDED", "c": "FAILED", "d": "IN_PROGRESS",
            "e": "PENDING"}
    for age, rid in enumerate("edcba"):
        store.insert_rollout("ro-" + rid, {"precision": "fp16", "artifacts": {}},
                             [["x-" + rid], ["y-" + rid, "z-" + rid]], deadline=now + 60)
        state = {"e": "running", "d": "paused", "c": "failed"}.get(rid, "succeeded")
        fields = {"created": now - 86400 * age, "state": state, "current_stage": 1}
        if state not in ("running", "paused"):
            fields["finished"] = now - 3600 if rid == "c" else now - 86400 * age
        result = {"result": {"throughput_qps": 100.0 + age}, "job_id": "ro-" + rid}
        if jobs[rid] == "FAILED":
            result["error"] = {"code": "accuracy_gate", "message": "too far"}
        store.save_rollout("ro-" + rid, fields, {
            "x-" + rid: (0, "SUCCEEDED", result), "y-" + rid: (1, jobs[rid], result)})


def test_rollouts_are_paged_newest_first_with_their_counts_in_few_queries(store):
    import time

    from agent.fleet.web import views

    _history(store, time.time())
    assert [r["rollout_id"] for r in store.rollouts()] == ["ro-e", "ro-d", "ro-c", "ro-b",
                                                          "ro-a"]
    page = store.rollouts(limit=2, offset=1)
    assert [r["rollout_id"] for r in page] == ["ro-d", "ro-c"]
    assert page == [store.rollout("ro-d"), store.rollout("ro-c")]
    assert page[1]["counts"] == {"SUCCEEDED": 1, "FAILED": 1, "PENDING": 1}
    assert [s["counts"] for s in page[1]["stage_progress"]] == [
        {"SUCCEEDED": 1}, {"FAILED": 1, "PENDING": 1}]
    assert page[1]["stages"] == [["x-c"], ["y-c", "z-c"]]
    assert [r["rollout_id"] for r in store.rollouts(states=("running", "paused"))] == [
        "ro-e", "ro-d"]
    assert store.rollouts(states=()) == [] and store.rollouts(limit=3, offset=5) == []
    assert store.rollout("nope") is None
    states = store.rollout_states(["ro-e", "ro-c", "nope"])
    assert sorted(states) == ["ro-c", "ro-e"]
    assert (states["ro-e"]["state"], states["ro-e"]["control"]) == ("running", None)
    store.request_control("ro-e", "pause")
    assert store.rollout_states(["ro-e"])["ro-e"]["control"] == "pause"
    # The list's failures (one query for the page) are the rollout page's.
    rows = views.rollout_rows(store, limit=3)
    assert [r["failures"] for r in rows] == [
        views.rollout_detail(store, store.rollout(r["rollout_id"]))["failures"] for r in rows]
    assert rows[2]["failures"] == [{"device": "y-c", "stage": 2, "state": "FAILED",
                                    "reason": "accuracy_gate: too far"}]
    assert (rows[2]["done"], rows[2]["total"]) == (2, 3)


def test_metrics_of_rollouts_and_engines_say_what_the_database_holds(store):
    import time

    from prometheus_client.parser import text_string_to_metric_families

    from agent.fleet.web import metrics

    now = time.time()
    _history(store, now)
    store.upsert_devices({"x-a": {"online": True, "active_engines": [
        {"job_id": "ro-a", "activated": now}]}, "x-b": {"online": True}})
    samples = {}
    for fam in text_string_to_metric_families(metrics.exposition(store)[0].decode()):
        for s in fam.samples:
            if s.name.startswith("jetson_fleet_rollout") or "throughput" in s.name:
                samples[(s.name[13:],) + tuple(sorted(s.labels.values()))] = s.value
    # ro-b and ro-a finished days ago: their series ended. x-a's engine came from ro-a.
    assert samples == {
        ("rollout_devices", "PENDING", "ro-e"): 2, ("rollout_devices", "SUCCEEDED", "ro-e"): 1,
        ("rollout_devices", "IN_PROGRESS", "ro-d"): 1,
        ("rollout_devices", "PENDING", "ro-d"): 1, ("rollout_devices", "SUCCEEDED", "ro-d"): 1,
        ("rollout_devices", "FAILED", "ro-c"): 1, ("rollout_devices", "PENDING", "ro-c"): 1,
        ("rollout_devices", "SUCCEEDED", "ro-c"): 1,
        ("rollout_progress_ratio", "ro-e"): 1 / 3.0, ("rollout_progress_ratio", "ro-d"): 1 / 3.0,
        ("rollout_progress_ratio", "ro-c"): 2 / 3.0,
        ("rollout_stage", "ro-e"): 2, ("rollout_stage", "ro-d"): 2, ("rollout_stage", "ro-c"): 2,
        ("rollout_stages", "ro-e"): 2, ("rollout_stages", "ro-d"): 2,
        ("rollout_stages", "ro-c"): 2,
        ("rollout_active", "ro-e", "running"): 1, ("rollout_active", "paused", "ro-d"): 1,
        ("rollout_active", "failed", "ro-c"): 0,
        # (model and precision unknown: the statuses name no model)
        ("engine_throughput_qps", "", "", "x-a"): 104.0,
        ("engine_throughput_qps", "", "", "x-b"): 103.0}
