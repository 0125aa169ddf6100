"""``Rollout``: the staged rollout state machine, fed job statuses, answering with
``Action``s (publish a retained job document, clear one, send a cancel command); with a
precision search each device runs a ``search`` job, then a ``deploy`` job that keeps the layers
the search found. What a job status does is a row of the transition table
(``agent.fleet.rollouts.transitions``); the stage and abort decisions are ``policy``'s. Pure: no
I/O, the clock is injected.
"""

import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from agent.errors import AgentError
from agent.fleet.rollouts import transitions
from agent.fleet.rollouts.device_run import PENDING, DeviceRun
from agent.fleet.rollouts.doc_parts import Parts
from agent.fleet.rollouts.documents import layers_above
from agent.fleet.rollouts.policy import (
    Policy,
    abort_reason,
    check_policy,
    failure_cause,
    stage_verdict,
)
from agent.fleet.rollouts.transitions import Action
from agent.wire import protocol

SEARCH_SUFFIX = ".search"
MAX_ROLLOUT_ID = 64 - len(SEARCH_SUFFIX)
# A device's job status versions grow by one per change; a jump larger than this is not an
# answer from the device (a forged version near 2**53 would silence it for good).
MAX_VERSION_STEP = 100000
_STATES = {s: s for s in protocol.STATES}
FIRST_BATCH = 200  # documents a stage's start builds; the rest come through Rollout.more(n)


# ============================================================================ the rollout

DocFactory = Callable[..., Dict[str, Any]]
# doc_factory(device, job_id, kind, layer_precisions or None[, share=...]) -> job document;
# share (engine sharing): {"offer": True} or {"engine": artifact reference}


def check_rollout_id(rollout_id: str) -> str:
    if len(rollout_id) > MAX_ROLLOUT_ID or not protocol.valid_id(rollout_id):
        raise AgentError("bad_argument", "rollout id must be 1-{} characters of "
                         "[A-Za-z0-9._-] starting with a letter or digit, found {!r}"
                         .format(MAX_ROLLOUT_ID, rollout_id))
    return rollout_id


class Rollout(object):
    """The staged rollout of one model. Feed it job statuses (``on_job_status``); it returns
    the actions to carry out. Pure: no clock reads beyond the injected one, no I/O."""

    def __init__(self, rollout_id: str, stages: Sequence[Sequence[str]], docs: DocFactory,
                 policy: Optional[Policy] = None, search: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rollout_id = check_rollout_id(rollout_id)
        self.deploy_id = rollout_id
        self.search_id = rollout_id + SEARCH_SUFFIX if search else None
        # Device names interned: the service's other tables key on the same strings.
        self.stages = [[sys.intern(str(d)) for d in s] for s in stages]
        self.docs = docs
        self.policy = check_policy(policy or Policy())
        self.clock = clock
        self.runs: Dict[str, DeviceRun] = {}
        for i, stage in enumerate(self.stages):
            for dev in stage:
                if dev in self.runs:
                    raise AgentError("bad_argument", "device {} is in two stages".format(dev))
                self.runs[dev] = DeviceRun(dev, i)
        self.current = -1  # index of the last stage started
        self.halted = False
        self.paused = False  # a passed stage does not start the next while paused
        self.dirty: set = set()  # devices changed since the last save (rollouts.durable)
        self.history: List[Tuple[str, str, int, str, str, Any]] = []  # accepted statuses
        self.refused = 0  # statuses dropped as no answer to a job we sent
        self.pending_eval = False
        self.outcome = ""  # "" while running; then succeeded | aborted | halted | ...
        self.gate: Optional[Dict[str, Any]] = None  # preview.gate_of(spec), for the report
        self.reason = ""
        self.started = clock()
        self.sharing: Any = None  # an agent.fleet.transfer.sharing.SharePolicy: engines built once
        # Streaming a stage: its documents are built ``more(n)`` at a time (the service sends
        # each batch as it is committed); ``cursor`` is the index in the current stage of the
        # first device not looked at yet. Devices still PENDING in the current stage are
        # exactly those not sent, so a restart rebuilds it from the database (cursor 0).
        self.cursor = 0
        self.parts = Parts()  # the documents' common parts, held once (rollouts.doc_parts)
        self.first_batch = FIRST_BATCH  # documents built by the stage's start itself

    # -- queries ------------------------------------------------------------------------------

    @property
    def job_ids(self) -> List[str]:
        return [j for j in (self.search_id, self.deploy_id) if j]

    @property
    def done(self) -> bool:
        # From the last device sent: while a large stage runs, the first one looked at is
        # unfinished (asked after every batch of statuses saved).
        return all(r.terminal for r in reversed(self.runs.values()))

    @property
    def succeeded(self) -> bool:
        return self.done and all(r.state == "SUCCEEDED" for r in self.runs.values())

    def ordered(self) -> List[DeviceRun]:
        return [self.runs[d] for stage in self.stages for d in stage]

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for r in self.runs.values():
            out[r.state] = out.get(r.state, 0) + 1
        return out

    def final_outcome(self) -> str:
        if self.outcome:
            return self.outcome
        if not self.done:
            return "running"
        return "succeeded" if self.succeeded else "failed"

    # -- events -------------------------------------------------------------------------------

    def start(self) -> List[Action]:
        return self._start_stage(0)

    def on_job_status(self, device: str, msg: Mapping[str, Any], evaluate: bool = True
                      ) -> List[Action]:
        """A decoded job status message from ``device`` (the topic's device). Only an answer
        to a job this rollout sent is accepted (``_answer``); what it changes is the row of
        the transition table for where the device's run is and what the status says
        (``agent.fleet.rollouts.transitions``)."""
        run = self.runs.get(device)
        job_id = msg.get("job_id")
        if run is None or job_id not in self.job_ids or not self._answer(run, device, msg):
            return []
        state = str(msg.get("state"))
        state = _STATES.get(state, state)  # one shared copy, not one a run
        event = transitions.event_of(job_id == self.search_id, state, self.halted)
        return transitions.apply(self, run, event,
                                 transitions.Status(str(job_id), state, msg, evaluate))

    def _answer(self, run: DeviceRun, device: str, msg: Mapping[str, Any]) -> bool:
        """Is this status an answer to a job we sent: the right device, job id and kind, a
        version above the last one and not absurdly far above it, nothing after a terminal
        state. An answer is recorded (its version, the history)."""
        job_id = str(msg.get("job_id"))
        if msg.get("device") not in (None, device):
            self.refused += 1
            return False
        version = int(msg.get("version") or 0)
        last = run.versions.get(job_id, 0)
        if version <= last:
            return False  # a resend after a reconnect, or an older retained copy
        if run.state == PENDING or job_id not in run.kinds:
            # Not sent yet. Before the rollout sent anything, this is a status retained from
            # an earlier run of the id: remember it (the device will take our document as a
            # duplicate and keep that state). Later, nothing can be an answer yet.
            if self.current < 0 and version > int(
                    (run.seen.get(job_id) or {}).get("version") or 0):
                run.seen[job_id] = dict(msg)
                self.dirty.add(device)
            return False
        kind = str(msg.get("kind") or "")
        if (last and version > last + MAX_VERSION_STEP) or (
                kind and kind != run.kinds.get(job_id)) or (
                run.terminal and run.phase == run.kinds.get(job_id) and
                job_id == run.job_id and not run.local):
            self.refused += 1
            return False
        run.versions[job_id] = version
        self.dirty.add(device)
        self.history.append((device, job_id, version, str(msg.get("state")),
                             str(msg.get("stage") or ""), msg.get("ts")))
        return True

    def evaluate(self) -> List[Action]:
        """The stage and abort decisions owed since ``on_job_status(..., evaluate=False)``."""
        if not self.pending_eval:
            return []
        self.pending_eval = False
        return self.decide()

    def _cancel_unstarted(self, run: "DeviceRun", reason: str) -> None:
        # Nothing was sent to this device: cancel it locally.
        run.state, run.local = "CANCELED", True
        run.note = "not started: " + reason
        run.finished = self.clock()
        self.dirty.add(run.device)

    def halt(self, reason: str, outcome: str = "halted") -> List[Action]:
        """Stop the rollout: devices not started are cancelled; running ones finish."""
        if self.halted:
            return []
        self.halted, self.outcome, self.reason = True, outcome, reason
        actions: List[Action] = []
        for run in self.ordered():
            if run.state == PENDING:
                self._cancel_unstarted(run, reason)
            elif run.state == "QUEUED":
                actions += self._cancel(run, "CANCELED", "cancelled while queued: " + reason)
        return actions

    def expire(self, reason: str, state: str = "TIMED_OUT", outcome: str = "timed_out"
               ) -> List[Action]:
        """Give up on every unfinished device (controller timeout, interrupt): cancel what
        was sent, and mark it ``state``."""
        self.halted, self.outcome, self.reason = True, outcome, reason
        actions: List[Action] = []
        for run in self.ordered():
            if run.state == PENDING:
                self._cancel_unstarted(run, reason)
            elif not run.terminal:
                actions += self._cancel(run, state, reason)
        return actions

    # -- internals ----------------------------------------------------------------------------

    def _start_stage(self, index: int) -> List[Action]:
        """Start a stage: with engine sharing every device is decided now (the classes'
        builders first); else the first ``first_batch`` documents, the rest by ``more``."""
        self.current, self.cursor = index, 0
        if self.sharing is None:
            return self.more(self.first_batch)
        actions: List[Action] = []
        for dev in self.sharing.order(self.stages[index]):
            run = self.runs[dev]
            how, ref = self.sharing.decide(run, self.ordered(), self.clock())
            if how == "wait":
                self.dirty.add(dev)
                continue
            share = {"offer": True} if how == "offer" else \
                {"engine": ref} if how == "engine" else None
            actions += self.send_job(run, "deploy", None, share)
            run.state = "QUEUED"
            actions += self.adopt_seen(run)
        self.cursor = len(self.stages[index])
        return actions

    def resume_stream(self) -> None:
        """After loading: the current stage's documents went out in stage order, so ``more``
        resumes at its first device still PENDING; the stage and abort decisions are owed
        (the last run may have stopped between a batch of statuses and its decision)."""
        if self.current < 0:
            return
        stage = self.stages[self.current]
        self.cursor = next((i for i, d in enumerate(stage) if self.runs[d].state == PENDING),
                           len(stage))
        self.pending_eval = True

    @property
    def unsent(self) -> int:
        """Devices of the current stage whose documents ``more`` has not built yet (at most;
        some may have been cancelled since)."""
        if self.current < 0 or self.halted or self.sharing is not None:
            return 0
        return max(0, len(self.stages[self.current]) - self.cursor)

    def more(self, limit: int) -> List[Action]:
        """The documents of up to ``limit`` more devices of the current stage (streaming a
        stage: the caller commits and publishes each batch before asking for the next)."""
        if self.current < 0 or self.halted or self.sharing is not None:
            return []
        stage = self.stages[self.current]
        actions: List[Action] = []
        sent = 0
        while self.cursor < len(stage) and sent < limit:
            run = self.runs[stage[self.cursor]]
            self.cursor += 1
            if run.state != PENDING:
                continue  # sent before a restart, or cancelled since
            actions += self.send_job(run, "search" if self.search_id else "deploy", None)
            run.state = "QUEUED"
            current = self.current
            actions += self.adopt_seen(run)
            sent += 1
            if self.current != current:
                return actions  # an adopted answer ended the stage: the next one started
        if self.cursor >= len(stage):
            self.pending_eval = True  # the stage may pass now that all of it was sent
        return actions

    def release_waiting(self) -> List[Action]:
        """Engine sharing: send the devices that waited for their class's engine (it came,
        its builder ended without one, or the wait timed out). Called by the service's tick
        and when a builder ends."""
        if self.sharing is None or self.halted:
            return []
        actions: List[Action] = []
        for run, ref, note in self.sharing.released(self.ordered(), self.clock()):
            actions += self.send_job(run, "deploy", None, {"engine": ref} if ref else None)
            run.state = "QUEUED"
            run.note = note
            actions += self.adopt_seen(run)
        return actions

    def engine_offered(self, device: str, ref: Dict[str, Any]) -> None:
        """The engine ``device`` (a builder) uploaded: its class's waiting devices get it
        once the builder SUCCEEDED."""
        run = self.runs.get(device)
        if run is not None and run.share.get("role") == "builder":
            # Kept until the builder's own signed report says which upload is its engine.
            offers = list(run.share.get("offers") or [])
            if len(offers) < sharing_max_offers():
                run.share["offers"] = offers + [dict(ref)]
            self.dirty.add(device)

    def adopt_seen(self, run: DeviceRun) -> List[Action]:
        """The device already ended this job id (an earlier run of the rollout id): it will
        ignore the document as a duplicate, so its retained status is the true answer."""
        seen = run.seen.pop(run.job_id, None)
        if not seen or not protocol.is_terminal(str(seen.get("state"))):
            return []
        run.note = "the device had already run job {} (status version {})".format(
            run.job_id, seen.get("version"))
        return self.on_job_status(run.device, seen)

    def set_paused(self, paused: bool) -> List[Action]:
        """Pause (no next stage starts; running devices go on) or resume."""
        self.paused = bool(paused)
        return [] if self.paused else self.decide()

    def send_job(self, run: DeviceRun, kind: str, layers: Optional[Dict[str, str]],
              share: Optional[Dict[str, Any]] = None) -> List[Action]:
        job_id = self.search_id if kind == "search" else self.deploy_id
        assert job_id is not None
        doc = self.parts.share(self.docs(run.device, job_id, kind, layers,
                                         **({"share": share} if share else {})))
        if kind == "deploy":
            plan = doc.get("plan") or {}
            run.sent_layers = layers_above(plan.get("layer_precisions") or {},
                                           str(plan.get("precision")))
        run.phase, run.job_id = kind, job_id
        run.job_stage, run.progress = "", None
        run.published.append(job_id)
        run.kinds[job_id] = kind
        run.docs = {job_id: doc}
        self.dirty.add(run.device)
        return [Action("publish", run.device, job_id, doc)]

    def _cancel(self, run: DeviceRun, state: str, note: str) -> List[Action]:
        actions = [Action("cancel", run.device, run.job_id)]
        actions += [Action("clear", run.device, j) for j in run.published]
        run.state, run.local, run.note = state, True, note
        run.finished = self.clock()
        self.dirty.add(run.device)
        return actions

    def decide(self) -> List[Action]:
        if self.halted:
            return []
        reason = abort_reason((r.state for r in self.runs.values() if not r.local),
                              self.policy)
        if reason:
            cause = failure_cause(self.ordered())
            return self.halt(reason + ("; failed: " + cause if cause else ""), "aborted")
        stage = [self.runs[d] for d in self.stages[self.current]]
        verdict = stage_verdict([r.state for r in stage], self.policy)
        if verdict == "failed":
            ok = sum(1 for r in stage if r.state == "SUCCEEDED")
            cause = failure_cause(stage)
            return self.halt("stage {} halted by {}: {} of {} device(s) succeeded, below the "
                             "success threshold {:.0%}".format(
                                 self.current + 1, cause or "failures", ok, len(stage),
                                 self.policy.success_threshold))
        if verdict == "passed" and self.current + 1 < len(self.stages) and not self.paused \
                and not self.unsent:  # a stage passes only once all of it was sent
            return self._start_stage(self.current + 1)
        return []

    def mark_cleared(self, device: str, job_id: str) -> None:
        run = self.runs.get(device)
        if run is not None and job_id in run.published:
            run.published.remove(job_id)
            run.docs.pop(job_id, None)
            self.dirty.add(device)


def sharing_max_offers() -> int:
    from agent.fleet.transfer.sharing import MAX_OFFERS

    return MAX_OFFERS
