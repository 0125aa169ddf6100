"""``RolloutDriver``: the rollouts this process holds a lease on, driven. Job statuses are fed
to their rollout in batches (one transaction per rollout for what a batch changed); a stage's
documents are streamed as the broker's acknowledgements and the devices' answers allow
(``agent.fleet.rollouts.streaming``); the stage and abort decisions are made at most every
``EVALUATE_EVERY_S`` per rollout; each tick applies an operator's control (pause, resume,
cancel) and the rollout's deadline. What it decides is committed through the ``commit`` it was
given (``outbox.Publisher``).
"""

import logging
import time
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

from agent.fleet.rollouts import durable, streaming
from agent.fleet.rollouts.rollout import Action, Rollout
from agent.wire import protocol
from agent.wire.topics import TopicInfo

log = logging.getLogger("agent.fleet")

Commit = Callable[..., None]  # (rollout, actions=(), extra=None, more=()): outbox.Publisher


class RolloutDriver(object):
    def __init__(self, store: Any, topics: Any, stats: Dict[str, int], commit: Commit,
                 backlog: Callable[[], int],
                 take_offers: Callable[[Mapping[str, Rollout]], None],
                 job_ended: Callable[[str, str, Dict[str, Any]], None],
                 dropped: Sequence[Callable[[str], None]],
                 heard: Callable[[str, str], None]) -> None:
        self.store = store
        self.topics = topics
        self.stats = stats
        self.commit = commit
        self.backlog = backlog  # messages the broker has not acknowledged yet
        self.take_offers = take_offers  # engines builders uploaded (engine sharing)
        self.job_ended = job_ended  # (rollout, device, status): the deployments' part
        self.dropped = dropped  # told of each rollout let go
        self.heard = heard  # (rollout, device): a status came (the re-read's quiet clock)
        self.rollouts: Dict[str, Rollout] = {}
        self.by_job: Dict[str, str] = {}  # job id -> rollout id
        # Documents streamed whose devices have not answered yet (the statuses waiting to be
        # read are the service's backlog: beyond a bound, no more documents are built).
        self.unanswered = streaming.Unanswered()
        self.evaluated: Dict[str, float] = {}  # rollout -> when its decisions were last made
        # rollout id -> (actions, messages) from statuses not yet committed
        self.pending: Dict[str, Tuple[List[Any], List[durable.Message]]] = {}

    def hold(self, ro: Rollout) -> None:
        self.rollouts[ro.rollout_id] = ro
        for job_id in ro.job_ids:
            self.by_job[job_id] = ro.rollout_id

    def holds(self, rollout_id: str) -> bool:
        return rollout_id in self.rollouts

    def drop(self, rollout_id: str) -> None:
        for tell in self.dropped:
            tell(rollout_id)
        ro = self.rollouts.pop(rollout_id, None)
        self.evaluated.pop(rollout_id, None)
        if ro is not None:
            for job_id in ro.job_ids:
                self.by_job.pop(job_id, None)

    def on_job_status(self, info: TopicInfo, msg: Dict[str, Any]) -> None:
        device = info.device
        self.stats["statuses"] += 1
        self.unanswered.answered(device, str(msg.get("job_id")))
        self.take_offers(self.rollouts)  # a builder's upload ends before its SUCCEEDED status
        rid = self.by_job.get(str(msg.get("job_id")))
        ro = self.rollouts.get(rid) if rid else None
        if ro is None or device not in ro.runs:
            return
        run = ro.runs[device]
        self.heard(ro.rollout_id, device)
        refused = ro.refused
        actions, more = self.pending.setdefault(ro.rollout_id, ([], []))
        actions += ro.on_job_status(device, msg, evaluate=False)
        self.stats["refused"] += ro.refused - refused
        self.job_ended(ro.rollout_id, device, msg)
        if protocol.is_terminal(str(msg.get("state"))) and msg.get("job_id") in run.kinds:
            # The database has it now: the broker need not keep the device's last word.
            more.append((self.topics.job_status(device, str(msg["job_id"])), b"", True))

    def evaluate(self, ro: Rollout, force: bool = False) -> List[Action]:
        """The stage and abort decisions owed, at most every EVALUATE_EVERY_S per rollout (they
        look at every device: once per batch of statuses was 7 % of a 50,000-device stage's
        CPU); the tick takes what is still owed (``force``)."""
        now = time.monotonic()
        if not ro.pending_eval or not force and now - self.evaluated.get(ro.rollout_id, 0.0) < \
                streaming.EVALUATE_EVERY_S:
            return []
        self.evaluated[ro.rollout_id] = now
        return ro.evaluate()

    def commit_pending(self) -> None:
        """One transaction per rollout for everything a batch of statuses changed."""
        pending, self.pending = self.pending, {}
        for rid, (actions, more) in pending.items():
            ro = self.rollouts.get(rid)
            if ro is None:
                continue
            actions += self.evaluate(ro)
            if actions or more or ro.dirty or ro.history:
                self.commit(ro, actions, more=more)

    def forget_pending(self, rollout_id: str) -> None:
        self.pending.pop(rollout_id, None)

    def stream(self) -> int:
        """The next batch of each streaming stage's documents (agent.fleet.rollouts.streaming):
        built, saved in one transaction, published, as many as the broker's acknowledgements
        and the devices' answers allow. Returns the documents still owed."""
        now = time.monotonic()
        quota = min(streaming.doc_quota(self.backlog()), self.unanswered.quota(now))
        owed = [ro for ro in self.rollouts.values() if ro.unsent]
        for i, ro in enumerate(owed):
            n = streaming.split(quota, ro.unsent, len(owed) - i - 1)
            if n <= 0:
                break
            actions = ro.more(n)
            for a in actions:
                if a.kind == "publish":
                    quota -= 1
                    self.unanswered.sent(a.device, a.job_id, now)
            actions += self.evaluate(ro)
            self.commit(ro, actions)
        return sum(ro.unsent for ro in owed)

    def tick(self, now: float) -> None:
        """Decisions still owed, engine waits, an operator's control, the deadline (``now``:
        the wall clock); finished rollouts let go."""
        rows = self.store.rollout_states(self.rollouts)  # control and deadline: a few columns
        for rid, ro in list(self.rollouts.items()):
            if ro.pending_eval:  # decisions the last batches left owed
                self.commit(ro, self.evaluate(ro, force=True))
            if rid not in self.rollouts:
                continue  # its lease went (the commit said so)
            if ro.sharing is not None:  # waits that timed out; engines that came
                actions = ro.release_waiting()
                if actions or ro.dirty:
                    self.commit(ro, actions)
            row = rows.get(rid) or {}
            control = row.get("control")
            if control:
                self.control(ro, control)
            elif not ro.done and row.get("deadline") and now >= row["deadline"]:
                self.commit(ro, ro.expire("the rollout did not finish by its deadline ({:.0f} s"
                                          " after it was created)".format(
                                              row["deadline"] - row["created"])))
            if ro.done:
                self.drop(rid)

    def control(self, ro: Rollout, control: str) -> None:
        if control == "pause":
            actions = ro.set_paused(True)
        elif control == "resume":
            actions = ro.set_paused(False)
        else:
            actions = ro.expire("cancelled by the operator (fleet rollouts cancel)",
                                state="CANCELED", outcome="cancelled")
        log.info("rollout %s: %s", ro.rollout_id, control)
        self.commit(ro, actions, extra={"control": None})
