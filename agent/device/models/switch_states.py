"""The model switch's decisions as a transition table (pure: no I/O, no clock of its own).

A pending version is in one *phase*; what happens to it is an *event*; each row of ``TABLE``
says ``(phase, event) -> (next phase, actions)``, the way the Mender client's daemon adds its
transitions (``AddTransition``) and its update modules name their states (ArtifactInstall,
ArtifactCommit, ArtifactRollback). The actions are names; ``agent.device.models.switch_machine``
runs them in order (journal writes, threads to the hand-off adapters, the job's end).

    phase          meaning                                       ArtifactXxx
    recorded       the journal holds it pending (activation)
    resumed        read back from the journal after a restart
    handoff        adapters prepare / switch / confirm (thread)  Install
    waiting        probe, the app's word, the live check          (before Commit)
    rolling_back   ``current`` back, adapters revert (thread)     Rollback
    committed      ended: the version counts                      Commit
    rolled_back    ended: the previous version restored
    abandoned      ended: ``prepare`` failed, nothing switched

Events come from three places: a thread's outcome (``SwitchEvent`` on the main loop), a
request (the app or an operator), and ``verdict`` (what ``commit_logic`` and the switch's own
facts say when the machine asks "decide"). A pair with no row is refused (``step`` raises
``NoTransition``): a commit of a version already rolling back is ``not_pending``; a row with no
actions is an event the phase ignores on purpose.
"""

from typing import Dict, NamedTuple, Optional, Tuple

from agent.device.models.commit_logic import COMMIT, WAIT, CommitState

# Phases
RECORDED, RESUMED = "recorded", "resumed"
HANDOFF, WAITING, ROLLING_BACK = "handoff", "waiting", "rolling_back"
COMMITTED, ROLLED_BACK, ABANDONED = "committed", "rolled_back", "abandoned"
PHASES = (RECORDED, RESUMED, HANDOFF, WAITING, ROLLING_BACK, COMMITTED, ROLLED_BACK, ABANDONED)
ENDS = (COMMITTED, ROLLED_BACK, ABANDONED)  # no longer pending: no row leaves them

START = "start"  # activation: the journal holds the version pending
# Events: threads' outcomes
HANDOFF_DONE = "handoff_done"  # adapters switched and confirmed (or one failed at switch)
PREPARE_FAILED = "prepare_failed"  # an adapter's prepare() failed: nothing was switched
PROBE_PASSED, PROBE_FAILED = "probe_passed", "probe_failed"
LIVE = "live"  # the live check's figures (a pass, a skip or a refusal)
REVERTED = "reverted"  # ``current`` back and the adapters reverted
# Events: requests and time
COMMIT_REQUEST = "commit"  # the app's or ``jetson-agent models commit``
HEALTHY, UNHEALTHY = "healthy", "unhealthy"  # the app's report on the pending version
OPERATOR_ROLLBACK = "operator_rollback"
SET_REVERTED = "set_reverted"  # the model set it belongs to reverted
ORPHANED = "orphaned"  # found pending after a restart with no job waiting for it
TICK = "tick"
PROBE_DUE = "probe_due"
# Events: verdicts (``verdict`` / ``resumed_verdict``)
KEEP_WAITING = "wait"
CONFIRMED = "confirmed"  # every need confirmed, or an explicit commit
REFUSED = "refused"  # a failure said so (adapter, app, live check, probe): rejected
JOB_ENDED = "job_ended"  # its job was cancelled under it: never committed later
UNANSWERED = "unanswered"  # the window closed in silence: reopened (retries left)
UNANSWERED_FINAL = "unanswered_final"  # ... and no retry left: rolled back, unconfirmed
UNANSWERED_SWITCHING = "unanswered_switching"  # ... with an adapter still in switch()
IN_WINDOW = "in_window"  # resumed inside its window: handed off again
EVENTS = (START, HANDOFF_DONE, PREPARE_FAILED, PROBE_PASSED, PROBE_FAILED, LIVE, REVERTED,
          COMMIT_REQUEST, HEALTHY, UNHEALTHY, OPERATOR_ROLLBACK, SET_REVERTED, ORPHANED, TICK,
          PROBE_DUE, KEEP_WAITING, CONFIRMED, REFUSED, JOB_ENDED, UNANSWERED, UNANSWERED_FINAL,
          UNANSWERED_SWITCHING, IN_WINDOW)

# Actions (``SwitchMachine`` runs ``_do_<action>``)
ACTIONS = ("handoff_ended", "probe_ended", "note_handoff", "note_probe", "note_live",
           "note_health", "note_commit", "step_pending", "decide", "start_handoff",
           "start_probe", "retry_handoff", "commit", "rollback", "rollback_unconfirmed",
           "restore", "abandon")


class Transition(NamedTuple):
    next: str
    actions: Tuple[str, ...] = ()


class NoTransition(ValueError):
    """A (phase, event) pair the table has no row for."""


TABLE: Dict[Tuple[str, str], Transition] = {}


def add_transition(phase: str, event: str, next_phase: str, *actions: str) -> None:
    assert phase in PHASES and next_phase in PHASES and event in EVENTS, (phase, event)
    assert all(a in ACTIONS for a in actions) and (phase, event) not in TABLE, actions
    TABLE[(phase, event)] = Transition(next_phase, tuple(actions))


def _rows() -> None:
    add = add_transition
    add(RECORDED, START, HANDOFF, "start_handoff")
    add(HANDOFF, HANDOFF_DONE, WAITING, "handoff_ended", "note_handoff", "step_pending",
        "decide")
    add(HANDOFF, PREPARE_FAILED, ABANDONED, "handoff_ended", "abandon")
    # A hand-off that ends in another phase (a late one) only frees the next.
    add(WAITING, HANDOFF_DONE, WAITING, "handoff_ended", "decide")
    add(WAITING, PREPARE_FAILED, WAITING, "handoff_ended", "decide")
    add(ROLLING_BACK, HANDOFF_DONE, ROLLING_BACK, "handoff_ended")
    add(ROLLING_BACK, PREPARE_FAILED, ROLLING_BACK, "handoff_ended")
    add(ROLLING_BACK, REVERTED, ROLLED_BACK, "restore")
    for phase in (HANDOFF, WAITING):  # the version is pending: anything may still decide it
        # (a probe still running from before a reopened window answers in ``handoff``)
        add(phase, PROBE_PASSED, phase, "probe_ended", "note_probe", "decide")
        add(phase, PROBE_FAILED, phase, "probe_ended", "note_probe", "decide")
        add(phase, LIVE, phase, "note_live", "decide")
        add(phase, COMMIT_REQUEST, phase, "note_commit", "decide")
        add(phase, HEALTHY, phase, "note_health", "decide")
        add(phase, UNHEALTHY, phase, "note_health", "decide")
        add(phase, TICK, phase, "decide")
        add(phase, OPERATOR_ROLLBACK, ROLLING_BACK, "rollback")
        add(phase, SET_REVERTED, ROLLING_BACK, "rollback_unconfirmed")  # never judged
        add(phase, KEEP_WAITING, phase)
        add(phase, CONFIRMED, COMMITTED, "commit")
        add(phase, REFUSED, ROLLING_BACK, "rollback")
        add(phase, JOB_ENDED, ROLLING_BACK, "rollback_unconfirmed")
        add(phase, UNANSWERED, HANDOFF, "retry_handoff")
        add(phase, UNANSWERED_FINAL, ROLLING_BACK, "rollback_unconfirmed")
        # Not judged, and not handed off again over the adapter still switching.
        add(phase, UNANSWERED_SWITCHING, ROLLING_BACK, "rollback_unconfirmed")
    add(WAITING, PROBE_DUE, WAITING, "start_probe")
    add(HANDOFF, PROBE_DUE, HANDOFF)  # a probe waits for the switch
    # Rolling back: the outcome is settled; late answers change nothing.
    for event in (PROBE_PASSED, PROBE_FAILED):
        add(ROLLING_BACK, event, ROLLING_BACK, "probe_ended")
    add(ROLLING_BACK, LIVE, ROLLING_BACK, "note_live")  # its figures still go to meta.json
    for event in (HEALTHY, UNHEALTHY, TICK, PROBE_DUE, OPERATOR_ROLLBACK, SET_REVERTED):
        add(ROLLING_BACK, event, ROLLING_BACK)
    # After a restart (``resume`` / ``orphans``): what the journal says decides.
    add(RESUMED, LIVE, RESUMED, "note_live")  # its recorded end read back
    add(RESUMED, IN_WINDOW, HANDOFF, "start_handoff")
    add(RESUMED, REFUSED, ROLLING_BACK, "rollback")
    add(RESUMED, UNANSWERED, HANDOFF, "retry_handoff")
    add(RESUMED, UNANSWERED_FINAL, ROLLING_BACK, "rollback_unconfirmed")
    add(RESUMED, ORPHANED, ROLLING_BACK, "rollback")


_rows()


def step(phase: str, event: str) -> Transition:
    """The row for ``(phase, event)``. NoTransition for a pair with none."""
    row = TABLE.get((phase, event))
    if row is None:
        raise NoTransition("no transition from {} on {}".format(phase, event))
    return row


def accepts(phase: str, event: str) -> bool:
    return (phase, event) in TABLE


def verdict(phase: str, state: CommitState, now: float, job_alive: bool,
            handoff_running: bool, probe_failed: bool, retries_left: bool) -> Tuple[str, str]:
    """What a pending version's facts say now: (event, reason)."""
    if not job_alive:
        return JOB_ENDED, ""
    if phase == HANDOFF and state.failure is None and state.committed_by is None and \
            state.deadline > now:
        return KEEP_WAITING, ""  # the adapters' switch is still running
    decision = state.decide(now)
    if decision.action == WAIT:
        return KEEP_WAITING, ""
    if decision.action == COMMIT:
        return CONFIRMED, decision.reason
    if state.failure is not None or probe_failed:  # an answer, not silence
        return REFUSED, decision.reason
    if handoff_running:
        return UNANSWERED_SWITCHING, decision.reason
    return (UNANSWERED if retries_left else UNANSWERED_FINAL), decision.reason


def resumed_verdict(state: CommitState, now: float, rollback_reason: Optional[str],
                    retries_left: bool, timeout_s: float) -> Tuple[str, str]:
    """A version found pending after a restart (its live check's recorded end read back):
    (event, reason)."""
    if rollback_reason and state.deadline <= now:
        return REFUSED, rollback_reason  # a rollback the kill cut short
    if state.failure is not None:
        return REFUSED, state.failure  # its live check's recorded refusal
    if state.deadline <= now:
        return (UNANSWERED if retries_left else UNANSWERED_FINAL), \
            "no confirmation within {:g} s (the agent was down)".format(timeout_s)
    return IN_WINDOW, ""


def probe_due(state: CommitState, probe_running: bool, since_last: float,
              every_s: float) -> bool:
    """The probe runs again: needed, not yet passed, not running, ``every_s`` after the last."""
    return "probe" in state.need and "probe" not in state.confirmed and not probe_running \
        and since_last >= every_s

