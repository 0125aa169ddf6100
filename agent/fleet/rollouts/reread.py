"""``Reread``: which jobs to ask the broker about again because their status never came.

A device's job status is retained at the broker (``{p}/devices/{d}/jobs/{job}/status``), but
the copy sent to the controller passes its session queue, where Mosquitto drops what does not
fit (``max_queued_messages``): a device whose SUCCEEDED was dropped would sit QUEUED or
IN_PROGRESS until its stage timed it out, although the broker holds its answer. A run whose
state has not changed for ``after_s`` s is read again (an exact subscription to its status
topic brings the retained copy), at most ``attempts`` times, each wait twice the last (a long
build reports no new state for minutes), at most ``batch`` a round (a round must fit the
broker's queue itself). Pure bookkeeping: the service subscribes.
"""

import os
from typing import Any, Dict, Iterable, List, Tuple

# No change for this long: the status may have been dropped on the way. The environment may
# shorten it (a test that overflows a broker on purpose need not wait 30 s for the proof).
AFTER_S = float(os.environ.get("JETSON_AGENT_FLEET_REREAD_AFTER_S") or 30.0)
ATTEMPTS = 3
BATCH = 500  # statuses asked for in one round (the shipped broker queues 1000 + 100)


class Reread(object):
    def __init__(self, after_s: float = AFTER_S, attempts: int = ATTEMPTS,
                 batch: int = BATCH) -> None:
        self.after_s = float(after_s)
        self.attempts = int(attempts)
        self.batch = int(batch)
        # (rollout, device) -> [(state, job id) last seen, since when, attempts made]
        self._seen: Dict[Tuple[str, str], List[Any]] = {}
        self.asked = 0

    def due(self, rollout_id: str, runs: Iterable[Any], now: float,
            room: int) -> List[Tuple[str, str, int]]:
        """(device, job id, attempt) of the unfinished runs of ``rollout_id`` to read again now,
        at most ``room``; the runs' states are noted for the next call."""
        out: List[Tuple[str, str, int]] = []
        for run in runs:
            key = (rollout_id, run.device)
            if run.terminal or run.state == "PENDING" or not run.job_id:
                self._seen.pop(key, None)
                continue
            now_is = (run.state, run.job_id, run.job_stage)
            rec = self._seen.get(key)
            if rec is None or rec[0] != now_is:
                self._seen[key] = [now_is, now, 0]
                continue
            if len(out) < room and rec[2] < self.attempts and \
                    now - rec[1] >= self.after_s * 2 ** rec[2]:
                rec[1], rec[2] = now, rec[2] + 1
                out.append((run.device, run.job_id, rec[2]))
        self.asked += len(out)
        return out

    def forget(self, rollout_id: str) -> None:
        for key in [k for k in self._seen if k[0] == rollout_id]:
            del self._seen[key]
