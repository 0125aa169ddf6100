"""``Rereader``: the retained statuses of jobs unchanged for a while asked for again (their
status may have been dropped by the broker's queue on its way here), a bounded round every
``JOB_REREAD_EVERY_S``; which jobs and when is ``agent.fleet.rollouts.reread.Reread``'s
(pure), the subscriptions are this part's.
"""

import logging
import time
from typing import Any, Dict, List, Mapping

from agent.fleet.rollouts.reread import Reread
from agent.fleet.rollouts.rollout import Rollout

log = logging.getLogger("agent.fleet")

JOB_REREAD_EVERY_S = 1.0  # a round of job statuses read again


class Rereader(object):
    def __init__(self, conn: Any, stats: Dict[str, int]) -> None:
        self.conn = conn
        self.topics = conn.topics
        self.stats = stats
        # Jobs whose status never came: their retained statuses are read again.
        self.reread = Reread()
        self.filters: List[str] = []
        self.last = 0.0

    def heard(self, rollout_id: str, device: str) -> None:
        self.reread.heard(rollout_id, device, time.monotonic())

    def forget(self, rollout_id: str) -> None:
        self.reread.forget(rollout_id)

    def due(self, rollouts: Mapping[str, Rollout]) -> None:
        """A round, every JOB_REREAD_EVERY_S s or at the next tick once the last one was
        answered (the queue has room again); the last round's exact subscriptions end first."""
        mono = time.monotonic()
        if mono - self.last < JOB_REREAD_EVERY_S and not (
                self.filters and self.reread.answered()):
            return  # (the last round answered: the next goes at this tick)
        self.last = mono
        for f in self.filters:
            self.conn.client.unsubscribe(f)
        self.filters = []
        for rid, ro in list(rollouts.items()):
            if ro.unsent:
                self.reread.sending(rid, mono)
            room = min(self.reread.room(rid, mono), self.reread.batch - len(self.filters))
            if ro.done or room <= 0:
                continue
            due = self.reread.due(rid, ro.runs.values(), mono, room)
            if not due:
                continue
            quiet = self.reread.quiet(rid, mono)
            log.warning("rollout %s: %d job(s) with no new status for %.0f s or more%s: "
                        "reading the devices' retained statuses again (attempt %d of at most "
                        "%d; the broker's queue may have dropped them)", rid, len(due),
                        self.reread.wait(quiet, 0), ", the rollout quiet for {:.0f} s".format(
                            self.reread.quiet_s) if quiet else "",
                        max(a for _d, _j, a in due), self.reread.attempts)
            self.stats["reread"] += len(due)
            for device, job_id, _attempt in due:
                self.filters.append(self.topics.job_status(device, job_id))
        if self.filters:
            self.conn.subscribe(self.filters)
