"""Fan-out rounds (controller side, ``agent.wire.block_server``): when each block of an
artifact goes out on its shared topic, so that a rollout window costs one copy of it.

- A block is published on the shared topic at most once per ``window_s`` (a round). A device
  asking for a block that went out while it listened (since its first request) gets it from
  that publication; one that asks for a block published before it listened does not get it
  now and is not dropped either: the block is owed to the *next* round (at most ``join_s``
  later, well within the device's first fan-out timeout, so a daemon of any release stays on
  the shared topic; a small artifact's next round comes sooner, ``SMALL_JOIN_S``: a hash list
  is what its artifact's devices wait on).
- The first round of a large artifact (``hold_bytes`` or more) waits for the devices that were
  just sent a job naming it (``expect``) to ask, for at most ``hold_s``: they arrive within a
  few seconds of each other on a busy host (``EXPECT_S`` after their job was sent at most),
  and all of them share that round instead of most of them missing it. Its first block goes
  out at once (a prelude: a device hearing nothing on the shared topic for its short first
  timeout would leave it); devices that come later get that block in the next round.

Pure: the clock is injected, nothing is published here (``BlockServer`` does). Memory is
bounded: expected devices are forgotten after ``EXPECT_S`` (and at most ``MAX_EXPECTED`` are
kept), publication and listening times beyond their caps once idle. Per request and per
expected device the work is constant (expiry from the front of a queue; the capped tables
pruned at most once a second), not a scan of every device: a stage sends 50,000 jobs.
"""

import collections
from typing import Callable, Deque, Dict, List, Optional, Tuple

HOLD_S = 4.0  # the longest a first round waits for expected devices (its prelude block
# went out at once: the devices listening wait their full request timeout, 10 s by default)
EXPECT_S = 5.0  # how long after its job was sent a device is expected to ask
JOIN_S = 1.5  # the longest a device that missed a round waits for the next
SMALL_JOIN_S = 0.2  # the same for a small artifact (a hash list: what the large one waits on)
HOLD_BYTES = 1 << 20  # smaller artifacts are not held: a copy costs less than the wait
MAX_EXPECTED = 20000  # expected (artifact, device) pairs kept at once; beyond, no hold
MAX_FANNED = 200000  # (artifact, block) publication times kept at once
MAX_SINCE = 100000  # (artifact, device) listening times kept at once
IDLE_S = 30.0  # an artifact none of whose blocks went out for this long starts a new window

Key = str  # "sha256:block_size"


class Rounds(object):
    def __init__(self, window_s: float = 2.0, clock: Optional[Callable[[], float]] = None,
                 hold_s: float = HOLD_S, join_s: float = JOIN_S,
                 hold_bytes: int = HOLD_BYTES) -> None:
        import time

        self.window_s = float(window_s)
        self.clock = clock or time.monotonic
        self.hold_s, self.join_s, self.hold_bytes = float(hold_s), float(join_s), int(hold_bytes)
        self.fanned: Dict[Tuple[Key, int], float] = {}  # (key, block) -> when published
        self.owed: Dict[Key, Dict[int, float]] = {}  # key -> block -> when it is due
        self.expected: Dict[str, Dict[str, float]] = {}  # sha256 -> device -> expected until
        # (until, sha256, device) in the order expected (until only grows: EXPECT_S after
        # now), so the expired ones are at its front; and how many pairs ``expected`` holds.
        self._expiry: Deque[Tuple[float, str, str]] = collections.deque()
        self._expected_n = 0
        self._pruned_at = -1e18
        self.first: Dict[Key, float] = {}  # key -> when its held first round is due
        self.active: Dict[Key, float] = {}  # key -> when a block of it was last published
        # (key, device) -> (its first request, its last request): since when it listens
        self.since: Dict[Tuple[Key, str], Tuple[float, float]] = {}
        self.deduped = 0  # blocks asked for and not published at once (owed to a round)
        self.joined = 0  # blocks owed to a later round because the device missed one

    # -- expected devices ---------------------------------------------------------------------

    def expect(self, sha256: str, device: str) -> None:
        """``device`` was just sent a job naming artifact ``sha256``: it will ask soon."""
        now = self.clock()
        self._forget(now)
        devices = self.expected.setdefault(sha256, {})
        if device not in devices:
            if self._expected_n >= MAX_EXPECTED:
                if not devices:
                    del self.expected[sha256]
                return
            self._expected_n += 1
        devices[device] = now + EXPECT_S
        self._expiry.append((now + EXPECT_S, sha256, device))

    def _unexpect(self, sha256: str, device: str) -> None:
        devices = self.expected.get(sha256)
        if devices is not None and devices.pop(device, None) is not None:
            self._expected_n -= 1
            if not devices:
                del self.expected[sha256]

    def _forget(self, now: float) -> None:
        """The expected pairs whose time passed (from the front: amortized, not a scan)."""
        while self._expiry and self._expiry[0][0] <= now:
            until, sha, dev = self._expiry.popleft()
            if (self.expected.get(sha) or {}).get(dev) == until:  # not expected again since
                self._unexpect(sha, dev)

    def _waiting(self, sha256: str, now: float) -> bool:
        self._forget(now)
        return bool(self.expected.get(sha256))

    # -- requests -----------------------------------------------------------------------------

    def request(self, sha256: str, block_size: int, size: int, device: str,
                indices: List[int]) -> List[int]:
        """A fan-out request of ``device``: the blocks to publish now (recorded as published);
        the others are owed to a round (``due``)."""
        now = self.clock()
        key = "{}:{}".format(sha256, block_size)
        self._unexpect(sha256, device)
        self._prune(now)
        # Since when the device listens on the shared topic (it subscribes before its first
        # request): what went out since then reached it, what went out before did not.
        seen = self.since.get((key, device))
        since = seen[0] if seen is not None and now - seen[1] <= IDLE_S else now
        if len(self.since) < MAX_SINCE or seen is not None:
            self.since[(key, device)] = (since, now)
        held = self._hold(key, sha256, size, now)
        owed = self.owed.get(key) or {}
        out = []
        if held is not None and indices and key not in self.active:
            # The held round's prelude: one block now, so that every device listening hears
            # the artifact's topic at once and waits its full request timeout for the rest
            # (a daemon gives up on the shared topic after a short first timeout otherwise).
            self.fanned[(key, indices[0])] = now
            self.active[key] = now
            out.append(indices[0])
            indices = indices[1:]
        for index in indices:
            if index in owed:
                self.deduped += 1  # already owed to the coming round
                continue
            last = self.fanned.get((key, index))
            if last is None and held is not None:
                self._owe(key, index, held)
            elif last is None or now - last >= self.window_s:
                self.fanned[(key, index)] = now
                self.active[key] = now
                out.append(index)
            elif last >= since:
                self.deduped += 1  # went out while the device listened: it has it, or will
            else:  # published before this device listened: the next round
                self.joined += 1
                join = self.join_s if size >= self.hold_bytes else SMALL_JOIN_S
                self._owe(key, index, min(last + self.window_s, now + join))
        return out

    def _hold(self, key: Key, sha256: str, size: int, now: float) -> Optional[float]:
        """When a held first round of ``key`` is due, or None (not held)."""
        due = self.first.get(key)
        if due is not None and due > now:
            if not self._waiting(sha256, now):
                self.first[key] = now  # everyone expected asked: the round goes now
                for index in self.owed.get(key) or {}:
                    self.owed[key][index] = min(self.owed[key][index], now)
                return None
            return due
        if due is None and size >= self.hold_bytes and self._waiting(sha256, now) and \
                now - self.active.get(key, -1e18) > IDLE_S:
            self.first[key] = now + self.hold_s
            return self.first[key]
        return None

    def _owe(self, key: Key, index: int, due: float) -> None:
        self.deduped += 1
        blocks = self.owed.setdefault(key, {})
        blocks[index] = min(blocks.get(index, due), due)

    # -- rounds -------------------------------------------------------------------------------

    def next_due(self) -> Optional[float]:
        dues = [t for blocks in self.owed.values() for t in blocks.values()]
        return min(dues) if dues else None

    def due(self) -> Dict[Key, List[int]]:
        """key -> the blocks whose round came (recorded as published now): publish them."""
        now = self.clock()
        out: Dict[Key, List[int]] = {}
        for key in list(self.owed):
            blocks = self.owed[key]
            ready = sorted(i for i, t in blocks.items() if t <= now)
            for index in ready:
                del blocks[index]
                self.fanned[(key, index)] = now
                self.active[key] = now
            if ready:
                out[key] = ready
            if not blocks:
                del self.owed[key]
        return out

    def _prune(self, now: float) -> None:
        """Idle entries dropped; the two large tables over their caps at most once a second
        (a full table of fresh entries would otherwise be copied at every request)."""
        if now - self._pruned_at >= 1.0:
            if len(self.since) >= MAX_SINCE:
                self._pruned_at = now
                self.since = {k: v for k, v in self.since.items() if now - v[1] <= IDLE_S}
            if len(self.fanned) > MAX_FANNED:
                self._pruned_at = now
                self.fanned = {k: t for k, t in self.fanned.items() if now - t < self.window_s}
        for table in (self.first, self.active):
            for key in [k for k, t in table.items() if now - t > IDLE_S]:
                del table[key]
