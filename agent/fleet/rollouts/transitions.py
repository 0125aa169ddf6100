"""What a rollout does with a device's job status, as a transition table (Mender's daemon
state machine is the model: one ``add_transition`` row per (state, event)): where the device's
run is (``run.phase``: the job it is on, ``search`` or ``deploy``) and what the status says (an
event: its job and state, and whether the rollout is halted) -> where the run goes and the
named steps that take it there. ``Rollout.on_job_status`` first checks that the status is an
answer to a job it sent (guards, not transitions), then looks its row up here and runs the
steps in order; a pair with no row changes nothing. Pure: no I/O, the rollout's clock.

The steps are functions of (rollout, run, status, out): each changes the run (and the
rollout) and appends to ``out`` the ``Action``s the service carries out (publish a retained job
document, clear one, send a cancel command).
"""

from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from agent.wire import protocol


class Action(NamedTuple):
    kind: str  # "publish" (retained job document) | "clear" (empty retained) | "cancel"
    device: str
    job_id: str
    doc: Optional[Dict[str, Any]] = None


class Status(NamedTuple):
    """A job status accepted as an answer (``Rollout.on_job_status``'s guards passed)."""

    job_id: str
    state: str
    msg: Mapping[str, Any]
    evaluate: bool  # decide the stage now (False: the caller batches, ``Rollout.evaluate``)


# Where a device's run is: the job it is on (DeviceRun.phase).
SEARCHING, DEPLOYING = "search", "deploy"

# What a status says: its job (search or deploy) and its state.
SEARCH_RUNNING = "search running"  # QUEUED, IN_PROGRESS
SEARCH_SUCCEEDED = "search succeeded"
SEARCH_SUCCEEDED_HALTED = "search succeeded, rollout halted"
SEARCH_ENDED = "search ended"  # FAILED, REJECTED, CANCELED, TIMED_OUT
DEPLOY_RUNNING = "deploy running"
DEPLOY_SUCCEEDED = "deploy succeeded"
DEPLOY_ENDED = "deploy ended"


def event_of(search: bool, state: str, halted: bool) -> str:
    """The event a status is: ``search`` (its job is the rollout's search job), its ``state``,
    and whether the rollout is ``halted`` (a search that succeeded then gets no deploy)."""
    if state == "SUCCEEDED":
        if search:
            return SEARCH_SUCCEEDED_HALTED if halted else SEARCH_SUCCEEDED
        return DEPLOY_SUCCEEDED
    if protocol.is_terminal(state):
        return SEARCH_ENDED if search else DEPLOY_ENDED
    return SEARCH_RUNNING if search else DEPLOY_RUNNING


# -- the steps (each row names them) -------------------------------------------------------

# A step changes the run (and the rollout) and appends the Actions it asks for.
Step = Callable[[Any, Any, Status, List[Action]], None]


def _track(ro: Any, run: Any, st: Status, out: List[Action]) -> None:
    """Where the device is in its job: its stage, its progress, when it started."""
    terminal = protocol.is_terminal(st.state)
    if run.local and not terminal:
        # The device had picked the job up before the controller cancelled it.
        run.local = False
    # A finished job is past its last stage (a SUCCEEDED one reports "activating").
    run.job_stage = "" if terminal else str(st.msg.get("stage") or "")
    progress = st.msg.get("progress")
    run.progress = dict(progress) if isinstance(progress, dict) else None
    if run.started is None and st.state != "QUEUED":
        run.started = ro.clock()


def _take_state(ro: Any, run: Any, st: Status, out: List[Action]) -> None:
    run.state = st.state


def _end(ro: Any, run: Any, st: Status, out: List[Action]) -> None:
    """The device's own word ends the run: its result, or its error (and any result)."""
    run.finished = ro.clock()
    run.local = False
    if st.state == "SUCCEEDED":
        run.result = dict(st.msg.get("result") or {})
    else:
        run.error = dict(st.msg.get("error") or {"code": "internal_error",
                                                 "message": "no error in the status"})
        if st.msg.get("result"):
            run.result = dict(st.msg["result"])


def _clear_document(ro: Any, run: Any, st: Status, out: List[Action]) -> None:
    if st.job_id in run.published:
        out.append(Action("clear", run.device, st.job_id))


def _release_waiting(ro: Any, run: Any, st: Status, out: List[Action]) -> None:
    if ro.sharing is not None and run.share.get("role") == "builder":
        out += ro.release_waiting()  # its class's devices waited for its engine


def _evaluate(ro: Any, run: Any, st: Status, out: List[Action]) -> None:
    if st.evaluate:
        out += ro.decide()
    else:
        ro.pending_eval = True  # the caller batches statuses and calls evaluate() once


def _keep_search(ro: Any, run: Any, st: Status, out: List[Action]) -> None:
    """The search's answer (which layers to keep), its document cleared."""
    run.search = dict(st.msg.get("result") or {})
    out.append(Action("clear", run.device, st.job_id))


def _send_deploy(ro: Any, run: Any, st: Status, out: List[Action]) -> None:
    keep = run.search.get("keep") or []
    keep_precision = str(run.search.get("keep_precision") or "float32")
    out += ro.send_job(run, "deploy", {str(name): keep_precision for name in keep})
    run.state = "IN_PROGRESS"


def _adopt(ro: Any, run: Any, st: Status, out: List[Action]) -> None:
    out += ro.adopt_seen(run)


def _skip_deploy(ro: Any, run: Any, st: Status, out: List[Action]) -> None:
    run.state, run.local = "CANCELED", True
    run.note = "search done; deploy not sent: " + ro.reason
    run.finished = ro.clock()


STEPS: Dict[str, Step] = {
    "track": _track, "take_state": _take_state, "end": _end, "clear_document": _clear_document,
    "release_waiting": _release_waiting, "evaluate": _evaluate, "keep_search": _keep_search,
    "send_deploy": _send_deploy, "adopt": _adopt, "skip_deploy": _skip_deploy,
}


# -- the table --------------------------------------------------------------------------------

class Transition(NamedTuple):
    next: str  # the run's phase after the steps
    steps: Tuple[str, ...]
    calls: Tuple[Step, ...]  # the steps' functions, looked up once


TRANSITIONS: Dict[Tuple[str, str], Transition] = {}


def add_transition(state: str, event: str, next_state: str, *steps: str) -> None:
    assert (state, event) not in TRANSITIONS, (state, event)
    TRANSITIONS[(state, event)] = Transition(next_state, tuple(steps),
                                            tuple(STEPS[s] for s in steps))


# The ending of a job the device reports: recorded, its document cleared, builders' classes
# released (engine sharing), the stage decided.
_ENDED = ("take_state", "end", "clear_document", "release_waiting", "evaluate")

add_transition(SEARCHING, SEARCH_RUNNING, SEARCHING, "track", "take_state")
add_transition(SEARCHING, SEARCH_SUCCEEDED, DEPLOYING,
               "track", "keep_search", "send_deploy", "adopt")
add_transition(SEARCHING, SEARCH_SUCCEEDED_HALTED, SEARCHING,
               "track", "keep_search", "skip_deploy")
add_transition(SEARCHING, SEARCH_ENDED, SEARCHING, "track", *_ENDED)
# The search is over for a device deploying: a late search status changes nothing.
for _event in (SEARCH_RUNNING, SEARCH_SUCCEEDED, SEARCH_SUCCEEDED_HALTED, SEARCH_ENDED):
    add_transition(DEPLOYING, _event, DEPLOYING)
add_transition(DEPLOYING, DEPLOY_RUNNING, DEPLOYING, "track", "take_state")
add_transition(DEPLOYING, DEPLOY_SUCCEEDED, DEPLOYING, "track", *_ENDED)
add_transition(DEPLOYING, DEPLOY_ENDED, DEPLOYING, "track", *_ENDED)
# (A searching device has no deploy job yet: its statuses are refused before the table.)


def transition(phase: str, event: str) -> Optional[Transition]:
    return TRANSITIONS.get((phase, event))


def apply(ro: Any, run: Any, event: str, st: Status) -> List[Action]:
    """Run the steps of (``run.phase``, ``event``)'s row; no row: nothing changes."""
    row = TRANSITIONS.get((run.phase, event))
    out: List[Action] = []
    if row is not None:
        for step in row.calls:
            step(ro, run, st, out)
    return out
