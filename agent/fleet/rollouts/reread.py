"""``Reread``: which jobs to ask the broker about again because their status never came.

A device's job status is retained at the broker (``{p}/devices/{d}/jobs/{job}/status``), but
the copy sent to the controller passes its session queue, where Mosquitto drops what does not
fit (``max_queued_messages``): a device whose SUCCEEDED was dropped would sit QUEUED or
IN_PROGRESS until its stage timed it out, although the broker holds its answer. An exact
subscription to the status topic brings the retained copy back.

When to ask depends on the rollout's traffic. While its statuses still flow (a stage being
streamed), the broker's queue is the scarce thing: a run is read again after ``after_s`` s
without a change, ``busy_batch`` a round, rounds ``busy_every_s`` apart. Once its documents are
sent (``sending``) and no status of it has come for ``quiet_s`` s, the burst is over, and what
is still QUEUED past ``quick_s`` s (a device starts a job within a second, unless busy with a
local one: it is in one rollout at a time), or still unfinished once at least half of the sent
jobs are final (behind its peers, where a fleet-wide build that reports nothing for minutes is
not), is most likely an answer the queue dropped: rounds of ``batch`` (what the shipped queue
holds, 1000 + 100 in flight, with the connection otherwise quiet) every round the service runs,
so 3,700 lost statuses are back within seconds, not minutes. The answers to a round do not
count as traffic (a status of a device the last round asked about), or each round would end the
quiet; any other status does (a stream that paused under load and goes on). A run's waits
double with each attempt (a long build reports no new state for minutes) up to ``max_wait_s``,
at most ``attempts`` per state and job stage.

Exact subscriptions rather than one wildcard per job (``{p}/devices/+/jobs/{job}/status``):
a wildcard's retained burst is as large as the number of unfinished devices, which the broker
cuts at its queue without telling anyone, and its copies of running devices' IN_PROGRESS take
the same room every time; a round of exact filters is bounded by construction. Pure
bookkeeping: the service subscribes.
"""

import os
from typing import Any, Dict, Iterable, List, Set, Tuple

from agent.wire.protocol import TERMINAL_STATES

# Statuses still flowing: no change for this long, the status may be lost. The environment may
# shorten it (a test that overflows a broker on purpose need not wait 30 s for the proof).
AFTER_S = float(os.environ.get("JETSON_AGENT_FLEET_REREAD_AFTER_S") or 30.0)
QUIET_S = 1.0  # no status of the rollout for this long: its burst is over
QUICK_S = 2.0  # then: no change for this long is read again
ATTEMPTS = 8  # per state and job stage: quiet waits 2, 4, ... 120 s, about 6 minutes in all
MAX_WAIT_S = 120.0
BATCH = 1000  # statuses asked for in one quiet round (the shipped broker queues 1000 + 100)
BUSY_BATCH = 500  # ... in one round while its statuses still fill the queue (as before)
BUSY_EVERY_S = 5.0  # a busy rollout's runs are looked at this often (a scan of 50,000 runs)


class Reread(object):
    def __init__(self, after_s: float = AFTER_S, attempts: int = ATTEMPTS,
                 batch: int = BATCH, quick_s: float = QUICK_S, quiet_s: float = QUIET_S,
                 max_wait_s: float = MAX_WAIT_S, busy_batch: int = BUSY_BATCH,
                 busy_every_s: float = BUSY_EVERY_S) -> None:
        self.after_s = float(after_s)
        self.quick_s = float(quick_s)
        self.quiet_s = float(quiet_s)
        self.max_wait_s = float(max_wait_s)
        self.attempts = int(attempts)
        self.batch = int(batch)
        self.busy_batch = int(busy_batch)
        self.busy_every_s = float(busy_every_s)
        # (rollout, device) -> [(state, job id, stage) last seen, since when, attempts made]
        self._seen: Dict[Tuple[str, str], List[Any]] = {}
        self._heard: Dict[str, float] = {}  # rollout -> when its last status came
        # rollout -> (devices its last round asked not answered yet, how many it asked)
        self._round: Dict[str, Tuple[Set[str], int]] = {}
        self._looked: Dict[str, float] = {}  # rollout -> when its runs were last scanned
        self._behind: Dict[str, bool] = {}  # rollout -> unfinished runs behind most peers
        self.asked = 0

    def heard(self, rollout_id: str, device: str, now: float) -> None:
        """A job status of ``rollout_id`` came from ``device`` (answers to the last round
        excepted)."""
        asked = self._round.get(rollout_id)
        if asked is not None and device in asked[0]:
            asked[0].discard(device)
        else:
            self._heard[rollout_id] = now

    def answered(self) -> bool:
        """Whether the last rounds' answers came (a tenth at most still owed): the broker's
        queue has room for the next round before its usual time."""
        return all(len(left) * 10 <= n for left, n in self._round.values())

    def sending(self, rollout_id: str, now: float) -> None:
        """The rollout still has documents to send: not quiet, whatever came (a starved service
        building a batch for over a second reads no status meanwhile, and its devices' QUEUED
        wait in its queue, not lost)."""
        self._heard[rollout_id] = now

    def quiet(self, rollout_id: str, now: float) -> bool:
        """No status of the rollout for ``quiet_s``: its burst is over."""
        return now - self._heard.get(rollout_id, float("-inf")) >= self.quiet_s

    def room(self, rollout_id: str, now: float) -> int:
        """How many statuses of ``rollout_id`` one round may ask for now."""
        return self.batch if self.quiet(rollout_id, now) else self.busy_batch

    def wait(self, quiet: bool, attempt: int) -> float:
        """How long a run stays unchanged before its ``attempt``-th read (0 = the first)."""
        return min(self.max_wait_s, (self.quick_s if quiet else self.after_s) * 2 ** attempt)

    def due(self, rollout_id: str, runs: Iterable[Any], now: float,
            room: int) -> List[Tuple[str, str, int]]:
        """(device, job id, attempt) of the unfinished runs of ``rollout_id`` to read again now,
        at most ``room``; the runs' states are noted for the next call."""
        quiet = self.quiet(rollout_id, now)
        if not quiet and now - self._looked.get(rollout_id, float("-inf")) < self.busy_every_s:
            return []
        behind = quiet and self._behind.get(rollout_id, False)
        self._looked[rollout_id] = now
        out: List[Tuple[str, str, int]] = []
        final = unfinished = 0
        for run in runs:  # (50,000 a scan: the state read once, no property calls)
            state = run.state
            key = (rollout_id, run.device)
            if state in TERMINAL_STATES or state == "PENDING" or not run.job_id:
                final += state in TERMINAL_STATES
                self._seen.pop(key, None)
                continue
            unfinished += 1
            now_is = (state, run.job_id, run.job_stage)
            rec = self._seen.get(key)
            if rec is None or rec[0] != now_is:
                self._seen[key] = [now_is, now, 0]
                continue
            # Quick: a job its device has not started (it starts within a second unless busy
            # with a local job; a device is in one rollout at a time), or any job once most of
            # the rollout's are final.
            if len(out) < room and rec[2] < self.attempts and now - rec[1] >= self.wait(
                    quiet and (behind or state == "QUEUED"), rec[2]):
                rec[1], rec[2] = now, rec[2] + 1
                out.append((run.device, run.job_id, rec[2]))
        self._behind[rollout_id] = final >= unfinished
        if out:
            self._round[rollout_id] = ({device for device, _j, _a in out}, len(out))
        self.asked += len(out)
        return out

    def forget(self, rollout_id: str) -> None:
        for key in [k for k in self._seen if k[0] == rollout_id]:
            del self._seen[key]
        for d in (self._heard, self._round, self._looked, self._behind):
            d.pop(rollout_id, None)
