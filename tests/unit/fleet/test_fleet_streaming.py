"""Streaming a stage (agent/fleet/rollouts/rollout.py ``Rollout.more``,
agent/fleet/rollouts/streaming.py): the
documents of a large stage are built a batch at a time, a stage passes only once all of it was
sent, a restart sends exactly the devices not sent yet, and the service's batch sizes stay
bounded; the service's compact device directory (agent/fleet/mqtt_edge.py) keeps boots only."""

from agent import fleet
from agent.fleet.mqtt_edge import DeviceDirectory
from agent.fleet.rollouts import streaming
from agent.fleet.rollouts.device_run import PENDING
from agent.fleet.rollouts.policy import Policy
from agent.fleet.rollouts.rollout import Rollout
from agent.wire import protocol

SHA = "a" * 64
ARTIFACTS = {"model": {"sha256": SHA, "size": 10, "name": "m.onnx"}}


def docs(device, job_id, kind, layers):
    return fleet.job_document(job_id, kind, device, ARTIFACTS, {"precision": "fp16"},
                              created=1.0)


def status(device, state, version, job_id="r1"):
    msg = {"protocol": 1, "job_id": job_id, "device": device, "kind": "deploy",
           "state": state, "version": version, "statusDetails": {}}
    if state == "FAILED":
        msg["error"] = {"code": "build_failed", "message": "expected an engine, found none"}
    protocol.validate("job_status", msg)
    return msg


def devices(n, prefix="d"):
    return ["{}{:04d}".format(prefix, i) for i in range(n)]


def published(actions):
    return [a.device for a in actions if a.kind == "publish"]


def test_a_stage_starts_with_one_batch_and_the_rest_comes_batch_by_batch():
    stage = devices(1000)
    ro = Rollout("r1", [stage], docs)
    first = ro.start()
    assert published(first) == stage[:ro.first_batch]
    assert ro.unsent == 1000 - ro.first_batch
    sent = list(published(first))
    while ro.unsent:
        batch = ro.more(300)
        assert 0 < len(published(batch)) <= 300
        sent += published(batch)
    assert sent == stage  # each device once, in stage order
    assert ro.more(300) == []
    assert all(r.state == "QUEUED" for r in ro.runs.values())


def test_a_stage_passes_only_once_all_of_it_was_sent():
    first, second = devices(500, "a"), devices(10, "b")
    ro = Rollout("r1", [first, second], docs, Policy(success_threshold=0.1))
    sent = published(ro.start())
    for dev in sent:  # 200 of 500 succeed: above the threshold, not all sent
        assert not published(ro.on_job_status(dev, status(dev, "SUCCEEDED", 1)))
    assert ro.current == 0 and ro.unsent == 300
    rest = ro.more(1000)
    assert len(published(rest)) == 300 and ro.unsent == 0
    assert ro.evaluate() and ro.current == 1  # owed since the last batch went out
    assert set(published(ro.more(100))) <= set(second)


def test_a_restart_sends_the_devices_not_sent_and_nothing_twice():
    stage = devices(700)
    ro = Rollout("r1", [stage], docs)
    sent = published(ro.start() + ro.more(100))
    # As durable.load rebuilds it: same states, cursor 0.
    again = Rollout("r1", [stage], docs)
    again.current = 0
    for dev in stage:
        run, old = again.runs[dev], ro.runs[dev]
        run.load(old.state, old.to_dict())
    assert again.unsent == 700  # an upper bound: the cursor starts over
    rest = []
    while again.unsent:
        rest += published(again.more(250))
    assert sorted(rest + sent) == sorted(stage) and not set(rest) & set(sent)


def test_a_halt_cancels_what_was_not_sent():
    stage = devices(600)
    ro = Rollout("r1", [stage], docs, Policy(abort_failure_rate=0.0))
    sent = published(ro.start())
    ro.on_job_status(sent[0], status(sent[0], "FAILED", 1))
    assert ro.halted and ro.more(1000) == [] and ro.unsent == 0
    assert not any(r.state == PENDING for r in ro.runs.values())
    unsent = [r for r in ro.runs.values() if r.note.startswith("not started")]
    assert len(unsent) == 600 - len(sent) and not {r.device for r in unsent} & set(sent)


def test_doc_quota_keeps_unacknowledged_publications_bounded():
    assert streaming.doc_quota(0) == streaming.DOC_BATCH
    assert streaming.doc_quota(streaming.MAX_UNACKED - 10) == 10
    assert streaming.doc_quota(streaming.MAX_UNACKED + 50) == 0
    assert streaming.pump_timeout(100, 10, 0.2) == streaming.STREAMING_PUMP_S
    assert streaming.pump_timeout(100, 0, 0.2) == 0.2  # the broker is behind: wait for acks
    assert streaming.pump_timeout(0, 500, 0.2) == 0.2


def test_split_shares_the_quota_between_rollouts():
    assert streaming.split(500, 10000, others=1) == 250
    assert streaming.split(500, 30, others=1) == 30
    assert streaming.split(1, 10, others=3) == 1
    assert streaming.split(0, 10) == 0


def test_a_compact_directory_keeps_the_boot_and_its_checks():
    full, compact = DeviceDirectory(), DeviceDirectory(compact=True)
    birth = {"device": "d1", "online": True, "boot": 3, "platform": {"board": "x" * 500}}
    will = {"device": "d1", "online": False, "boot": 2}
    for d in (full, compact):
        assert d.on_status("d1", birth)
        assert not d.on_status("d1", will)  # a late Will of an older boot
        d.on_telemetry("d1", {"gpu": 1.0})
    assert full.status["d1"] is birth and compact.status["d1"] == {"boot": 3}
    assert compact.telemetry == {} and full.telemetry
    assert compact.known() == ["d1"]
    other = DeviceDirectory(compact=True)
    other.on_status("d2", dict(birth, device="d2"))
    assert other.status["d2"] is compact.status["d1"]  # one dict per boot number, shared


def test_documents_held_in_memory_share_their_common_parts():
    from agent.fleet.rollouts.doc_parts import Parts

    parts = Parts()
    a = parts.share(docs("d1", "r1", "deploy", None))
    b = parts.share(fleet.job_document("r1", "deploy", "d2", ARTIFACTS, {"precision": "fp32"},
                                       created=1.0))
    c = parts.share(docs("d3", "r1", "deploy", None))
    assert a["artifacts"] is b["artifacts"] is c["artifacts"]
    assert a["plan"] is c["plan"] and a["plan"] is not b["plan"]  # another plan: its own
    assert a["device"] == "d1" and c == dict(docs("d3", "r1", "deploy", None))
    ro = Rollout("r1", [devices(3)], docs)
    sent = [a.doc for a in ro.start()]
    assert sent[0]["artifacts"] is sent[2]["artifacts"]
