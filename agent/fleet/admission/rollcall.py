"""``RollCall``: how a controller learns every device whatever the broker's queue limits.

Retained statuses delivered through one subscription to ``{p}/devices/+/status`` pass through
the controller's session queue, where Mosquitto drops what does not fit (1,100 of 10,000 with
the shipped ``max_queued_messages 1000``). A roll call pages instead, in rounds sized to stay
well inside that queue:

1. entries: each device keeps a retained entry under ``{p}/rollcall/{h1}/{h2}/{device}``
   (``agent.wire.rollcall``); a round subscribes to a few of the 256 buckets, then publishes a
   *mark* to its own mark topic. A session's messages arrive in order, so the mark comes after
   the round's entries; a round whose mark does not come within ``MARK_WAIT_S``, or that
   brought ``SUSPECT`` messages or more, overflowed the queue and is asked again in smaller
   rounds. The first round asks for one sixteenth of the buckets; later rounds are sized from
   the entries per bucket seen so far.
2. statuses: for each device not known yet (or known at an older boot), exact subscriptions to
   its retained status and models message, ``PAGE_MESSAGES // 2`` devices a round, again
   closed by a mark; they reach the connection's usual handler (``FleetConnection``).

Devices of the previous release keep no entry: they are still learnt from the wildcard
subscription, as before (complete up to the broker's queue). Driven by
``FleetConnection.pump`` (``on_topic`` for the roll-call topics, ``poll`` for timeouts), so a
running service sweeps without stopping its loop.
"""

import logging
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from agent.wire import rollcall as wire

log = logging.getLogger("agent.fleet")

PAGE_MESSAGES = 400  # retained messages one round asks for (Mosquitto queues 1000 + 100)
SUSPECT = 900  # a round that brought this many may have been cut by the queue: asked again
MARK_WAIT_S = 5.0
BUCKETS = [(h1, h2) for h1 in wire.HEX for h2 in wire.HEX]


class RollCall(object):
    """One sweep over a ``FleetConnection`` (``conn``). ``known(device)`` is the boot of the
    status the controller holds for it, or None."""

    def __init__(self, conn: Any, known: Callable[[str], Optional[int]],
                 page: int = PAGE_MESSAGES, wait: float = MARK_WAIT_S) -> None:
        self.conn = conn
        self.prefix = conn.topics.prefix
        self.known = known
        self.page = max(2, int(page))
        self.wait = wait
        self.entries: Dict[str, int] = {}
        self.mark = wire.mark_topic(self.prefix, "rc" + uuid.uuid4().hex[:16])
        self.todo: List[Any] = list(BUCKETS)  # buckets, then device ids
        self.phase = "entries"
        self.group = 16
        self.round: Optional[Tuple[str, List[Any], List[str], float]] = None
        self.count = 0  # messages of the round in flight
        self.done = False
        self.started = time.monotonic()
        self.stats = {"rounds": 0, "overflows": 0, "entries": 0, "fetched": 0, "seconds": 0.0}

    # -- driving ------------------------------------------------------------------------------

    def start(self) -> "RollCall":
        self.conn.client.subscribe(self.mark, 1)
        self._issue()
        return self

    def restart(self) -> None:
        """The connection was lost: the round in flight is asked again (its subscriptions
        went with the session, the mark may have too)."""
        if self.round is not None:
            self.round = None
            self.conn.client.subscribe(self.mark, 1)
            self._issue()

    def on_topic(self, topic: str, payload: bytes) -> None:
        """A message on a roll-call topic (an entry or a mark)."""
        if topic == self.mark:
            if self.round is not None and bytes(payload or b"").decode("ascii", "replace") \
                    == self.round[0]:
                self._close(overflowed=self.count >= SUSPECT)
            return
        entry = wire.parse_entry(self.prefix, topic, payload)
        if entry is not None and self.phase == "entries":
            self.count += 1
            self.entries[entry[0]] = max(entry[1], self.entries.get(entry[0], -1))

    def counted(self) -> None:
        """A retained status or models message arrived during a statuses round."""
        if self.phase == "statuses":
            self.count += 1

    def poll(self) -> None:
        """A round whose mark is overdue overflowed the broker's queue."""
        if self.round is not None and time.monotonic() - self.round[3] > self.wait:
            self._close(overflowed=True)

    # -- rounds -------------------------------------------------------------------------------

    def _filters(self, items: List[Any]) -> List[str]:
        if self.phase == "statuses":
            out = []
            for dev in items:
                out += [self.conn.topics.status(dev), self.conn.topics.models(dev)]
            return out
        if len(items) == len(BUCKETS):
            return ["{}/rollcall/+/+/+".format(self.prefix)]
        firsts = sorted({h1 for h1, _ in items})
        whole = [h1 for h1 in firsts if sum(1 for h, _ in items if h == h1) == 16]
        return [wire.page_filter(self.prefix, h1) for h1 in whole] + [
            wire.page_filter(self.prefix, h1, h2) for h1, h2 in items if h1 not in whole]

    def _issue(self) -> None:
        while not self.todo:
            if self.phase == "statuses":
                self._finish()
                return
            self.phase = "statuses"
            self.todo = sorted(d for d, boot in self.entries.items()
                               if not _at_least(self.known(d), boot))
            self.group = max(1, self.page // 2)
        items = self.todo[:self.group]
        filters = self._filters(items)
        token = uuid.uuid4().hex
        for f in filters:
            self.conn.client.subscribe(f, 1)
        self.count = 0
        self.round = (token, items, filters, time.monotonic())
        self.conn.client.publish(self.mark, token.encode("ascii"), qos=1)
        self.stats["rounds"] += 1

    def _close(self, overflowed: bool) -> None:
        assert self.round is not None
        _token, items, filters, _t = self.round
        self.round = None
        for f in filters:
            self.conn.client.unsubscribe(f)
        if overflowed and self.count:
            # What came through a cut round is about the broker's queue (a broker configured
            # below the shipped limits): later rounds stay well inside it.
            self.page = max(2, min(self.page, self.count * 2 // 3))
        if overflowed and len(items) > 1:
            self.stats["overflows"] += 1
            self.group = max(1, len(items) // 4)
            self._issue()  # the same items again, fewer at a time
            return
        if overflowed:
            self.stats["overflows"] += 1
            log.warning("roll call: one page (%s) overflowed the broker's queue even alone; "
                        "some devices in it may be missing until the next roll call",
                        filters[0])
        del self.todo[:len(items)]
        if self.phase == "entries":
            per_bucket = max(1.0, float(self.count) / len(items))
            self.group = max(1, min(len(BUCKETS), int(self.page / per_bucket)))
        else:
            self.stats["fetched"] += len(items)
        self._issue()

    def _finish(self) -> None:
        self.conn.client.unsubscribe(self.mark)
        self.done = True
        self.stats["entries"] = len(self.entries)
        self.stats["seconds"] = round(time.monotonic() - self.started, 3)
        log.info("roll call: %d device entries, %d statuses read, %d rounds (%d overflowed) "
                 "in %.1f s", self.stats["entries"], self.stats["fetched"],
                 self.stats["rounds"], self.stats["overflows"], self.stats["seconds"])


def _at_least(known: Any, boot: int) -> bool:
    return isinstance(known, int) and not isinstance(known, bool) and known >= boot
