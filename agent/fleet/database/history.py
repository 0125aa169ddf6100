"""Telemetry history in the fleet database: one row per device sample, for the dashboard's
plots. Its table and indexes are in the fleet database's baseline revision
(``agent.fleet.database.tables``); ``ensure_schema`` keeps the ``CREATE TABLE IF NOT EXISTS`` it
made them with before migrations, a no-op on a migrated database. Bounded three ways because devices
are hostile:
at most one sample per device per ``min_interval_s`` (a flooding device is downsampled), only
numeric metrics with short names (at most ``MAX_KEYS``), and a retention period plus a row cap
per device (``prune``, run by the service every ``PRUNE_EVERY_S``).

Samples are stamped with the service's clock, not the device's ``ts`` (a device clock that is
wrong or forged cannot put rows in the future, where retention would never reach them).
"""

import json
import math
import time
import weakref
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent.fleet.database.store import Store

RETENTION_S = 7 * 86400.0
MAX_ROWS_PER_DEVICE = 20000
MIN_INTERVAL_S = 1.0
MAX_KEYS = 64
MAX_KEY_LEN = 64
PRUNE_EVERY_S = 60.0
_READY: "weakref.WeakValueDictionary[str, Store]" = weakref.WeakValueDictionary()

_DDL = (
    "CREATE TABLE IF NOT EXISTS telemetry_history (device_id TEXT NOT NULL, "
    "ts DOUBLE PRECISION NOT NULL, metrics TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS telemetry_history_dev ON telemetry_history (device_id, ts)",
    # The device page lists a device's last status changes (agent.fleet.web.views.status_history).
    "CREATE INDEX IF NOT EXISTS job_history_dev ON job_history (device_id, id)",
)


def ensure_schema(store: Store) -> None:
    if store.url in _READY and _READY[store.url] is store:
        return
    with store.transaction():
        if store.dialect == "postgresql":  # two services starting at once (as Store does)
            store.db.execute("SELECT pg_advisory_xact_lock(7216)")
        for stmt in _DDL:
            store.db.execute(stmt)
    _READY[store.url] = store


def numeric_metrics(metrics: Any) -> Dict[str, float]:
    """The plottable part of a telemetry ``metrics`` object: finite numbers under short keys."""
    out: Dict[str, float] = {}
    if not isinstance(metrics, Mapping):
        return out
    for key in sorted(metrics):
        value = metrics[key]
        if len(out) >= MAX_KEYS:
            break
        if (not isinstance(key, str) or len(key) > MAX_KEY_LEN or isinstance(value, bool)
                or not isinstance(value, (int, float)) or not math.isfinite(value)):
            continue
        out[key] = float(value)
    return out


class TelemetryHistory(object):
    """``record`` samples as the service receives them; ``series`` reads them back."""

    def __init__(self, store: Store, retention_s: float = RETENTION_S,
                 max_rows_per_device: int = MAX_ROWS_PER_DEVICE,
                 min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.store = store
        self.retention_s = float(retention_s)
        self.max_rows = max(1, int(max_rows_per_device))
        self.min_interval_s = float(min_interval_s)
        self._last: Dict[str, float] = {}  # device -> when its last sample was kept
        self._pruned = 0.0
        ensure_schema(store)

    def record(self, telemetry: Mapping[str, Mapping[str, Any]],
               now: Optional[float] = None) -> int:
        """Keep one sample per device (device -> telemetry message); returns rows written."""
        now = time.time() if now is None else now
        rows: List[Tuple[str, float, str]] = []
        for device, msg in sorted(telemetry.items()):
            if now - self._last.get(device, -1e18) < self.min_interval_s:
                continue
            values = numeric_metrics(msg.get("metrics") if isinstance(msg, Mapping) else None)
            if not values:
                continue
            self._last[device] = now
            rows.append((device, now, json.dumps(values, sort_keys=True)))
        self.store.db.executemany(
            "INSERT INTO telemetry_history (device_id, ts, metrics) VALUES (?, ?, ?)", rows)
        if now - self._pruned >= PRUNE_EVERY_S:
            self.prune(now)
        return len(rows)

    def prune(self, now: Optional[float] = None) -> int:
        """Drop samples older than the retention period and the oldest beyond the cap per
        device; returns how many rows were deleted."""
        now = time.time() if now is None else now
        self._pruned = now
        db = self.store.db
        deleted = 0
        with db.transaction():
            cur = db.execute("DELETE FROM telemetry_history WHERE ts < ?",
                             (now - self.retention_s,))
            deleted += max(0, cur.rowcount or 0)
            over = db.query("SELECT device_id FROM telemetry_history GROUP BY device_id "
                            "HAVING COUNT(*) > ?", (self.max_rows,))
            for (device,) in over:
                cur = db.execute(
                    "DELETE FROM telemetry_history WHERE device_id = ? AND ts <= (SELECT ts "
                    "FROM telemetry_history WHERE device_id = ? ORDER BY ts DESC LIMIT 1 "
                    "OFFSET ?)", (device, device, self.max_rows))
                deleted += max(0, cur.rowcount or 0)
        return deleted

    def series(self, device: str, since: Optional[float] = None, limit: int = 5000
               ) -> List[Tuple[float, Dict[str, float]]]:
        """(ts, metrics) of one device, oldest first: the newest ``limit`` samples."""
        return series(self.store, device, since, limit)


def series(store: Store, device: str, since: Optional[float] = None, limit: int = 5000
           ) -> List[Tuple[float, Dict[str, float]]]:
    ensure_schema(store)
    sql = "SELECT ts, metrics FROM telemetry_history WHERE device_id = ?"
    params: List[Any] = [device]
    if since is not None:
        sql += " AND ts >= ?"
        params.append(float(since))
    rows = store.db.query(sql + " ORDER BY ts DESC LIMIT ?", params + [max(1, int(limit))])
    return [(float(ts), json.loads(m)) for ts, m in reversed(rows)]


def count(store: Store, device: Optional[str] = None) -> int:
    ensure_schema(store)
    if device is None:
        return int(store.db.query("SELECT COUNT(*) FROM telemetry_history")[0][0])
    return int(store.db.query("SELECT COUNT(*) FROM telemetry_history WHERE device_id = ?",
                              (device,))[0][0])
