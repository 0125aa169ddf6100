"""The rollout policy and state machine (agent/fleet/rollouts/policy.py, rollout.py): targets,
stages, abort and success thresholds, the search -> deploy sequence, cancellation, the results
table."""

import io

import pytest

from agent import fleet
from agent.errors import AgentError
from agent.wire import protocol

SHA = "a" * 64
ARTIFACTS = {"model": {"sha256": SHA, "size": 10, "name": "m.onnx"}}


def docs(device, job_id, kind, layers):
    plan = {"precision": "fp16"}
    if layers:
        plan["layer_precisions"] = layers
    return fleet.job_document(job_id, kind, device, ARTIFACTS, plan, created=1.0,
                              search={"mode": "bisect"} if kind == "search" else None)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


def status(job_id, device, state, version, **extra):
    msg = {"protocol": 1, "job_id": job_id, "device": device, "kind": "deploy",
           "state": state, "version": version, "statusDetails": {}}
    msg.update(extra)
    protocol.validate("job_status", msg)
    return msg


def kinds(actions):
    return [(a.kind, a.device, a.job_id) for a in actions]


# ---------------------------------------------------------------------------- targets, stages

def test_select_devices_explicit_all_and_match():
    known = ["nano-2", "nano-1", "orin-1"]
    assert fleet.select_devices(known, ["orin-1", "nano-2", "orin-1"]) == ["orin-1", "nano-2"]
    assert fleet.select_devices(known, all_devices=True) == ["nano-1", "nano-2", "orin-1"]
    assert fleet.select_devices(known, pattern="nano-*") == ["nano-1", "nano-2"]


def test_select_devices_unknown_and_empty():
    with pytest.raises(AgentError) as err:
        fleet.select_devices(["a"], ["a", "ghost"])
    assert err.value.code == "unknown_device" and "ghost" in err.value.message
    assert err.value.details["unknown"] == ["ghost"]
    with pytest.raises(AgentError) as err:
        fleet.select_devices([], all_devices=True)
    assert err.value.code == "unknown_device"
    with pytest.raises(AgentError) as err:
        fleet.select_devices(["a"], pattern="b*")
    assert err.value.code == "unknown_device" and "'b*'" in err.value.message
    with pytest.raises(AgentError) as err:
        fleet.select_devices(["a"], ["a"], all_devices=True)
    assert err.value.code == "bad_argument"
    with pytest.raises(AgentError) as err:
        fleet.select_devices(["a"], ["bad/id"])
    assert err.value.code == "bad_argument"


@pytest.mark.parametrize("n,batch,percent,sizes", [
    (5, None, None, [5]),
    (5, 2, None, [2, 2, 1]),
    (5, 1, None, [1, 1, 1, 1, 1]),
    (10, None, 25, [3, 3, 3, 1]),
    (3, None, 10, [1, 1, 1]),
    (4, None, 100, [4]),
])
def test_plan_stages(n, batch, percent, sizes):
    devices = ["d{}".format(i) for i in range(n)]
    stages = fleet.plan_stages(devices, batch, percent)
    assert [len(s) for s in stages] == sizes
    assert [d for s in stages for d in s] == devices  # order kept


@pytest.mark.parametrize("batch,percent", [(0, None), (None, 0), (None, 101), (2, 50)])
def test_plan_stages_bad(batch, percent):
    with pytest.raises(AgentError) as err:
        fleet.plan_stages(["a", "b"], batch, percent)
    assert err.value.code == "bad_argument"


# ---------------------------------------------------------------------------- thresholds

def test_abort_reason_counts_only_finished_devices():
    policy = fleet.Policy(abort_failure_rate=0.5, min_executed=2)
    assert fleet.abort_reason(["REJECTED"], policy) is None  # below the minimum
    assert fleet.abort_reason(["REJECTED", "QUEUED", "CANCELED"], policy) is None
    assert fleet.abort_reason(["REJECTED", "SUCCEEDED"], policy) is None  # 50% is not > 50%
    why = fleet.abort_reason(["REJECTED", "TIMED_OUT", "SUCCEEDED"], policy)
    assert why is not None and "2/3" in why and "50%" in why
    assert fleet.abort_reason(["FAILED"] * 5, fleet.Policy()) is None  # no abort configured
    assert fleet.abort_reason(["SUCCEEDED"], fleet.Policy(abort_failure_rate=0.0)) is None
    assert fleet.abort_reason(["FAILED"], fleet.Policy(abort_failure_rate=0.0)) is not None


def test_stage_verdict():
    all_ = fleet.Policy(success_threshold=1.0)
    half = fleet.Policy(success_threshold=0.5)
    assert fleet.stage_verdict(["SUCCEEDED", "IN_PROGRESS"], all_) == "running"
    assert fleet.stage_verdict(["SUCCEEDED", "SUCCEEDED"], all_) == "passed"
    assert fleet.stage_verdict(["SUCCEEDED", "FAILED"], all_) == "failed"
    assert fleet.stage_verdict(["FAILED", "IN_PROGRESS"], all_) == "failed"  # cannot reach it
    assert fleet.stage_verdict(["SUCCEEDED", "IN_PROGRESS"], half) == "passed"  # early
    assert fleet.stage_verdict(["FAILED", "IN_PROGRESS", "QUEUED"], half) == "running"


@pytest.mark.parametrize("policy", [fleet.Policy(success_threshold=0),
                                    fleet.Policy(abort_failure_rate=1.0),
                                    fleet.Policy(min_executed=0)])
def test_bad_policy(policy):
    with pytest.raises(AgentError) as err:
        fleet.check_policy(policy)
    assert err.value.code == "bad_argument"


# ---------------------------------------------------------------------------- the rollout

def test_stages_follow_one_another():
    r = fleet.Rollout("ro-1", [["a"], ["b", "c"]], docs, clock=Clock())
    first = r.start()
    assert kinds(first) == [("publish", "a", "ro-1")]
    assert first[0].doc["device"] == "a" and first[0].doc["job_id"] == "ro-1"
    assert r.runs["b"].state == fleet.PENDING
    assert r.on_job_status("a", status("ro-1", "a", "IN_PROGRESS", 2, stage="building")) == []
    assert r.runs["a"].job_stage == "building"
    acts = r.on_job_status("a", status("ro-1", "a", "SUCCEEDED", 3, result={"precision": "fp16"}))
    assert kinds(acts) == [("clear", "a", "ro-1"), ("publish", "b", "ro-1"),
                           ("publish", "c", "ro-1")]
    r.mark_cleared("a", "ro-1")
    r.on_job_status("b", status("ro-1", "b", "SUCCEEDED", 4))
    assert not r.done
    r.on_job_status("c", status("ro-1", "c", "SUCCEEDED", 4))
    assert r.done and r.succeeded and r.final_outcome() == "succeeded"


def test_stale_and_foreign_statuses_are_dropped():
    r = fleet.Rollout("ro-1", [["a"]], docs, clock=Clock())
    r.start()
    r.on_job_status("a", status("ro-1", "a", "IN_PROGRESS", 5, stage="building"))
    assert r.on_job_status("a", status("ro-1", "a", "QUEUED", 1)) == []  # older version
    assert r.runs["a"].state == "IN_PROGRESS"
    err = {"code": "build_failed", "message": "x"}
    assert r.on_job_status("a", status("other-job", "a", "FAILED", 9, error=err)) == []
    assert r.on_job_status("zz", status("ro-1", "zz", "FAILED", 9, error=err)) == []
    assert r.runs["a"].state == "IN_PROGRESS"


def test_abort_cancels_queued_and_pending_devices():
    policy = fleet.Policy(abort_failure_rate=0.5, min_executed=1)
    r = fleet.Rollout("ro-1", [["nano", "offline"], ["b"]], docs, policy, clock=Clock())
    r.start()
    error = {"code": "unsupported_precision", "message": "int8 is not supported on Nano"}
    acts = r.on_job_status("nano", status("ro-1", "nano", "REJECTED", 2, error=error))
    assert ("clear", "nano", "ro-1") in kinds(acts)
    # the offline device never started: its retained document is cleared and a cancel sent
    assert ("cancel", "offline", "ro-1") in kinds(acts)
    assert ("clear", "offline", "ro-1") in kinds(acts)
    assert not any(a.device == "b" for a in acts)  # never published, nothing to undo
    assert r.runs["offline"].state == "CANCELED" and "abort threshold" in r.runs["offline"].note
    assert r.runs["b"].state == "CANCELED" and r.runs["b"].note.startswith("not started")
    assert r.done and not r.succeeded
    assert r.final_outcome() == "aborted" and "1/1" in r.reason
    rows = [fleet.result_row(run) for run in r.ordered()]
    assert rows[0]["error_code"] == "unsupported_precision"
    table = fleet.results_table(rows)
    assert "REJECTED" in table and "unsupported_precision [1]" in table
    assert "int8 is not supported on Nano" in table and "not started: failure rate" in table


def test_a_cancelled_device_that_had_started_reports_the_truth():
    policy = fleet.Policy(abort_failure_rate=0.0)
    r = fleet.Rollout("ro-1", [["a", "b"]], docs, policy, clock=Clock())
    r.start()
    r.on_job_status("a", status("ro-1", "a", "FAILED", 3, error={"code": "build_failed",
                                                                 "message": "x"}))
    assert r.runs["b"].state == "CANCELED" and r.done
    r.on_job_status("b", status("ro-1", "b", "IN_PROGRESS", 2, stage="building"))
    assert r.runs["b"].state == "IN_PROGRESS" and not r.done  # it had picked the job up
    r.on_job_status("b", status("ro-1", "b", "CANCELED", 3, error={"code": "cancelled",
                                                                   "message": "by request"}))
    assert r.done and r.runs["b"].state == "CANCELED"


def test_failed_stage_halts_without_abort_policy():
    r = fleet.Rollout("ro-1", [["a", "b"], ["c"]], docs, fleet.Policy(success_threshold=1.0),
                      clock=Clock())
    r.start()
    r.on_job_status("b", status("ro-1", "b", "IN_PROGRESS", 2))
    acts = r.on_job_status("a", status("ro-1", "a", "FAILED", 3, error={"code": "build_failed",
                                                                        "message": "x"}))
    assert not any(a.kind == "publish" for a in acts)
    assert r.runs["c"].state == "CANCELED"
    assert r.runs["b"].state == "IN_PROGRESS"  # running devices finish
    assert r.final_outcome() == "halted"
    assert r.reason.startswith("stage 1 halted by a FAILED (build_failed: x): 0 of 2 device(s)")
    assert r.runs["c"].note == "not started: " + r.reason  # the bystander says why
    r.on_job_status("b", status("ro-1", "b", "SUCCEEDED", 3))
    assert r.done and not r.succeeded


def test_search_then_deploy_with_the_layers_found():
    r = fleet.Rollout("ro-1", [["a"]], docs, search=True, clock=Clock())
    assert r.job_ids == ["ro-1.search", "ro-1"]
    first = r.start()
    assert kinds(first) == [("publish", "a", "ro-1.search")]
    assert first[0].doc["kind"] == "search" and first[0].doc["search"] == {"mode": "bisect"}
    acts = r.on_job_status("a", status("ro-1.search", "a", "SUCCEEDED", 4, kind="search",
                                       result={"keep": ["Add", "Sub"], "precision": "fp16",
                                               "keep_precision": "float32"}))
    assert kinds(acts) == [("clear", "a", "ro-1.search"), ("publish", "a", "ro-1")]
    deploy = acts[1].doc
    assert deploy["kind"] == "deploy"
    assert deploy["plan"]["layer_precisions"] == {"Add": "float32", "Sub": "float32"}
    assert r.runs["a"].state == "IN_PROGRESS" and r.runs["a"].phase == "deploy"
    # a late copy of the search status changes nothing
    assert r.on_job_status("a", status("ro-1.search", "a", "SUCCEEDED", 5, kind="search")) == []
    r.on_job_status("a", status("ro-1", "a", "SUCCEEDED", 6, result={
        "precision": "fp16", "throughput_qps": 1000.0, "latency_ms": {"median": 0.5, "p99": 1.0},
        "accuracy": {"passed": True, "max_abs_error": 0.0}, "emulated": True}))
    assert r.succeeded
    row = fleet.result_row(r.runs["a"], {"platform": {"board": "Jetson AGX Orin"}})
    assert row["layers_kept"] == {"Add": "float32", "Sub": "float32"}
    assert row["board"] == "Jetson AGX Orin" and row["latency_p50_ms"] == 0.5
    table = fleet.results_table([row])
    assert "Add,Sub:fp32" in table and "fp16*" in table and "emulated" in table


def test_search_failure_ends_the_device():
    r = fleet.Rollout("ro-1", [["a"]], docs, search=True, clock=Clock())
    r.start()
    acts = r.on_job_status("a", status("ro-1.search", "a", "FAILED", 3, kind="search",
                                       error={"code": "search_failed", "message": "none"}))
    assert kinds(acts) == [("clear", "a", "ro-1.search")]
    assert r.runs["a"].state == "FAILED" and r.done


def test_expire_gives_up_on_unfinished_devices():
    r = fleet.Rollout("ro-1", [["a", "b"], ["c"]], docs, clock=Clock())
    r.start()
    r.on_job_status("a", status("ro-1", "a", "IN_PROGRESS", 2))
    acts = r.expire("the rollout did not finish within 5 s")
    assert ("cancel", "a", "ro-1") in kinds(acts) and ("cancel", "b", "ro-1") in kinds(acts)
    assert r.runs["a"].state == "TIMED_OUT" and r.runs["c"].state == "CANCELED"
    assert r.done and r.final_outcome() == "timed_out"


def test_job_document_is_checked():
    doc = fleet.job_document("j1", "deploy", "dev", ARTIFACTS, {"precision": "int8"},
                             fallback=["fp16"], gate={"min_top1": 0.9})
    protocol.validate("job", doc)
    with pytest.raises(AgentError) as err:
        fleet.job_document("j1", "deploy", "dev", ARTIFACTS, {"precision": "int4"})
    assert err.value.code == "bad_argument" and "plan.precision" in err.value.message
    many = {"layer_{:05d}".format(i): "float32" for i in range(2000)}
    with pytest.raises(AgentError) as err:
        fleet.job_document("j1", "deploy", "dev", ARTIFACTS, {"precision": "fp16",
                                                              "layer_precisions": many})
    assert err.value.code == "bad_argument" and "32768" in err.value.message


def test_rollout_ids():
    rid = fleet.new_rollout_id("/x/examples/digits/model.onnx", clock=lambda: 1700000000)
    assert rid.startswith("digits-") and protocol.valid_id(rid)
    assert fleet.new_rollout_id("resnet 50.onnx").startswith("resnet-50-")
    with pytest.raises(AgentError):
        fleet.check_rollout_id("x" * 60)


def test_accuracy_summary():
    assert fleet.accuracy_summary(None) == "-"
    cls = {"passed": True, "label_accuracy": 0.978, "golden_label_accuracy": 0.976,
           "top1_agreement": 0.998}
    assert fleet.accuracy_summary(cls) == "acc 97.8% (fp32 97.6%), top-1 99.8%, pass"
    reg = {"passed": False, "max_abs_error": float("inf"), "top1_agreement": 0.5}
    assert fleet.accuracy_summary(reg) == "max|err| inf, FAIL"


def test_progress_lines_without_a_terminal():
    out = io.StringIO()
    view = fleet.ProgressView(out, tty=False, clock=Clock())
    r = fleet.Rollout("ro-1", [["a"]], docs, clock=Clock())
    r.start()
    view.update(r, {"a": {"online": False}})
    view.update(r, {"a": {"online": False}})  # nothing changed: no line
    r.on_job_status("a", status("ro-1", "a", "IN_PROGRESS", 2, stage="downloading",
                                progress={"done": 3, "of": 3}))
    view.update(r, {"a": {"online": True}})
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "a: QUEUED deploy (device offline)" in lines[0]
    assert "IN_PROGRESS deploy: downloading [####################] 3/3" in lines[1]


def test_progress_bars_on_a_terminal_redraw_in_place():
    out = io.StringIO()
    view = fleet.ProgressView(out, tty=True, min_interval=0, clock=Clock())
    r = fleet.Rollout("ro-1", [["a", "b"]], docs, clock=Clock())
    r.start()
    view.update(r, {})
    r.on_job_status("a", status("ro-1", "a", "IN_PROGRESS", 2, stage="calibrating",
                                progress={"done": 1, "of": 2}))
    view.update(r, {})
    text = out.getvalue()
    assert text.count("\x1b[3F") == 1  # moved up over the 3 lines drawn before
    assert "[##########..........] 1/2" in text
