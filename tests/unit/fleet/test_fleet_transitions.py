"""The rollout's decision on a job status as a transition table
(agent.fleet.rollouts.transitions): the table itself (complete where a status can reach it,
every step named), the events a status is, and each row carried out by a real ``Rollout``
(pure: no broker, no database, the clock injected)."""

import itertools

import pytest

from agent import fleet
from agent.fleet.rollouts import transitions as t
from agent.wire import protocol

PHASES = (t.SEARCHING, t.DEPLOYING)
EVENTS = (t.SEARCH_RUNNING, t.SEARCH_SUCCEEDED, t.SEARCH_SUCCEEDED_HALTED, t.SEARCH_ENDED,
          t.DEPLOY_RUNNING, t.DEPLOY_SUCCEEDED, t.DEPLOY_ENDED)


def docs(device, job_id, kind, layers, **_):
    return {"job_id": job_id, "device": device, "kind": kind,
            "plan": {"precision": "int8", "layer_precisions": dict(layers or {})}}


def status(job_id, device, state, version, kind, **extra):
    msg = {"protocol": 1, "job_id": job_id, "device": device, "kind": kind, "state": state,
           "version": version, "statusDetails": {}}
    msg.update(extra)
    return msg


def searching(devices=("a",), stages=None):
    """A search rollout whose first stage's search jobs were sent (clock: one tick a read)."""
    ticks = itertools.count(100)
    r = fleet.Rollout("ro-1", stages or [list(devices)], docs, search=True,
                      clock=lambda: float(next(ticks)))
    r.start()
    return r


def search(r, device, state, version, **extra):
    return r.on_job_status(device, status("ro-1.search", device, state, version, "search",
                                          **extra))


def deploy(r, device, state, version, **extra):
    return r.on_job_status(device, status("ro-1", device, state, version, "deploy", **extra))


def kinds(actions):
    return [(a.kind, a.job_id) for a in actions]


# -- the table ------------------------------------------------------------------------------

def test_every_pair_a_status_can_reach_has_a_row_and_every_step_exists():
    for phase, event in itertools.product(PHASES, EVENTS):
        row = t.transition(phase, event)
        if phase == t.SEARCHING and event.startswith("deploy"):
            assert row is None  # no deploy job yet: refused before the table
            continue
        assert row is not None, (phase, event)
        assert row.next in PHASES
        assert all(step in t.STEPS for step in row.steps), row
    assert set(t.STEPS) == {s for row in t.TRANSITIONS.values() for s in row.steps}


def test_a_row_is_added_once():
    with pytest.raises(AssertionError):
        t.add_transition(t.SEARCHING, t.SEARCH_RUNNING, t.SEARCHING)


def test_the_event_a_status_is():
    for state in protocol.STATES:
        for is_search, halted in itertools.product((True, False), repeat=2):
            event = t.event_of(is_search, state, halted)
            assert event.startswith("search" if is_search else "deploy")
            if state == "SUCCEEDED":
                assert event == (t.DEPLOY_SUCCEEDED if not is_search else
                                 t.SEARCH_SUCCEEDED_HALTED if halted else t.SEARCH_SUCCEEDED)
            elif protocol.is_terminal(state):
                assert event in (t.SEARCH_ENDED, t.DEPLOY_ENDED)
            else:
                assert event in (t.SEARCH_RUNNING, t.DEPLOY_RUNNING)


# -- each row, carried out ------------------------------------------------------------------

def test_search_running_tracks_the_device():
    r = searching()
    assert search(r, "a", "IN_PROGRESS", 2, stage="building", progress={"done": 1}) == []
    run = r.runs["a"]
    assert (run.phase, run.state, run.job_stage, run.progress) == (
        t.SEARCHING, "IN_PROGRESS", "building", {"done": 1})
    assert run.started == 101.0  # (100 was the rollout's start)


def test_search_succeeded_sends_the_deploy_job_with_the_layers_it_found():
    r = searching()
    acts = search(r, "a", "SUCCEEDED", 2, result={"keep": ["conv1"]})
    assert kinds(acts) == [("clear", "ro-1.search"), ("publish", "ro-1")]
    run = r.runs["a"]
    assert (run.phase, run.state, run.sent_layers) == (t.DEPLOYING, "IN_PROGRESS",
                                                       {"conv1": "float32"})
    assert acts[1].doc["plan"]["layer_precisions"] == {"conv1": "float32"}


def test_search_succeeded_after_a_halt_sends_no_deploy():
    r = searching(stages=[["a", "b"]])
    r.halt("stopped by a test")
    acts = search(r, "a", "SUCCEEDED", 2, result={"keep": []})
    assert kinds(acts) == [("clear", "ro-1.search")]
    run = r.runs["a"]
    assert (run.phase, run.state, run.local) == (t.SEARCHING, "CANCELED", True)
    assert run.note == "search done; deploy not sent: stopped by a test"


def test_search_ended_ends_the_run_and_decides_the_stage():
    r = searching(stages=[["a"], ["b"]])
    acts = search(r, "a", "FAILED", 2, error={"code": "build_failed", "message": "no"})
    run = r.runs["a"]
    assert (run.phase, run.state, run.local, run.error["code"]) == (
        t.SEARCHING, "FAILED", False, "build_failed")
    assert ("clear", "ro-1.search") in kinds(acts)
    assert r.halted and r.outcome in ("aborted", "halted")  # the stage's only device failed


def test_a_late_search_status_changes_nothing_once_deploying():
    r = searching()
    search(r, "a", "SUCCEEDED", 2, result={})
    before = r.runs["a"].to_dict()
    assert search(r, "a", "IN_PROGRESS", 3) == []
    assert r.runs["a"].to_dict() == before and r.runs["a"].state == "IN_PROGRESS"


def test_deploy_running_then_succeeded_keeps_the_result_and_starts_the_next_stage():
    r = searching(stages=[["a"], ["b"]])
    search(r, "a", "SUCCEEDED", 2, result={})
    assert deploy(r, "a", "IN_PROGRESS", 2, stage="activating") == []
    assert r.runs["a"].job_stage == "activating"
    acts = deploy(r, "a", "SUCCEEDED", 3, result={"fps": 30})
    run = r.runs["a"]
    assert (run.phase, run.state, run.result, run.job_stage) == (
        t.DEPLOYING, "SUCCEEDED", {"fps": 30}, "")
    assert kinds(acts) == [("clear", "ro-1"), ("publish", "ro-1.search")]  # stage 2: b
    assert r.current == 1


def test_deploy_ended_batched_leaves_the_decision_owed():
    r = searching(stages=[["a"], ["b"]])
    search(r, "a", "SUCCEEDED", 2, result={})
    acts = r.on_job_status("a", status("ro-1", "a", "TIMED_OUT", 2, "deploy"), evaluate=False)
    assert kinds(acts) == [("clear", "ro-1")]
    assert r.pending_eval and r.runs["a"].error["code"] == "internal_error"
    assert r.evaluate() == [] and r.halted  # decided now: the stage failed


def test_a_device_that_picked_up_a_cancelled_job_is_followed_again():
    r = searching(stages=[["a", "b"]])
    r.halt("stopped")  # a is QUEUED: cancelled here
    assert r.runs["a"].local and r.runs["a"].state == "CANCELED"
    search(r, "a", "IN_PROGRESS", 2)
    assert not r.runs["a"].local and r.runs["a"].state == "IN_PROGRESS"
