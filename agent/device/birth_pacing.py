"""``BirthPacer``: when the daemon publishes its birth again (agent.wire.rollcall).

A birth the broker dropped on its way to the controller (its session queue full: a fleet born
at once, a broker restart) leaves the device out of the registry until a roll call reads it.
So once a controller that acknowledges births has made itself known (its retained call, which
states the window its fleet answers over), the device publishes its birth again until the
controller acknowledges it, waiting longer each time (``rollcall.retry_delay``: doubling,
capped, plus the device's slot of the window); and it answers a new call (a restarted
controller confirming its registry) at its slot of the window, not at once with the rest of
the fleet. Before any call the device publishes its birth once, as before: the controller's
roll call at its start reads the births it missed, and the retries of a fleet that booted at
once would crowd its pages out. Pure: the clock is injected, the caller publishes.
"""

import time
from typing import Callable, Optional

from agent.wire import rollcall


class BirthPacer(object):
    def __init__(self, device: str, boot: int, clock: Callable[[], float] = time.monotonic,
                 ack_wait_s: float = rollcall.ACK_WAIT_S,
                 max_backoff_s: float = rollcall.MAX_BACKOFF_S) -> None:
        self.device, self.boot, self.clock = device, boot, clock
        self.ack_wait_s, self.max_backoff_s = ack_wait_s, max_backoff_s
        self.window_s: Optional[float] = None  # the last call's; None: no call heard
        self.acked = False
        self.acked_call: Optional[str] = None  # the call current when the last ack was sent
        self.attempt = 0
        self.next_at: Optional[float] = None  # when the birth goes out again; None: not owed
        self.sent_at: Optional[float] = None  # when the last birth went out (None: acked)
        self.sent_attempt = 0

    def connected(self) -> None:
        """A new connection: its birth starts a new series of waits."""
        self.attempt = 0

    def published(self) -> None:
        """A birth just went out: wait for its acknowledgement, or publish it again."""
        self.acked = False
        self.sent_at, self.sent_attempt = self.clock(), self.attempt
        self.attempt += 1
        self._pace()

    def _pace(self) -> None:
        """When the birth goes out again: its backoff after it was sent (or now, if that
        passed before a call came), plus this device's slot of the window."""
        if self.window_s is None or self.sent_at is None:
            self.next_at = None
            return
        backoff = rollcall.retry_delay(self.device, self.sent_attempt, 0.0, self.ack_wait_s,
                                       self.max_backoff_s)
        self.next_at = max(self.sent_at + backoff, self.clock()) + \
            rollcall.slot(self.device) * self.window_s

    def due(self) -> bool:
        return self.next_at is not None and self.clock() >= self.next_at

    def on_ack(self, payload: bytes) -> bool:
        """The controller's acknowledgement: True when it is of this boot's birth."""
        ack = rollcall.parse_ack(self.device, payload)
        if ack is None or ack[0] != self.boot:
            return False
        self.window_s = ack[2]
        self.acked, self.acked_call, self.next_at, self.attempt = True, ack[1], None, 0
        self.sent_at = None
        return True

    def on_call(self, payload: bytes) -> None:
        """A controller's call: answered at this device's slot of its window, unless the
        birth is already acknowledged under this call or still waits for its acknowledgement
        (its retry is then paced by the window just learnt)."""
        call = rollcall.parse_call(payload)
        if call is None:
            return
        token, self.window_s = call
        if not self.acked:
            self._pace()
            return
        if token == self.acked_call:
            return
        self.acked_call = token  # answered once per call, whatever comes of the answer
        self.attempt = 0
        self.next_at = self.clock() + rollcall.slot(self.device) * self.window_s
