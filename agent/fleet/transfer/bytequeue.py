"""An event queue bounded in bytes that never blocks its producer (paho's network thread).

A controller must never stop paho's thread: PUBACKs, and with them every publish the owner
waits for, go through it (a full count-bounded queue once deadlocked a 1,200-device stage).
Over the byte budget, messages that are cheap to lose (block requests: the device asks
again; telemetry) are dropped and counted; everything else (statuses, acknowledgements,
connection events) is always kept: those are small and bounded by the fleet's size.

A job status superseded while it waits (a newer message on the same job status topic: a
device's retained status is its newest) is coalesced: the newer one goes to the back of the
queue and the older is dropped unread (never verified, decoded or stored; ``coalesced``
counts them), so a backlog holds at most one status per device and job.
"""

import collections
import queue
import threading
from typing import Any, Deque, Dict, List, Optional

DROPPABLE = ("/request", "/telemetry")


def coalescable(topic: str) -> bool:
    """A job status topic (``{p}/devices/{id}/jobs/{job}/status``): only the newest counts."""
    return topic.endswith("/status") and "/jobs/" in topic


class ByteQueue(object):
    """``queue.Queue``'s ``put``/``get``/``qsize`` for ``agent.wire.mqtt`` events."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.dropped = 0
        self.peak = 0
        self._items: Deque[List[Any]] = collections.deque()  # [event, size, live]
        self._cond = threading.Condition()
        self._latest: Dict[str, List[Any]] = {}  # job status topic -> its queued entry
        self.coalesced = 0

    @staticmethod
    def _size(event: Any) -> int:
        return 200 + len(getattr(event, "payload", b"") or b"") + len(
            getattr(event, "topic", "") or "")

    def put(self, event: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        size = self._size(event)
        with self._cond:
            if self.bytes + size > self.max_bytes and str(
                    getattr(event, "topic", "")).endswith(DROPPABLE):
                self.dropped += 1
                return
            entry = [event, size, True]
            topic = getattr(event, "topic", None)
            if isinstance(topic, str) and getattr(event, "payload", None) and \
                    coalescable(topic):
                older = self._latest.get(topic)
                if older is not None and older[2]:
                    older[2] = False  # superseded: dropped unread
                    self.bytes -= older[1]
                    self.coalesced += 1
                self._latest[topic] = entry
            self._items.append(entry)
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
            self._cond.notify()

    def put_nowait(self, event: Any) -> None:
        self.put(event, False)

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        with self._cond:
            while self._items and not self._items[0][2]:
                self._items.popleft()  # coalesced: its bytes were returned then
            if not self._items and block:
                self._cond.wait(timeout)
                while self._items and not self._items[0][2]:
                    self._items.popleft()
            if not self._items:
                raise queue.Empty
            event, size, _live = self._items.popleft()
            self.bytes -= size
            topic = getattr(event, "topic", None)
            if isinstance(topic, str) and self._latest.get(topic) is not None and \
                    self._latest[topic][0] is event:
                del self._latest[topic]
            return event

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        with self._cond:
            return sum(1 for entry in self._items if entry[2])

    def empty(self) -> bool:
        return self.qsize() == 0
