"""The controller accepts a job status only as an answer to a job it sent (issue 10, 5d):
right device, job id and kind, a version above the last one and not absurdly far above it,
nothing after the device's own terminal answer. A status retained from an earlier run of the
same rollout id is no answer, but once the job is sent again the device keeps that state (it
ignores the document as a duplicate): it is adopted, not reported TIMED_OUT."""

from agent import fleet
from agent.fleet.rollouts.rollout import MAX_VERSION_STEP


def docs(device, job_id, kind, layers):
    return {"job_id": job_id, "device": device, "kind": kind}


def status(job_id, device, state, version, kind="deploy", **extra):
    msg = {"protocol": 1, "job_id": job_id, "device": device, "kind": kind, "state": state,
           "version": version, "statusDetails": {}}
    msg.update(extra)
    return msg


def test_statuses_that_answer_nothing_we_sent_are_refused():
    r = fleet.Rollout("ro-1", [["a"], ["b"]], docs)
    r.start()
    # b's job was never sent: a forged SUCCEEDED changes nothing.
    assert r.on_job_status("b", status("ro-1", "b", "SUCCEEDED", 2, result={})) == []
    assert r.runs["b"].state == fleet.PENDING
    # another device's name in the message, the wrong kind, an absurd version jump
    assert r.on_job_status("a", status("ro-1", "b", "FAILED", 2, error={})) == []
    assert r.on_job_status("a", status("ro-1", "a", "FAILED", 2, kind="search",
                                       error={})) == []
    r.on_job_status("a", status("ro-1", "a", "IN_PROGRESS", 2))
    assert r.on_job_status("a", status("ro-1", "a", "FAILED", 3 + MAX_VERSION_STEP,
                                       error={})) == []
    assert r.runs["a"].state == "IN_PROGRESS" and r.refused == 3
    # the device's own terminal answer is final
    r.on_job_status("a", status("ro-1", "a", "SUCCEEDED", 3, result={}))
    assert r.runs["a"].state == "SUCCEEDED"
    r.on_job_status("a", status("ro-1", "a", "FAILED", 4, error={"code": "x"}))
    assert r.runs["a"].state == "SUCCEEDED" and r.refused == 4
    assert [h[3] for h in r.history] == ["IN_PROGRESS", "SUCCEEDED"]


def test_a_rerun_of_the_same_id_adopts_what_the_devices_already_did():
    r = fleet.Rollout("ro-1", [["a", "b"]], docs)
    # Retained from the earlier run, seen before anything is sent: no answer yet.
    assert r.on_job_status("a", status("ro-1", "a", "SUCCEEDED", 9, result={"x": 1})) == []
    assert r.runs["a"].state == fleet.PENDING
    acts = r.start()
    assert [a.kind for a in acts] == ["publish", "clear", "publish"]
    a = r.runs["a"]
    assert a.state == "SUCCEEDED" and a.result == {"x": 1}
    assert "already run job ro-1" in a.note
    assert r.runs["b"].state == "QUEUED"
    r.on_job_status("b", status("ro-1", "b", "SUCCEEDED", 2, result={}))
    assert r.succeeded
