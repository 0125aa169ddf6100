"""Rate limits for what arrives over MQTT (docs/security.md, "Limits").

A token bucket per device daemon bounds how many new jobs it accepts: ``burst`` at once, then
``rate`` per second on average. A controller (or anyone who can publish to a device's job
topics) that floods it gets REJECTED ``rate_limited`` answers instead of a queue that grows
without bound. Pure: the clock is injected. ``TokenBuckets`` keeps one per key (an app's uid).
``BlockingByteQueue`` bounds the daemon's event queue by bytes (the controller's
queue, ``agent.fleet.transfer.bytequeue.SheddingByteQueue``, drops instead of blocking).
"""

import queue
import threading
import time
from typing import Any, Callable, Dict, Hashable, Optional

from agent.heap import trim_heap


class TokenBucket(object):
    """``take()`` is True while tokens remain; they refill at ``rate`` per second up to
    ``burst``. A rate of 0 disables the limit."""

    def __init__(self, rate: float, burst: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate < 0 or burst < 1:
            raise ValueError("rate must be >= 0 and burst >= 1, found {} and {}".format(
                rate, burst))
        self.rate = float(rate)
        self.burst = float(burst)
        self.clock = clock
        self.tokens = float(burst)
        self.updated = clock()

    def _refill(self) -> None:
        now = self.clock()
        if now > self.updated:
            self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now

    def take(self, n: float = 1.0) -> bool:
        if self.rate == 0:
            return True
        self._refill()
        if self.tokens >= n:
            self.tokens -= n
            return True
        return False

    def retry_after(self, n: float = 1.0) -> float:
        """Seconds until ``take(n)`` would succeed (0 when it would now)."""
        if self.rate == 0:
            return 0.0
        self._refill()
        return max(0.0, (n - self.tokens) / self.rate)


class TokenBuckets(object):
    """One ``TokenBucket`` per key (a uid, a device), bounded: past ``max_keys`` the quietest
    quarter is forgotten (they start again with a full bucket). Thread-safe."""

    def __init__(self, rate: float, burst: float, max_keys: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        TokenBucket(rate, burst, clock)  # checks the arguments once
        self.rate, self.burst, self.clock = float(rate), float(burst), clock
        self.max_keys = max_keys
        self.buckets: Dict[Hashable, TokenBucket] = {}
        self.lock = threading.Lock()

    def take(self, key: Hashable, n: float = 1.0) -> bool:
        with self.lock:
            bucket = self.buckets.get(key)
            if bucket is None:
                bucket = self.buckets[key] = TokenBucket(self.rate, self.burst, self.clock)
                if len(self.buckets) > self.max_keys:
                    for old in sorted(self.buckets, key=lambda k: self.buckets[k].updated)[
                            :self.max_keys // 4]:
                        if old != key:
                            del self.buckets[old]
            return bucket.take(n)


EVENT_QUEUE_BYTES = 32 << 20  # what the daemon's event queue may hold (messages, worker lines)
EVENT_QUEUE_ITEMS = 4000
TRIM_AFTER_BYTES = 8 << 20  # give freed memory back to the OS once a spike this large drained


def item_bytes(item: Any) -> int:
    """Memory an event holds, roughly: its payload or line, plus a fixed overhead."""
    size = 256
    for name in ("payload", "line", "topic"):
        value = getattr(item, name, None)
        if isinstance(value, (bytes, bytearray, str)):
            size += len(value)
    return size


class BlockingByteQueue(queue.Queue):  # type: ignore[type-arg]
    """A FIFO bounded by the bytes it holds as well as by its length: a flood of large
    messages (junk artifact blocks of up to 1 MiB) blocks the producer (paho's network thread:
    back-pressure onto the socket) instead of growing the daemon's memory. An item larger than
    the bound still goes in when the queue is empty. Once a spike of TRIM_AFTER_BYTES has
    drained, the C heap is trimmed so the daemon's RSS comes back down."""

    def __init__(self, max_bytes: int = EVENT_QUEUE_BYTES,
                 max_items: int = EVENT_QUEUE_ITEMS,
                 size: Callable[[Any], int] = item_bytes) -> None:
        super().__init__(max_items)
        self.max_bytes = int(max_bytes)
        self.bytes = 0
        self.peak = 0
        self._size = size
        self._trim_due = False

    def put(self, item: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        n = self._size(item)
        with self.not_full:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._qsize() and (self._qsize() >= self.maxsize > 0
                                     or self.bytes + n > self.max_bytes):
                if not block:
                    raise queue.Full
                if deadline is None:
                    self.not_full.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise queue.Full
                    self.not_full.wait(remaining)
            self.queue.append((n, item))
            self.bytes += n
            self.peak = max(self.peak, self.bytes)
            self.unfinished_tasks += 1
            self.not_empty.notify()

    def _get(self) -> Any:
        n, item = self.queue.popleft()
        self.bytes -= n
        if self.peak >= TRIM_AFTER_BYTES and not self.queue:
            self.peak = 0
            self._trim_due = True
        self.not_full.notify_all()
        return item

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        item = super().get(block, timeout)
        if self._trim_due:
            self._trim_due = False
            trim_heap()
        return item
