import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from agent.device.journal.store import Journal
from agent.errors import AgentError
from agent.wire import protocol, status_messages
from agent.wire.topics import Topics

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
SHA = "ab" * 32
T = Topics()


def emit(row):
    return status_messages.job_status_publication(T, "dev", row)


def doc(job_id="j1", kind="deploy", sha=SHA):
    return {"job_id": job_id, "kind": kind, "device": "dev",
            "artifacts": {"model": {"sha256": sha, "size": 10}}}


@pytest.fixture
def journal(tmp_path):
    j = Journal(str(tmp_path / "state" / "journal.db"))
    yield j
    j.close()


def test_add_job_is_idempotent(journal):
    assert journal.add_job(doc(), emit=emit) is True
    assert journal.add_job(doc(), emit=emit) is False
    assert journal.add_job(dict(doc(), kind="bench")) is False
    row = journal.job("j1")
    assert row["state"] == "QUEUED" and row["version"] == 1 and row["kind"] == "deploy"
    assert row["doc"] == doc() and row["attempts"] == 0
    assert journal.outbox_count() == 1  # the duplicate emitted nothing
    assert journal.job("nope") is None


def test_rejected_job_without_a_valid_document(journal):
    err = AgentError("unknown_job_kind", "job kind must be one of ..., found 'x'").to_dict()
    assert journal.add_job({"job_id": "bad-1", "kind": {"x": 1}}, state="REJECTED", error=err,
                           emit=emit)
    row = journal.job("bad-1")
    assert row["state"] == "REJECTED" and row["kind"] == "" and row["error"]["code"] == \
        "unknown_job_kind"
    msg = protocol.decode("job_status", journal.outbox_pending()[0].payload)
    assert msg["state"] == "REJECTED" and msg["statusDetails"]["error_code"] == "unknown_job_kind"
    with pytest.raises(AgentError) as info:
        journal.add_job({"job_id": "x"}, state="IN_PROGRESS")
    assert info.value.code == "bad_state_transition"
    with pytest.raises(AgentError):
        journal.add_job({"job_id": "../x"})


def test_states_versions_and_fields(journal):
    journal.add_job(doc())
    assert journal.set_state("j1", "IN_PROGRESS", stage="downloading", progress=(0, 4)) == 2
    assert journal.set_state("j1", "IN_PROGRESS", progress={"done": 3, "of": 4},
                             details={"blocks": 3}) == 3
    row = journal.job("j1")
    assert row["stage"] == "downloading" and row["progress"] == {"done": 3, "of": 4}
    assert row["details"] == {"blocks": "3"} and row["attempts"] == 1
    result = {"accuracy": {"passed": True, "sqnr_db": float("inf")}, "throughput_qps": 812.5}
    assert journal.set_state("j1", "SUCCEEDED", stage="activating", result=result) == 4
    row = journal.job("j1")
    assert row["state"] == "SUCCEEDED" and row["result"]["throughput_qps"] == 812.5
    assert row["result"]["accuracy"]["sqnr_db"] is None  # stored JSON-safe
    assert row["details"] == {"blocks": "3"}  # untouched fields stay
    for state in ("IN_PROGRESS", "FAILED", "CANCELED"):
        with pytest.raises(AgentError) as info:
            journal.set_state("j1", state)
        assert info.value.code == "bad_state_transition"
        assert "SUCCEEDED" in info.value.message
    assert journal.job("j1")["version"] == 4
    with pytest.raises(AgentError) as info:
        journal.set_state("ghost", "IN_PROGRESS")
    assert info.value.code == "unknown_job"
    for kwargs in ({"stage": "dancing"}, {"progress": (-1, 3)}, {"error": {"message": "x"}}):
        with pytest.raises(AgentError) as info:
            journal.add_job(doc("j2"))
            journal.set_state("j2", "IN_PROGRESS", **kwargs)
        assert info.value.code == "bad_argument"
    with pytest.raises(AgentError):
        journal.set_state("j2", "DONE")


def test_failed_state_and_its_status_message(journal):
    journal.add_job(doc(), emit=emit)
    journal.set_state("j1", "IN_PROGRESS", stage="building", emit=emit)
    err = AgentError("build_failed", "expected an engine, found a crash").to_dict()
    journal.set_state("j1", "FAILED", error=err, emit=emit)
    pending = journal.outbox_pending()
    assert len(pending) == 1  # retained status is coalesced per topic
    msg = protocol.decode("job_status", pending[0].payload)
    assert msg["version"] == 3 and msg["state"] == "FAILED" and msg["stage"] == "building"
    assert msg["error"]["code"] == "build_failed" and pending[0].retain


def test_emit_failure_rolls_back_the_state_change(journal):
    journal.add_job(doc())

    def broken(row):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        journal.set_state("j1", "IN_PROGRESS", emit=broken)
    assert journal.job("j1")["state"] == "QUEUED" and journal.job("j1")["version"] == 1


def test_queries(journal):
    clock = iter(range(100, 200))
    journal._clock = lambda: float(next(clock))
    for i in range(4):
        journal.add_job(doc("j{}".format(i), sha="{:064x}".format(i)))
    journal.set_state("j1", "IN_PROGRESS")
    journal.set_state("j2", "CANCELED")
    assert [j["job_id"] for j in journal.jobs()] == ["j0", "j1", "j2", "j3"]
    assert [j["job_id"] for j in journal.unfinished_jobs()] == ["j0", "j1", "j3"]
    assert [j["job_id"] for j in journal.jobs(["CANCELED"])] == ["j2"]
    assert journal.jobs([]) == []
    assert len(journal.jobs(limit=2)) == 2
    journal.activate_version("sha-cccccccccccc", "cccccccccccc", "c" * 64, "engine-c")
    refs = journal.referenced_artifacts()
    assert refs == {"{:064x}".format(i) for i in (0, 1, 3)} | {"c" * 64}


def test_prune_keeps_ids(journal):
    for i in range(5):
        journal.add_job(doc("j{}".format(i)))
        journal.set_state("j{}".format(i), "REJECTED", error={"code": "bad_message",
                                                              "message": "x"})
    journal.add_job(doc("live"))
    assert journal.prune(keep=2) == 3
    assert sum(1 for j in journal.jobs() if j["doc"] is None) == 3
    assert journal.job("live")["doc"] is not None
    assert journal.add_job(doc("j0")) is False  # still recognised


def test_outbox_order_ack_and_coalesce(journal):
    seqs = [journal.outbox_put("t/{}".format(i), b"p%d" % i, qos=1) for i in range(5)]
    assert seqs == sorted(seqs)
    assert [item.topic for item in journal.outbox_pending()] == ["t/{}".format(i)
                                                                 for i in range(5)]
    assert journal.outbox_ack(seqs[2]) is True
    assert journal.outbox_ack(seqs[2]) is False
    assert [i.seq for i in journal.outbox_pending(limit=2)] == seqs[:2]
    s = journal.outbox_put("t/0", b"newer", retain=True, coalesce=True)
    pending = journal.outbox_pending()
    assert [i.topic for i in pending] == ["t/1", "t/3", "t/4", "t/0"]
    assert pending[-1].payload == b"newer" and pending[-1].retain and pending[-1].seq == s
    assert journal.outbox_ack(seqs[0]) is False  # coalesced away: a late PUBACK is harmless
    assert journal.outbox_count() == 4


def test_state_survives_reopen(tmp_path):
    path = str(tmp_path / "j.db")
    with Journal(path) as j:
        j.add_job(doc(), emit=emit)
        j.set_state("j1", "IN_PROGRESS", stage="calibrating", progress=(1, 8), emit=emit)
        j.transfer_put(SHA, 1000, 1024, b"\x01")
        j.activate_version("det", "v1", "d" * 64, "e1", "int8", job_id="j1")
        assert j.next_boot() == 1
    with Journal(path) as j:
        row = j.job("j1")
        assert (row["state"], row["version"], row["stage"]) == ("IN_PROGRESS", 2, "calibrating")
        assert j.outbox_count() == 1
        assert j.transfer_get(SHA)["bitmap"] == b"\x01"
        assert j.active_engine("d" * 64)["engine_key"] == "e1"
        assert j.boot() == 1 and j.next_boot() == 2


def test_transfers(journal):
    assert journal.transfer_get(SHA) is None
    journal.transfer_put(SHA, 5000, 1024, b"\x00")
    journal.transfer_update(SHA, b"\x1f")
    t = journal.transfer_get(SHA)
    assert (t["size"], t["block_size"], t["bitmap"]) == (5000, 1024, b"\x1f")
    assert [x["sha256"] for x in journal.transfers()] == [SHA]
    journal.transfer_delete(SHA)
    assert journal.transfers() == []


def test_versions_activate_commit_and_restore(journal):
    m = "d" * 64
    assert journal.active_version("det") is None
    replaced, dropped = journal.activate_version("det", "v1", m, "e1", "fp16", job_id="j1")
    assert replaced is None and dropped == []
    replaced, dropped = journal.activate_version("det", "v2", m, "e2", "int8", job_id="j2",
                                                 state="pending", deadline=5.0)
    assert replaced["version"] == "v1" and dropped == []
    assert journal.pending_versions()[0]["version"] == "v2"
    assert journal.previous_engine(m)["engine_key"] == "e1"
    # re-activating the active version keeps its previous one
    journal.activate_version("det", "v2", m, "e2", "int8", job_id="j3")
    assert journal.active_version("det")["previous"] == "v1"
    assert journal.active_engine(m)["job_id"] == "j3"
    assert [e["engine_key"] for e in journal.active_engines()] == ["e2"]
    # a third version: keep 2 drops v1
    _, dropped = journal.activate_version("det", "v3", m, "e3", "int8", keep=2)
    assert dropped == ["v1"]
    dropped_row = journal.restore_version("det", "v2", reject_reason="unhealthy")
    assert dropped_row["version"] == "v3"
    assert journal.active_version("det")["version"] == "v2"
    assert [r["version"] for r in journal.rejected_versions("det")] == ["v3"]
    assert journal.forget_rejected("det", "v3") and journal.rejected_versions() == []
    status = status_messages.status_message("dev", True, 1, active_engines=journal.active_engines())
    protocol.validate("status", status)


def test_threads_share_one_journal(journal):
    journal.add_job(doc())
    journal.set_state("j1", "IN_PROGRESS")
    errors = []

    def work(n):
        try:
            for i in range(50):
                journal.set_state("j1", "IN_PROGRESS", progress=(i, 50))
                journal.outbox_put("t/{}".format(n), b"x")
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert journal.job("j1")["version"] == 2 + 200 and journal.outbox_count() == 200


WRITER = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from agent.wire import protocol
    from agent.wire import status_messages
    from agent.wire.topics import Topics
    from agent.device.journal.store import Journal
    j = Journal({path!r})
    t = Topics()
    # not retained: every status stays in the outbox, so versions can be counted
    emit = lambda row: protocol.Publication(t.job_status("dev", row["job_id"]),
                                            protocol.encode(row["details"]), 1, False)
    j.add_job({{"job_id": "k", "kind": "bench"}}, emit=emit)
    if j.job("k")["state"] == "QUEUED":
        j.set_state("k", "IN_PROGRESS", emit=emit)
    print("ready", flush=True)
    i = 0
    while True:
        i += 1
        v = j.job("k")["version"]
        j.set_state("k", "IN_PROGRESS", details={{"v": v + 1}}, emit=emit)
        j.transfer_put("{sha}", 4096 * i, 1024, bytes([i % 256]) * 16)
""")


def test_sigkill_mid_write_leaves_a_consistent_journal(tmp_path):
    path = str(tmp_path / "kill.db")
    script = WRITER.format(root=ROOT, path=path, sha=SHA)
    for round_ in range(3):
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
        time.sleep(0.15 + 0.1 * round_)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        db = sqlite3.connect(path)
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        db.close()
        with Journal(path) as j:
            row = j.job("k")
            statuses = j.outbox_pending()
            # every version change and its status message were committed together
            assert len(statuses) == row["version"]
            if row["version"] > 2:
                assert row["details"] == {"v": str(row["version"])}
            t = j.transfer_get(SHA)
            if t is not None:
                assert len(t["bitmap"]) == 16 and len(set(t["bitmap"])) == 1
    assert row["version"] > 5  # the writer really ran
