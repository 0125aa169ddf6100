"""What the admission gate remembers of an identity beyond its row (docs/security.md,
"Admission"): the keys seen for a device id (so ``accept`` pins a key the operator saw), its
impostor events (births signed by a key other than the pinned one), the ids an unbound
--admission-keys key claimed, and which devices an operator looked at lately (never evicted
from the pending list). Kept in the store's ``meta`` rows under a prefix; the in-memory
parts are bounded. Also the two rate limits of a flood: per key id (new pending ids) and per
log line (no megabytes of warnings).
"""

import logging
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional

PREFIX = "identity:"  # device -> {"keys": {key id: public key}, "impostors": n, "last": {...}}
CLAIM = "keyclaim:"  # key id of an unbound listed key -> the device id it claimed
VIEWED = "viewed:"  # device -> when an operator last looked at it
MAX_KEYS_SEEN = 8  # key ids remembered per device (the newest kept)
MAX_ID_CHARS = 256
WRITE_EVERY_S = 5.0  # an impostor flood writes a device's record at most this often


def record(store: Any, device: str) -> Dict[str, Any]:
    rec = store.meta_get(PREFIX + device)
    return rec if isinstance(rec, dict) else {}


def keys_seen(store: Any, device: str, row: Optional[Dict[str, Any]] = None
              ) -> "OrderedDict[str, str]":
    """key id -> public key (base64) of every key seen for ``device``: its record's and the
    pending one of its admission row."""
    out: "OrderedDict[str, str]" = OrderedDict()
    for kid, pub in (record(store, device).get("keys") or {}).items():
        out[str(kid)] = str(pub)
    if row and row.get("pending_key_id") and row.get("pending_public_key"):
        out[str(row["pending_key_id"])] = str(row["pending_public_key"])
    return out


def mark_viewed(store: Any, device: str, now: Optional[float] = None) -> None:
    """An operator looks at ``device`` (``fleet devices show``, the dashboard's page): the
    pending list keeps it a while."""
    store.meta_put(VIEWED + device, time.time() if now is None else now)


class Records(object):
    """Keys seen and impostor events, written through to the store at most every
    ``WRITE_EVERY_S`` per device (the count in memory is exact; a flood costs no write per
    message). Bounded: ``limit`` devices' records in memory."""

    def __init__(self, store: Any, limit: int = 10000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.limit = limit
        self.clock = clock
        self.cache: "OrderedDict[str, Dict[str, Any]]" = OrderedDict()
        self.written: Dict[str, float] = {}

    def _get(self, device: str) -> Dict[str, Any]:
        rec = self.cache.get(device)
        if rec is None:
            rec = record(self.store, device)
            rec.setdefault("keys", {})
            self.cache[device] = rec
            while len(self.cache) > self.limit:
                old, _ = self.cache.popitem(last=False)
                self.written.pop(old, None)
        self.cache.move_to_end(device)
        return rec

    def _write(self, device: str, rec: Dict[str, Any], force: bool = False) -> None:
        now = self.clock()
        if force or now - self.written.get(device, -1e9) >= WRITE_EVERY_S:
            self.written[device] = now
            self.store.meta_put(PREFIX + device, rec)

    def saw_key(self, device: str, kid: str, public: str) -> None:
        rec = self._get(device)
        keys = rec["keys"]
        if kid in keys:
            return
        keys[kid] = public
        while len(keys) > MAX_KEYS_SEEN:
            del keys[next(iter(keys))]
        self._write(device, rec, force=True)

    def impostor(self, device: str, kid: str, public: str, wall: float) -> int:
        """One more birth for ``device`` signed by ``kid`` (not its pinned key): the count."""
        rec = self._get(device)
        rec["impostors"] = int(rec.get("impostors") or 0) + 1
        rec["last"] = {"key_id": kid, "ts": wall}
        new = kid not in rec["keys"]
        if new:
            rec["keys"][kid] = public
            while len(rec["keys"]) > MAX_KEYS_SEEN:
                del rec["keys"][next(iter(rec["keys"]))]
        self._write(device, rec, force=new)
        return int(rec["impostors"])

    def reset(self, device: str, kid: str, public: str) -> None:
        """A new pinned key (rekey, rotation): the keys seen start again from it; the impostor
        history stays."""
        rec = self._get(device)
        rec["keys"] = {kid: public}
        self._write(device, rec, force=True)

    def forget(self, device: str) -> None:
        self.cache.pop(device, None)
        self.store.meta_delete(PREFIX + device)  # also a record this process never cached
        self.written.pop(device, None)


class KeyBuckets(object):
    """A token bucket per key id: at most ``rate`` new pending ids a minute each (``burst``
    at once). Bounded: the ``limit`` most recent key ids."""

    def __init__(self, rate: float, burst: float, limit: int = 10000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate / 60.0
        self.burst = burst
        self.limit = limit
        self.clock = clock
        self.buckets: "OrderedDict[str, Any]" = OrderedDict()

    def take(self, kid: str) -> bool:
        now = self.clock()
        tokens, last = self.buckets.pop(kid, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        ok = tokens >= 1.0
        self.buckets[kid] = (tokens - 1.0 if ok else tokens, now)
        while len(self.buckets) > self.limit:
            self.buckets.popitem(last=False)
        return ok


class RateLog(object):
    """At most one line per ``what`` every ``every_s`` seconds; the lines left out are
    counted in the next one."""

    def __init__(self, logger: logging.Logger, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = logger
        self.every_s = every_s
        self.clock = clock
        self.last: Dict[str, float] = {}
        self.skipped: Dict[str, int] = {}

    def warning(self, what: str, fmt: str, *args: Any) -> None:
        now = self.clock()
        if now - self.last.get(what, -1e9) < self.every_s:
            self.skipped[what] = self.skipped.get(what, 0) + 1
            return
        self.last[what] = now
        skipped = self.skipped.pop(what, 0)
        if skipped:
            fmt += " (%d more like it in the last %.0f s)"
            args = args + (skipped, self.every_s)
        self.log.warning(fmt, *args)
