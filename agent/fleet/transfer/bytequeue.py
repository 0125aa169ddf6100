"""An event queue bounded in bytes that never blocks its producer (paho's network thread).

A controller must never stop paho's thread: PUBACKs, and with them every publish the owner
waits for, go through it (a full count-bounded queue once deadlocked a 1,200-device stage).
Over the byte budget, messages that are cheap to lose (block requests: the device asks
again; telemetry) are dropped and counted; everything else (statuses, acknowledgements,
connection events) is always kept: those are small and bounded by the fleet's size. A payload
larger than any message the controller decodes is dropped whatever the budget. A retained
birth or models message (a subscription's flood of them: 50,000 at a service's start) is kept
up to a smaller budget, ``reread_bytes``: the broker still holds it, and the roll call reads
it again (``reread_dropped`` counts them; the service then takes one).

A job status superseded while it waits (a newer message on the same job status topic: a
device's retained status is its newest) is coalesced: the newer one goes to the back of the
queue and the older is dropped unread (never verified, decoded or stored; ``coalesced``
counts them), so a backlog holds at most one status per device and job. A status that is
not final waits ``hold_s`` (0.1 s) before it is handed out: a device reports QUEUED,
IN_PROGRESS and often its end within milliseconds, and the newest is all the controller needs
(verifying each cost a 50,000-device stage about 10 % of the service's CPU). Per topic the
order stays; across topics a held status may come after later messages.

Per source, so that no flood of messages is kept whatever the budget: with ``trusted`` (device
id -> whether it is admitted; the service's admission gate), every message of a device not
trusted (an unknown id, a pending one: anyone can make those up) shares ``untrusted_bytes``
(4 MiB) with all the others, all of them together enter at most ``untrusted_rate`` (2 MiB)
a second (bounding the work behind the queue too: verifying, recording pending devices),
and each trusted device holds at most ``source_bytes`` (1 MiB) in the queue.
Over its budget a message is dropped unread and counted (``untrusted_dropped``,
``source_dropped``), a warning at most every ``WARN_EVERY_S``. A dropped retained birth is
still at the broker (counted in ``reread_dropped`` too: a roll call reads it again, as when a
large fleet's births first arrive); a device's newest status is retained,
so nothing a trusted device said is lost for good. The queue thus holds at most
``untrusted_bytes`` + (admitted devices x ``source_bytes``) of device messages, however many
ids a flood makes up (40,000 signed 60 KB births for made-up ids once took a service from
42 MB to 2.29 GB).
"""

import collections
import logging
import queue
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional

from agent.wire import protocol

log = logging.getLogger("agent.fleet")

DROPPABLE = ("/request", "/telemetry")
REREAD_BYTES = 16 << 20
HOLD_S = 0.1
# A job status naming one of these is final (a plain search of the payload, before anything is
# verified: a wrong guess only changes whether it waits hold_s).
FINAL = tuple('"{}"'.format(s).encode() for s in sorted(protocol.TERMINAL_STATES))
# Larger than any message the controller decodes (protocol.MAX_BYTES): refused there anyway,
# so not held here whatever the budget (a hostile client's big payloads pile up otherwise).
MAX_PAYLOAD = max(protocol.MAX_BYTES.values())
UNTRUSTED_BYTES = 4 << 20  # every device not admitted, together
UNTRUSTED_RATE = 2 << 20  # ... and their bytes a second into the queue (a token bucket)
SOURCE_BYTES = 1 << 20  # each admitted device: 16 of the largest messages it may send
WARN_EVERY_S = 30.0
UNTRUSTED = ""  # the one source key of every device not trusted


def source_of(topic: Any) -> Optional[str]:
    """The device id of a device topic (``{prefix}/devices/{id}/...``), else None."""
    if not isinstance(topic, str):
        return None
    at = topic.find("/devices/")
    if at < 0:
        return None
    end = topic.find("/", at + 9)
    return topic[at + 9:end] if end > at + 9 else None


def coalescable(topic: str) -> bool:
    """A job status topic (``{p}/devices/{id}/jobs/{job}/status``): only the newest counts."""
    return topic.endswith("/status") and "/jobs/" in topic


def rereadable(event: Any) -> bool:
    """A device's birth or models message delivered as retained: the broker keeps it."""
    topic = str(getattr(event, "topic", ""))
    return bool(getattr(event, "retain", False)) and "/devices/" in topic and (
        topic.endswith("/models") or topic.endswith("/status") and not coalescable(topic))


class SheddingByteQueue(object):
    """``queue.Queue``'s ``put``/``get``/``qsize`` for ``agent.wire.mqtt`` events; over its
    budgets it sheds messages (the daemon's ``agent.wire.device.limits.BlockingByteQueue``
    blocks)."""

    def __init__(self, max_bytes: int = 64 << 20, hold_s: float = HOLD_S,
                 reread_bytes: int = REREAD_BYTES,
                 trusted: Optional[Callable[[str], bool]] = None,
                 untrusted_bytes: int = UNTRUSTED_BYTES, source_bytes: int = SOURCE_BYTES,
                 untrusted_rate: float = UNTRUSTED_RATE) -> None:
        self.max_bytes = int(max_bytes)
        self.trusted = trusted
        self.untrusted_bytes = int(untrusted_bytes)
        self.source_bytes = int(source_bytes)
        self._sources: Dict[str, int] = {}  # source -> its bytes queued (UNTRUSTED: shared)
        self.untrusted_rate = float(untrusted_rate)
        self._tokens = float(self.untrusted_bytes)  # what devices not admitted may still send
        self._filled = time.monotonic()
        self.untrusted_dropped = 0
        self.source_dropped = 0
        self._warned = (0.0, 0)  # (when, drops then) of the last warning
        self.reread_bytes = int(reread_bytes)
        self.reread_dropped = 0
        self.hold_s = float(hold_s)
        self.bytes = 0
        self.dropped = 0
        self.peak = 0
        # [event, size, live, arrived (monotonic) or None: not held, source or None]
        self._items: Deque[List[Any]] = collections.deque()
        self._held: Deque[List[Any]] = collections.deque()  # statuses waiting out hold_s
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
            payload = getattr(event, "payload", None) or b""
            if len(payload) > MAX_PAYLOAD or self.bytes + size > self.max_bytes and str(
                    getattr(event, "topic", "")).endswith(DROPPABLE):
                self.dropped += 1
                return
            if self.bytes + size > self.reread_bytes and rereadable(event):
                self.dropped += 1
                self.reread_dropped += 1
                return
            topic = getattr(event, "topic", None)
            source = self._source(topic)
            if source is not None:
                budget = self.untrusted_bytes if source == UNTRUSTED else self.source_bytes
                if self._sources.get(source, 0) + size > budget or \
                        source == UNTRUSTED and not self._take_tokens(size):
                    if source == UNTRUSTED:
                        self.untrusted_dropped += 1
                    else:
                        self.source_dropped += 1
                    if rereadable(event):  # a roll call reads it again (a fleet's first start)
                        self.reread_dropped += 1
                    self.dropped += 1
                    self._warn()
                    return
                self._sources[source] = self._sources.get(source, 0) + size
            entry = [event, size, True, None, source]
            older = self._latest.get(topic) if isinstance(topic, str) else None
            if isinstance(topic, str) and payload and coalescable(topic):
                if self.hold_s > 0 and isinstance(payload, bytes) and \
                        not any(f in payload for f in FINAL):
                    entry[3] = time.monotonic()
                if older is not None and older[2]:
                    older[2] = False  # superseded: dropped unread, its memory at once
                    older[0] = None
                    self.bytes -= older[1]
                    self._unsource(older)
                    self.coalesced += 1
                self._latest[topic] = entry
            elif older is not None and older[2] and older[3] is not None:
                entry[3] = older[3]  # a cleared status keeps its place behind a held one
            self._items.append(entry)
            self.bytes += size
            self.peak = max(self.peak, self.bytes)
            self._cond.notify()

    def _source(self, topic: Any) -> Optional[str]:
        """The budget a device message counts against: its device's, or the shared one of
        devices not trusted; None (no per-source budget) without ``trusted``."""
        if self.trusted is None:
            return None
        device = source_of(topic)
        if device is None:
            return None
        try:
            return device if self.trusted(device) else UNTRUSTED
        except Exception:  # noqa: BLE001 - paho's thread must go on; the gate decides later
            return UNTRUSTED

    def _take_tokens(self, size: int) -> bool:
        """The rate of devices not admitted: ``untrusted_rate`` bytes a second, bursts up to
        ``untrusted_bytes`` (what the service then verifies, records as pending and writes is
        bounded in time too, not only what waits here)."""
        now = time.monotonic()
        self._tokens = min(float(self.untrusted_bytes),
                           self._tokens + (now - self._filled) * self.untrusted_rate)
        self._filled = now
        if self._tokens < size:
            return False
        self._tokens -= size
        return True

    def _unsource(self, entry: List[Any]) -> None:
        source = entry[4]
        if source is not None:
            left = self._sources.get(source, 0) - entry[1]
            if left > 0:
                self._sources[source] = left
            else:
                self._sources.pop(source, None)

    def _warn(self) -> None:
        """At most one line every WARN_EVERY_S, whatever the flood (called holding the lock)."""
        now = time.monotonic()
        drops = self.untrusted_dropped + self.source_dropped
        if now - self._warned[0] < WARN_EVERY_S and self._warned[0]:
            return
        log.warning("event queue: %d device messages dropped so far (%d from devices not "
                    "admitted, over their shared %d bytes; %d from admitted devices over their "
                    "%d bytes each): a flood, or a device sending too much", drops,
                    self.untrusted_dropped, self.untrusted_bytes, self.source_dropped,
                    self.source_bytes)
        self._warned = (now, drops)

    def put_nowait(self, event: Any) -> None:
        self.put(event, False)

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with self._cond:
            while True:
                now = time.monotonic()
                entry = self._next(now)
                if entry is not None:
                    return self._take(entry)
                if not block:
                    raise queue.Empty
                wait = None  # until a put, the first held status's time, or the deadline
                if self._held:
                    wait = max(0.0, self._held[0][3] + self.hold_s - now)
                if deadline is not None:
                    if now >= deadline:
                        raise queue.Empty
                    wait = deadline - now if wait is None else min(wait, deadline - now)
                self._cond.wait(wait)

    def _next(self, now: float) -> Optional[List[Any]]:
        """The next entry to hand out: a held status whose time came (it arrived before
        anything still queued), else the first live queued one that need not wait."""
        while self._held and not self._held[0][2]:
            self._held.popleft()  # coalesced while it waited
        if self._held and now - self._held[0][3] >= self.hold_s:
            return self._held.popleft()
        while self._items:
            entry = self._items.popleft()
            if not entry[2]:
                continue  # coalesced: its bytes were returned then
            if entry[3] is not None and now - entry[3] < self.hold_s:
                self._held.append(entry)  # not final: a newer status may yet supersede it
                continue
            return entry
        return None

    def _take(self, entry: List[Any]) -> Any:
        event = entry[0]
        self.bytes -= entry[1]
        self._unsource(entry)
        topic = getattr(event, "topic", None)
        if isinstance(topic, str) and self._latest.get(topic) is entry:
            del self._latest[topic]
        return event

    def get_nowait(self) -> Any:
        return self.get(False)

    def qsize(self) -> int:
        with self._cond:
            return sum(1 for entry in self._items if entry[2]) + \
                sum(1 for entry in self._held if entry[2])

    def empty(self) -> bool:
        return self.qsize() == 0
