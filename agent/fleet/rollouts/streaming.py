"""How a service streams a stage and ingests job statuses, in bounded batches: how many job
documents it builds next (``doc_quota``: a batch at a time, never more than ``MAX_UNACKED``
waiting for the broker's PUBACK, so nothing queues per device in memory), how many events it
handles before committing them (``MAX_EVENTS``: one transaction per batch), and how long it
waits for events while documents are still owed (``pump_timeout``), and how many device
statuses it holds before writing them (``MAX_DIRTY``: a start-up's burst of births), and
how many documents may wait for their device's first answer (``Unanswered``). Pure.
"""

from collections import OrderedDict
from typing import Tuple

DOC_BATCH = 500  # job documents built, saved (one transaction) and published at a time
MAX_UNACKED = 4000  # published, not yet acknowledged: no new batch beyond this
MAX_EVENTS = 2000  # MQTT events handled before what they changed is committed
# ... or fewer once this many seconds went by: on a starved host (load 15-20 on two cores)
# 2,000 events took the loop past its lease (LEASE_S, 6 s), which it then lost and took back
# again and again, sending every unfinished document anew each time.
DRAIN_S = 1.0
MAX_DIRTY = 2000  # device statuses (births) held before they are written, one transaction
STREAMING_PUMP_S = 0.02  # the wait for events while a stage still has documents to send
EVALUATE_EVERY_S = 0.25  # a rollout's stage and abort decisions, at most this often
# Documents streamed in the last ANSWER_WINDOW_S s whose device has not answered yet: beyond
# this many no more are built. A device answers within a second of its document (QUEUED), so
# those that wait are mostly statuses not read yet, the service's own backlog; a device that
# stays silent (offline) stops counting after the window.
MAX_UNANSWERED = 20000
ANSWER_WINDOW_S = 10.0


def doc_quota(unacked: int, batch: int = DOC_BATCH, max_unacked: int = MAX_UNACKED) -> int:
    """Documents to build now, given ``unacked`` publications not yet acknowledged."""
    return max(0, min(int(batch), int(max_unacked) - int(unacked)))


def pump_timeout(unsent: int, quota: int, idle: float) -> float:
    """The wait for events: short while documents are owed and may be sent (the loop comes
    back to send them), ``idle`` otherwise (nothing to send, or the broker is behind)."""
    return STREAMING_PUMP_S if unsent > 0 and quota > 0 else idle


def split(quota: int, unsent: int, others: int = 0) -> int:
    """One rollout's share of ``quota`` when ``others`` more rollouts also have documents to
    send: an even share, at least one, never more than it still owes."""
    share = quota // (others + 1) if quota > 0 else 0
    return max(0, min(unsent, max(share, 1 if quota > 0 else 0)))


class Unanswered(object):
    """The documents streamed in the last ``window_s`` s that no status has answered yet."""

    def __init__(self, window_s: float = ANSWER_WINDOW_S) -> None:
        self.window_s = float(window_s)
        self._sent: "OrderedDict[Tuple[str, str], float]" = OrderedDict()

    def sent(self, device: str, job_id: str, now: float) -> None:
        self._sent[(device, job_id)] = now
        self._sent.move_to_end((device, job_id))

    def answered(self, device: str, job_id: str) -> None:
        self._sent.pop((device, job_id), None)

    def count(self, now: float) -> int:
        while self._sent and next(iter(self._sent.values())) < now - self.window_s:
            self._sent.popitem(last=False)
        return len(self._sent)

    def quota(self, now: float, max_unanswered: int = MAX_UNANSWERED) -> int:
        """Documents that may be built now."""
        return max(0, int(max_unanswered) - self.count(now))
