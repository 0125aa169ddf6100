"""Rate limits for what arrives over MQTT (docs/security.md, "Limits").

A token bucket per device daemon bounds how many new jobs it accepts: ``burst`` at once, then
``rate`` per second on average. A controller (or anyone who can publish to a device's job
topics) that floods it gets REJECTED ``rate_limited`` answers instead of a queue that grows
without bound. Pure: the clock is injected.
"""

import time
from typing import Callable


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
