"""A ``Rollout`` kept in the ``Store``: ``load`` rebuilds one from its rows (after a restart,
or read-only for ``fleet rollouts show`` and attached progress), ``save`` writes what changed
together with the messages its actions publish (the outbox), in one transaction: a crash at
any point leaves the state and the messages still owed to the broker consistent.

Also ``DbSequence``: the signer's sequence numbers kept in the database, reserved a block at a
time (one write per thousand job documents, not one fsync per document).
"""

import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

from agent.fleet.database.store import Store
from agent.fleet.rollouts.device_run import PENDING, DeviceRun
from agent.fleet.rollouts.preview import gate_of
from agent.fleet.rollouts.rollout import Action, DocFactory, Rollout
from agent.fleet.rollouts.spec import doc_factory, policy_of
from agent.wire import protocol
from agent.wire.topics import Topics

FINAL_STATE = {"succeeded": "succeeded", "failed": "failed", "aborted": "aborted",
               "halted": "halted", "timed_out": "timed_out", "interrupted": "cancelled",
               "cancelled": "cancelled"}
Message = Tuple[str, bytes, bool]  # topic, payload, retain


def _no_docs(device: str, job_id: str, kind: str, layers: Optional[Dict[str, str]],
             share: Any = None) -> Dict[str, Any]:
    raise RuntimeError("a read-only rollout sends nothing")


def load(store: Store, rollout_id: str, docs: Optional[DocFactory] = None
         ) -> Optional[Rollout]:
    """The rollout as stored; ``docs`` None: read-only (for views and reports)."""
    row = store.rollout(rollout_id)
    if row is None:
        return None
    spec = row["spec"] or {}
    ro = Rollout(rollout_id, row["stages"], docs or _no_docs, policy_of(spec),
                 bool(spec.get("search")), clock=time.time)
    ro.started = row["created"] or ro.started
    ro.gate = gate_of(spec)
    ro.current = int(row["current_stage"] if row["current_stage"] is not None else -1)
    ro.halted, ro.paused = bool(row["halted"]), bool(row["paused"])
    ro.outcome = row["outcome"] if row["outcome"] not in (None, "running", "succeeded",
                                                          "failed") else ""
    ro.reason = row["reason"] or ""
    for device, state, data in store.rollout_job_states(rollout_id):
        run = ro.runs.get(device)
        if run is not None:
            run.load(state, data or {})
            if docs is not None:  # driven by a service (not a view reloaded every 0.5 s)
                _maybe_freeze(run)
    ro.resume_stream()
    ro.dirty.clear()
    return ro


def messages(topics: Topics, ro: Rollout, actions: Sequence[Action]) -> List[Message]:
    """What the actions publish. Clearing a job document also clears the device's retained
    status of a finished job (the database keeps it): the broker holds nothing for it."""
    out: List[Message] = []
    for a in actions:
        if a.kind == "publish":
            out.append((topics.job(a.device, a.job_id), protocol.encode(a.doc or {}), True))
        elif a.kind == "clear":
            out.append((topics.job(a.device, a.job_id), b"", True))
            ro.mark_cleared(a.device, a.job_id)
        elif a.kind == "cancel":
            out.append((topics.commands(a.device), protocol.encode({
                "protocol": protocol.PROTOCOL_VERSION, "command": "cancel",
                "request_id": "c" + uuid.uuid4().hex[:10], "job_id": a.job_id}), False))
    return out


def state_of(ro: Rollout) -> str:
    if ro.done:
        return FINAL_STATE.get(ro.final_outcome(), ro.final_outcome())
    return "paused" if ro.paused else "running"


def save(store: Store, ro: Rollout, out: Sequence[Message] = (),
         extra: Optional[Dict[str, Any]] = None, fence: Any = None) -> List[int]:
    """Write the rollout row, the devices changed since the last save, the statuses accepted
    and the messages to publish; returns their outbox ids. ``fence``: as
    ``Store.save_rollout``'s (agent.fleet.database.leases.LeaseLost: nothing was written)."""
    state = state_of(ro)
    fields: Dict[str, Any] = {"current_stage": ro.current, "halted": int(ro.halted),
                              "paused": int(ro.paused), "outcome": ro.final_outcome(),
                              "reason": ro.reason or None, "state": state}
    if ro.done:
        fields["finished"] = time.time()
    fields.update(extra or {})
    jobs = {d: (ro.runs[d].stage, ro.runs[d].state, ro.runs[d].to_dict())
            for d in sorted(ro.dirty) if d in ro.runs}
    history = [(ro.rollout_id,) + tuple(h) for h in ro.history]
    ids = store.save_rollout(ro.rollout_id, fields, jobs, history, out, fence=fence)
    for d in jobs:
        _maybe_freeze(ro.runs[d])
    ro.dirty.clear()
    ro.history = []
    return ids


def _maybe_freeze(run: DeviceRun) -> None:
    """A finished run with nothing left at the broker is saved as it is: its seldom read
    fields may wait as text (``DeviceRun.freeze``)."""
    if run.terminal and not run.published:
        run.freeze()


def republish(topics: Topics, ro: Rollout) -> List[Message]:
    """The retained documents of unfinished jobs, published again when a service takes the
    rollout over (a broker that lost its retained messages still gets them)."""
    out: List[Message] = []
    for run in ro.ordered():
        if run.terminal or run.state == PENDING:
            continue  # (a run not sent holds nothing: not read, not thawed)
        for job_id in run.published:
            doc = run.docs.get(job_id)
            if doc:
                out.append((topics.job(run.device, job_id), protocol.encode(doc), True))
    return out


def factory_for(store: Store, rollout_id: str, signer: Any = None,
                url_for: Any = None, offer_url: Any = None, features: Any = None
                ) -> DocFactory:
    """``features``: device -> the features its status lists (the model's name and version
    go only to devices with ``named_models``); None: read from the database's statuses."""
    row = store.rollout(rollout_id)
    assert row is not None
    if features is None:
        from agent.fleet.database.device_models import features as features_of

        statuses = store.statuses()
        features = lambda device: features_of(statuses.get(device))  # noqa: E731
    docs = doc_factory(row["spec"] or {}, url_for, offer_url, features)
    if signer is None:
        return docs
    deadline = float(row.get("deadline") or 0)

    def signed(device: str, job_id: str, kind: str, layers: Optional[Dict[str, str]],
               share: Any = None) -> Dict[str, Any]:
        # Valid until the rollout's own deadline at least: a device offline for days still
        # runs its job when it returns (the signer's --valid-for is the floor).
        from agent.wire.job_signer import sign_document

        now = signer.clock()
        seq = signer.sequence.next(signer.key_id, int(now * 1000))
        return sign_document(docs(device, job_id, kind, layers, share), signer.private_key,
                             seq, now, max(now + signer.validity_s, deadline),
                             kid=signer.key_id, shallow=True)

    return signed


class DbSequence(object):
    """``job_signer.SequenceFile``'s interface over the database: numbers are reserved
    ``block`` at a time; within a block they are handed out from memory. ``mirror``: a
    ``SequenceFile`` kept at or above every reserved number (a one-off embedded rollout on a
    throw-away database still never goes below what the devices accepted)."""

    def __init__(self, store: Store, block: int = 1000, mirror: Any = None) -> None:
        self.store = store
        self.block = max(1, int(block))
        self.mirror = mirror
        self._next: Dict[str, int] = {}
        self._last: Dict[str, int] = {}

    def last(self, kid: str) -> int:
        if kid not in self._next and self.mirror is not None:
            return int(self.mirror.last(kid))
        return self._next.get(kid, 1) - 1

    def next(self, kid: str, floor: int = 0) -> int:
        nxt = self._next.get(kid)
        if nxt is None or nxt > self._last.get(kid, 0):
            if self.mirror is not None:
                floor = max(floor, int(self.mirror.last(kid)) + 1)
            first, last = self.store.reserve_sequence(kid, self.block, floor)
            if self.mirror is not None:
                self.mirror.next(kid, last)
            nxt, self._last[kid] = first, last
        self._next[kid] = nxt + 1
        return nxt
