"""The switch's transition table, every row and every refused pair, without I/O."""

import itertools

import pytest

from agent.device.models import switch_states as s
from agent.device.models.commit_logic import CommitState

H, W, R, B = s.HANDOFF, s.WAITING, s.RESUMED, s.ROLLING_BACK

# The specification, row by row: (phase, event) -> (next, actions...).
PENDING_ROWS = {
    s.PROBE_PASSED: ("same", "probe_ended", "note_probe", "decide"),
    s.PROBE_FAILED: ("same", "probe_ended", "note_probe", "decide"),
    s.LIVE: ("same", "note_live", "decide"),
    s.COMMIT_REQUEST: ("same", "note_commit", "decide"),
    s.HEALTHY: ("same", "note_health", "decide"),
    s.UNHEALTHY: ("same", "note_health", "decide"),
    s.TICK: ("same", "decide"),
    s.OPERATOR_ROLLBACK: (B, "rollback"),
    s.SET_REVERTED: (B, "rollback_unconfirmed"),
    s.KEEP_WAITING: ("same",),
    s.CONFIRMED: (s.COMMITTED, "commit"),
    s.REFUSED: (B, "rollback"),
    s.JOB_ENDED: (B, "rollback_unconfirmed"),
    s.UNANSWERED: (H, "retry_handoff"),
    s.UNANSWERED_FINAL: (B, "rollback_unconfirmed"),
    s.UNANSWERED_SWITCHING: (B, "rollback_unconfirmed"),
}
EXPECTED = {(phase, event): (phase if row[0] == "same" else row[0],) + row[1:]
            for phase in (H, W) for event, row in PENDING_ROWS.items()}
EXPECTED.update({
    (s.RECORDED, s.START): (H, "start_handoff"),
    (H, s.HANDOFF_DONE): (W, "handoff_ended", "note_handoff", "step_pending", "decide"),
    (H, s.PREPARE_FAILED): (s.ABANDONED, "handoff_ended", "abandon"),
    (H, s.PROBE_DUE): (H,),
    (W, s.HANDOFF_DONE): (W, "handoff_ended", "decide"),
    (W, s.PREPARE_FAILED): (W, "handoff_ended", "decide"),
    (W, s.PROBE_DUE): (W, "start_probe"),
    (B, s.HANDOFF_DONE): (B, "handoff_ended"),
    (B, s.PREPARE_FAILED): (B, "handoff_ended"),
    (B, s.REVERTED): (s.ROLLED_BACK, "restore"),
    (B, s.PROBE_PASSED): (B, "probe_ended"),
    (B, s.PROBE_FAILED): (B, "probe_ended"),
    (B, s.LIVE): (B, "note_live"),
    (B, s.HEALTHY): (B,),
    (B, s.UNHEALTHY): (B,),
    (B, s.TICK): (B,),
    (B, s.PROBE_DUE): (B,),
    (B, s.OPERATOR_ROLLBACK): (B,),
    (B, s.SET_REVERTED): (B,),
    (R, s.LIVE): (R, "note_live"),
    (R, s.IN_WINDOW): (H, "start_handoff"),
    (R, s.REFUSED): (B, "rollback"),
    (R, s.UNANSWERED): (H, "retry_handoff"),
    (R, s.UNANSWERED_FINAL): (B, "rollback_unconfirmed"),
    (R, s.ORPHANED): (B, "rollback"),
})


@pytest.mark.parametrize("phase,event", sorted(EXPECTED))
def test_every_row(phase, event):
    row = s.step(phase, event)
    assert (row.next,) + row.actions == EXPECTED[(phase, event)]
    assert s.accepts(phase, event)


def test_every_other_pair_is_refused():
    refused = [pair for pair in itertools.product(s.PHASES, s.EVENTS) if pair not in EXPECTED]
    assert set(s.TABLE) == set(EXPECTED)
    for phase, event in refused:
        assert not s.accepts(phase, event)
        with pytest.raises(s.NoTransition, match="no transition from {} on {}".format(
                phase, event)):
            s.step(phase, event)
    # What the requests rely on: no commit of a version rolling back or not yet resumed,
    # nothing leaves an end.
    assert (B, s.COMMIT_REQUEST) in refused and (R, s.COMMIT_REQUEST) in refused
    assert not any(phase in s.ENDS for phase, _ in s.TABLE)
    with pytest.raises(s.NoTransition):
        s.step("nowhere", s.TICK)


def test_the_table_is_closed():
    """Every action is run somewhere, ``decide`` comes last, every phase can be reached."""
    used = {a for row in s.TABLE.values() for a in row.actions}
    assert used == set(s.ACTIONS)
    assert all("decide" not in row.actions[:-1] for row in s.TABLE.values())
    reached = {R, s.RECORDED}  # where a switch starts: a restart, or an activation
    for _ in s.PHASES:
        reached |= {row.next for (phase, _e), row in s.TABLE.items() if phase in reached}
    assert reached == set(s.PHASES)
    with pytest.raises(AssertionError):
        s.add_transition(H, s.TICK, H)  # a second row for one pair


def _state(need=("app",), deadline=10.0):
    return CommitState(frozenset(need), deadline, 10.0)


def test_verdicts():
    v = s.verdict
    st = _state()
    assert v(W, st, 1.0, False, False, False, True) == (s.JOB_ENDED, "")
    assert v(H, st, 1.0, True, True, False, True) == (s.KEEP_WAITING, "")
    assert v(W, st, 1.0, True, False, False, True) == (s.KEEP_WAITING, "")
    st.on_health(True)
    assert v(H, st, 1.0, True, True, False, True) == (s.KEEP_WAITING, "")  # still switching
    assert v(W, st, 1.0, True, False, False, True) == (s.CONFIRMED, "confirmed by app")
    st = _state()
    st.on_commit("the app")
    assert v(H, st, 1.0, True, True, False, True) == (s.CONFIRMED, "committed by the app")
    st = _state()
    st.on_health(False, "boom")
    assert v(H, st, 1.0, True, True, False, True) == (
        s.REFUSED, "the app reported it unhealthy: boom")
    silent = "no confirmation (app) within 10 s"
    assert v(W, _state(), 10.0, True, False, False, True) == (s.UNANSWERED, silent)
    assert v(W, _state(), 10.0, True, False, False, False) == (s.UNANSWERED_FINAL, silent)
    assert v(H, _state(), 10.0, True, True, False, True) == (s.UNANSWERED_SWITCHING, silent)
    probe = _state(("probe",))
    assert v(W, probe, 10.0, True, False, True, True) == (
        s.REFUSED, "no confirmation (probe) within 10 s")  # it said no until the end
    assert v(W, _state(()), 0.0, True, False, False, True) == (
        s.CONFIRMED, "confirmed by the accuracy gate")


def test_resumed_verdicts():
    rv = s.resumed_verdict
    assert rv(_state(), 20.0, "cut short", True, 10) == (s.REFUSED, "cut short")
    assert rv(_state(), 1.0, "cut short", True, 10) == (s.IN_WINDOW, "")  # not yet due
    st = _state(("live",))
    st.on_live(False, "live check: agreement 0.1")
    assert rv(st, 1.0, None, True, 10) == (s.REFUSED, "live check: agreement 0.1")
    down = "no confirmation within 10 s (the agent was down)"
    assert rv(_state(), 20.0, None, True, 10) == (s.UNANSWERED, down)
    assert rv(_state(), 20.0, None, False, 10) == (s.UNANSWERED_FINAL, down)


def test_probe_due():
    st = _state(("probe",))
    assert s.probe_due(st, False, 2.0, 2.0)
    assert not s.probe_due(st, True, 9.0, 2.0) and not s.probe_due(st, False, 1.0, 2.0)
    st.on_probe(True)
    assert not s.probe_due(st, False, 9.0, 2.0)
    assert not s.probe_due(_state(), False, 9.0, 2.0)
