"""An event queue bounded in bytes that never blocks its producer (paho's network thread).

A controller must never stop paho's thread: PUBACKs, and with them every publish the owner
waits for, go through it (a full count-bounded queue once deadlocked a 1,200-device stage).
Over the byte budget, messages that are cheap to lose (block requests: the device asks
again; telemetry) are dropped and counted; everything else (statuses, acknowledgements,
connection events) is always kept: those are small and bounded by the fleet's size.
"""

import collections
import queue
import threading
from typing import Any, Deque, Optional

DROPPABLE = ("/request", "/telemetry")


class ByteQueue(object):
    """``queue.Queue``'s ``put``/``get``/``qsize`` for ``agent.wire.mqtt`` events."""

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.dropped = 0
        self.peak = 0
        self._items: Deque[Any] = collections.deque()
        self._cond = threading.Condition()

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
            self._items.append((event, size))
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
            self._cond.notify()

    def put_nowait(self, event: Any) -> None:
        self.put(event, False)

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        with self._cond:
            if not self._items and block:
                self._cond.wait(timeout)
            if not self._items:
                raise queue.Empty
            event, size = self._items.popleft()
            self.bytes -= size
            return event

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        with self._cond:
            return len(self._items)

    def empty(self) -> bool:
        return self.qsize() == 0
