"""The fleet's source of truth: devices, rollouts, stages, per-device jobs and their status
history, artifacts, the signing sequence and the controller's outbox, in one database.

SQLite by default (embedded, zero set-up; WAL so the CLI reads while ``fleet serve`` writes),
PostgreSQL with ``postgresql://...`` (``pip install psycopg[binary]``) for large fleets and
several controllers. Both run the same SQL through ``Db``, a tiny adapter: ``?`` parameters and
``INSERT ... ON CONFLICT`` upserts. The tables are declared once in ``agent.fleet.database.tables``
and made by Alembic revisions (``agent.fleet.database.migrate``); opening checks the version in
plain SQL (``agent.fleet.database.store_schema``).

Read API (for the CLI and dashboards): ``devices``, ``device``, ``rollouts`` (a page, newest
first), ``rollout``, ``rollout_states`` (the few columns a service's tick reads),
``rollout_jobs``, ``job_history``, ``artifacts``, ``services``. Writes come from the service
(``agent.fleet.service``) and from ``fleet rollout`` / ``fleet rollouts`` (submit, control).
"""

import json
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from agent.errors import AgentError
from agent.fleet.database import store_schema
from agent.fleet.database.db import Db, Tx, default_db_url, redact

__all__ = ["ACTIVE", "Store", "default_db_url"]

ACTIVE = ("running", "paused")  # rollout states a service drives
_ROLLOUT_SELECT = ("SELECT rollout_id, spec, state, outcome, reason, current_stage, halted, "
                   "paused, created, deadline, updated, finished, owner, lease_until, control "
                   "FROM rollouts")


def _dumps(value: Any) -> Optional[str]:
    return None if value is None else json.dumps(value, sort_keys=True, default=str)


def _loads(text: Any) -> Any:
    return None if text is None else json.loads(text)


def _batches(ids: List[str], size: int = 500) -> Iterable[Tuple[List[str], str]]:
    """(ids, "?, ?, ...") of at most ``size`` ids: an ``IN`` list within any SQLite's limit."""
    for i in range(0, len(ids), size):
        yield ids[i:i + size], ", ".join("?" for _ in ids[i:i + size])


class Store(object):
    """The fleet database. ``Store(url)`` creates the tables of an empty database; ``schema``
    says what else opening may do to the schema (``agent.fleet.database.store_schema``: "upgrade",
    "require", "create", "read")."""

    def __init__(self, url: Optional[str] = None, schema: str = "create") -> None:
        self.url = url or default_db_url()
        self.db = Db(self.url)
        try:
            store_schema.ensure(self.db, self.url, schema)
        except BaseException:
            self.db.close()
            raise

    @property
    def dialect(self) -> str:
        return self.db.dialect

    def close(self) -> None:
        self.db.close()

    def transaction(self) -> Tx:
        return self.db.transaction()

    # -- devices ------------------------------------------------------------------------------

    def upsert_devices(self, statuses: Mapping[str, Mapping[str, Any]],
                       now: Optional[float] = None) -> None:
        """Device status messages (birth, Will, updates): online, boot, reason; the board and
        platform of the last birth are kept when a Will (which has none) follows."""
        now = time.time() if now is None else now
        rows = []
        for dev, msg in sorted(statuses.items()):
            plat = msg.get("platform") if isinstance(msg.get("platform"), dict) else None
            rows.append((dev, 1 if msg.get("online") else 0, msg.get("boot"),
                         (plat or {}).get("board"), _dumps(plat), _dumps(dict(msg)),
                         msg.get("reason"), now, now))
        self.db.executemany(
            "INSERT INTO devices (device_id, online, boot, board, platform, status, reason, "
            "first_seen, last_seen) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (device_id) "
            "DO UPDATE SET online = excluded.online, boot = excluded.boot, "
            "board = COALESCE(excluded.board, devices.board), "
            "platform = COALESCE(excluded.platform, devices.platform), "
            "status = excluded.status, reason = excluded.reason, last_seen = excluded.last_seen",
            rows)

    def touch_devices(self, telemetry: Mapping[str, Mapping[str, Any]],
                      now: Optional[float] = None) -> None:
        now = time.time() if now is None else now
        self.db.executemany(
            "UPDATE devices SET telemetry = ?, telemetry_ts = ?, last_seen = ? "
            "WHERE device_id = ?",
            [(_dumps(dict(m)), m.get("ts") if isinstance(m.get("ts"), (int, float)) else now,
              now, d) for d, m in sorted(telemetry.items())])

    def device_boots(self) -> Dict[str, int]:
        """device -> the boot of its last status: what a restarted controller knows already
        (its roll call reads the statuses of the others only)."""
        return {r[0]: r[1] for r in self.db.query("SELECT device_id, boot FROM devices")
                if isinstance(r[1], int)}

    def devices(self) -> List[Dict[str, Any]]:
        """Every admitted device ever heard of, sorted by id (no limit: the registry is the
        table); a device sent back to pending or rejected (agent.fleet.admission.admission) is left
        out."""
        rows = self.db.query("SELECT device_id, online, boot, board, platform, status, reason, "
                             "first_seen, last_seen, telemetry, telemetry_ts FROM devices "
                             "WHERE device_id NOT IN (SELECT device_id FROM device_keys WHERE "
                             "state IN ('pending', 'rejected', 'decommissioned')) ORDER BY "
                             "device_id")
        return [self._device(r) for r in rows]

    def device(self, device_id: str) -> Optional[Dict[str, Any]]:
        rows = self.db.query("SELECT device_id, online, boot, board, platform, status, reason, "
                             "first_seen, last_seen, telemetry, telemetry_ts FROM devices "
                             "WHERE device_id = ?", (device_id,))
        return self._device(rows[0]) if rows else None

    @staticmethod
    def _device(r: Sequence[Any]) -> Dict[str, Any]:
        status = _loads(r[5]) or {}
        platform = _loads(r[4])
        if platform and not status.get("platform"):
            status = dict(status, platform=platform)  # the last known board after a Will
        return {"device": r[0], "online": bool(r[1]), "boot": r[2], "board": r[3],
                "platform": platform, "status": status, "reason": r[6], "first_seen": r[7],
                "last_seen": r[8], "telemetry": _loads(r[9]), "telemetry_ts": r[10]}

    def statuses(self) -> Dict[str, Dict[str, Any]]:
        """device -> its last status message (with the last known platform)."""
        return {d["device"]: d["status"] for d in self.devices()}

    # -- admission (agent.fleet.admission.admission) -----------------------------------------------

    _KEY_COLUMNS = ("state", "key_id", "public_key", "pending_key_id", "pending_public_key",
                    "pending_since", "pending_status", "updated")

    def device_keys(self, state: Optional[str] = None, since: Optional[float] = None,
                    device: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
        """device -> its admission row (``state``: only those; ``since``: only rows written
        at or after that time, a refresh of what changed; ``device``: only its row)."""
        sql = "SELECT device_id, " + ", ".join(self._KEY_COLUMNS) + " FROM device_keys"
        where, params = [], []  # type: Tuple[List[str], List[Any]]
        if device is not None:
            where.append("device_id = ?")
            params.append(device)
        if state:
            where.append("state = ?")
            params.append(state)
        if since is not None:
            where.append("updated >= ?")
            params.append(float(since))
        rows = self.db.query(sql + (" WHERE " + " AND ".join(where) if where else ""), params)
        out = {}
        for r in rows:
            row = dict(zip(("device",) + self._KEY_COLUMNS, r))
            row["pending_status"] = _loads(row["pending_status"])
            out[r[0]] = row
        return out

    def device_key_ids(self) -> Set[str]:
        """The devices that have an admission row (which rows were deleted elsewhere)."""
        return {r[0] for r in self.db.query("SELECT device_id FROM device_keys")}

    def put_device_key(self, device: str, row: Mapping[str, Any]) -> None:
        values = [row.get(c) for c in self._KEY_COLUMNS]
        values[6] = _dumps(row.get("pending_status"))
        values[7] = time.time()
        cols = ", ".join(self._KEY_COLUMNS)
        self.db.execute("INSERT INTO device_keys (device_id, {}) VALUES (?, {}) ON CONFLICT "
                        "(device_id) DO UPDATE SET {}".format(
                            cols, ", ".join("?" for _ in self._KEY_COLUMNS),
                            ", ".join("{0} = excluded.{0}".format(c)
                                      for c in self._KEY_COLUMNS)), [device] + values)

    def pending_count(self) -> int:
        return int(self.db.query("SELECT COUNT(*) FROM device_keys WHERE state = 'pending'")
                   [0][0])

    def evict_oldest_pending(self) -> Optional[str]:
        rows = self.db.query("SELECT device_id FROM device_keys WHERE state = 'pending' ORDER "
                             "BY pending_since LIMIT 1")
        if not rows:
            return None
        self.db.execute("DELETE FROM device_keys WHERE device_id = ?", (rows[0][0],))
        return str(rows[0][0])

    def delete_device_key(self, device: str) -> None:
        self.db.execute("DELETE FROM device_keys WHERE device_id = ?", (device,))

    def seed_legacy_devices(self) -> None:
        """Once, when admission first runs on a database: every device already in the
        registry (a fleet of the previous release) becomes *legacy*: served as before."""
        with self.db.transaction():
            if self.db.query("SELECT 1 FROM meta WHERE key = 'admission_seeded'"):
                return
            now = time.time()
            self.db.execute("INSERT INTO device_keys (device_id, state, updated) SELECT "
                            "device_id, 'legacy', ? FROM devices WHERE device_id NOT IN "
                            "(SELECT device_id FROM device_keys)", (now,))
            self.db.execute("INSERT INTO meta (key, value) VALUES ('admission_seeded', ?) ON "
                            "CONFLICT (key) DO NOTHING", (str(now),))

    def legacy_window(self) -> Optional[float]:
        rows = self.db.query("SELECT value FROM meta WHERE key = 'legacy_trust_until'")
        return float(rows[0][0]) if rows else None

    def set_legacy_window(self, until: float) -> None:
        self.db.execute("INSERT INTO meta (key, value) VALUES ('legacy_trust_until', ?) ON "
                        "CONFLICT (key) DO UPDATE SET value = excluded.value", (str(until),))

    def revoke_engine(self, sha256: str, reason: str = "") -> None:
        """Engine sharing: ``fleet engines revoke`` (agent.fleet.transfer.sharing)."""
        self.db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO "
                        "UPDATE SET value = excluded.value",
                        ("engine_revoked:" + sha256, _dumps({"at": time.time(),
                                                             "reason": reason[:200]})))

    def engine_revocations(self) -> Dict[str, Dict[str, Any]]:
        rows = self.db.query("SELECT key, value FROM meta WHERE key LIKE ?",
                             ("engine_revoked:%",))
        return {k.split(":", 1)[1]: dict(_loads(v) or {}) for k, v in rows}
    # An admitted identity's record (agent.fleet.admission.identity_events): the keys seen for
    # a device, its impostor events, the operator's last look at it, a listed key's claim.
    # Rows of ``meta`` under a prefix, so no schema change.

    def meta_get(self, key: str) -> Any:
        rows = self.db.query("SELECT value FROM meta WHERE key = ?", (key,))
        return _loads(rows[0][0]) if rows else None

    def meta_put(self, key: str, value: Any) -> None:
        self.db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO "
                        "UPDATE SET value = excluded.value", (key, _dumps(value)))

    def meta_delete(self, key: str) -> None:
        self.db.execute("DELETE FROM meta WHERE key = ?", (key,))

    def meta_prefix(self, prefix: str) -> Dict[str, Any]:
        """key (without ``prefix``) -> value of every meta row under ``prefix``."""
        return {str(k)[len(prefix):]: _loads(v) for k, v in self.db.query(
            "SELECT key, value FROM meta WHERE key LIKE ?", (prefix + "%",))}

    def put_admission_counters(self, instance: str, counters: Mapping[str, int]) -> None:
        self.db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO "
                        "UPDATE SET value = excluded.value",
                        ("admission:" + instance, _dumps(dict(counters))))

    def admission_counters(self) -> Dict[str, int]:
        """The admission counters of every service instance, summed."""
        out: Dict[str, int] = {}
        for (value,) in self.db.query("SELECT value FROM meta WHERE key LIKE ?",
                                       ("admission:%",)):
            for k, v in (_loads(value) or {}).items():
                out[k] = out.get(k, 0) + int(v)
        return out

    # -- artifacts ----------------------------------------------------------------------------

    def add_artifact(self, sha256: str, size: int, path: str, name: Optional[str] = None
                     ) -> None:
        self.db.execute("INSERT INTO artifacts (sha256, size, name, path, added) VALUES "
                        "(?, ?, ?, ?, ?) ON CONFLICT (sha256) DO UPDATE SET path = "
                        "excluded.path", (sha256, int(size), name, path, time.time()))

    def artifacts(self) -> Dict[str, Dict[str, Any]]:
        rows = self.db.query("SELECT sha256, size, name, path, added FROM artifacts")
        return {r[0]: {"sha256": r[0], "size": r[1], "name": r[2], "path": r[3],
                       "added": r[4]} for r in rows}

    # -- signing sequence ---------------------------------------------------------------------

    def reserve_sequence(self, key_id: str, count: int, floor: int = 0) -> Tuple[int, int]:
        """Reserve ``count`` sequence numbers of ``key_id`` above every one handed out and at
        least ``floor``: returns (first, last). One transaction per block, not per job."""
        with self.db.transaction():
            rows = self.db.query("SELECT seq FROM signing_seq WHERE key_id = ?" + (
                " FOR UPDATE" if self.dialect == "postgresql" else ""), (key_id,))
            first = max((rows[0][0] if rows else 0) + 1, int(floor))
            last = first + max(1, int(count)) - 1
            self.db.execute("INSERT INTO signing_seq (key_id, seq) VALUES (?, ?) ON CONFLICT "
                            "(key_id) DO UPDATE SET seq = excluded.seq", (key_id, last))
        return first, last

    # -- rollouts -----------------------------------------------------------------------------

    def insert_rollout(self, rollout_id: str, spec: Mapping[str, Any],
                       stages: Sequence[Sequence[str]], deadline: float,
                       state: str = "running") -> None:
        """A new rollout with every device PENDING. AgentError bad_argument if the id exists."""
        now = time.time()
        with self.db.transaction():
            if self.db.query("SELECT 1 FROM rollouts WHERE rollout_id = ?", (rollout_id,)):
                raise AgentError("bad_argument", "rollout {} already exists (fleet rollouts "
                                 "show {}; choose another --rollout-id)".format(rollout_id,
                                                                                rollout_id))
            self.db.execute("INSERT INTO rollouts (rollout_id, spec, state, current_stage, "
                            "halted, paused, created, deadline, updated) VALUES "
                            "(?, ?, ?, -1, 0, 0, ?, ?, ?)",
                            (rollout_id, _dumps(dict(spec)), state, now, deadline, now))
            self.db.executemany("INSERT INTO stages (rollout_id, idx, devices) VALUES (?, ?, ?)",
                                [(rollout_id, i, _dumps(list(s))) for i, s in enumerate(stages)])
            self.db.executemany(
                "INSERT INTO jobs (rollout_id, device_id, stage, state, data, updated) VALUES "
                "(?, ?, ?, 'PENDING', '{}', ?)",
                [(rollout_id, d, i, now) for i, s in enumerate(stages) for d in s])
            # Created when committed: the service sees the row no earlier, and its first
            # document is timed from here (50,000 job rows take seconds to insert).
            now = time.time()
            self.db.execute("UPDATE rollouts SET created = ?, updated = ? WHERE rollout_id = ?",
                            (now, now, rollout_id))

    def busy_devices(self, devices: Iterable[str], exclude: Optional[str] = None
                     ) -> Dict[str, str]:
        """device -> the unfinished rollout it belongs to (for devices in ``devices``)."""
        wanted = set(devices)
        rows = self.db.query(
            "SELECT j.device_id, j.rollout_id, j.state FROM jobs j JOIN rollouts r ON "
            "r.rollout_id = j.rollout_id WHERE r.state IN ('running', 'paused')")
        terminal = ("SUCCEEDED", "FAILED", "REJECTED", "CANCELED", "TIMED_OUT")
        return {d: r for d, r, s in rows if d in wanted and r != exclude and s not in terminal}

    def rollouts(self, states: Optional[Sequence[str]] = None, limit: Optional[int] = None,
                 offset: int = 0) -> List[Dict[str, Any]]:
        """Rollouts, newest first (``states``: only those; ``limit``/``offset``: one page), with
        per-state device counts and stage progress: a few queries however many it lists."""
        sql, params = "", list(states or ())  # type: Tuple[str, List[Any]]
        if states is not None:
            if not states:
                return []
            sql = " WHERE state IN ({})".format(", ".join("?" for _ in states))
        sql += " ORDER BY created DESC, rollout_id"
        if limit is not None:
            sql += " LIMIT ? OFFSET ?"
            params += [max(0, int(limit)), max(0, int(offset))]
        return self._with_progress(self.db.query(_ROLLOUT_SELECT + sql, params))

    def rollout(self, rollout_id: str) -> Optional[Dict[str, Any]]:
        rows = self._with_progress(self.db.query(_ROLLOUT_SELECT + " WHERE rollout_id = ?",
                                                 (rollout_id,)))
        return rows[0] if rows else None

    def _with_progress(self, rows: Sequence[Sequence[Any]]) -> List[Dict[str, Any]]:
        """Rollout rows with their stages and job counts: two queries per 500 rollouts (the
        counts grouped in SQL), not per rollout."""
        stages: Dict[str, List[Any]] = {r[0]: [] for r in rows}
        counts: Dict[str, Dict[Tuple[int, str], int]] = {r[0]: {} for r in rows}
        for chunk, marks in _batches(list(stages)):
            for rid, devices in self.db.query(
                    "SELECT rollout_id, devices FROM stages WHERE rollout_id IN ({}) "
                    "ORDER BY rollout_id, idx".format(marks), chunk):
                stages[rid].append(_loads(devices))
            for rid, stage, state, n in self.db.query(
                    "SELECT rollout_id, stage, state, COUNT(*) FROM jobs WHERE rollout_id IN "
                    "({}) GROUP BY rollout_id, stage, state".format(marks), chunk):
                counts[rid][(int(stage), state)] = int(n)
        out = []
        for r in rows:
            total: Dict[str, int] = {}
            per_stage: List[Dict[str, int]] = [{} for _ in stages[r[0]]]
            for (stage, state), n in sorted(counts[r[0]].items()):
                total[state] = total.get(state, 0) + n
                if 0 <= stage < len(per_stage):
                    per_stage[stage][state] = n
            out.append({
                "rollout_id": r[0], "spec": _loads(r[1]), "state": r[2], "outcome": r[3],
                "reason": r[4], "current_stage": r[5], "halted": bool(r[6]),
                "paused": bool(r[7]), "created": r[8], "deadline": r[9], "updated": r[10],
                "finished": r[11], "owner": r[12], "lease_until": r[13], "control": r[14],
                "stages": stages[r[0]], "counts": total,
                "stage_progress": [{"stage": i + 1, "devices": len(s), "counts": per_stage[i]}
                                   for i, s in enumerate(stages[r[0]])]})
        return out

    def newest_rollout_created(self) -> Optional[float]:
        """The newest rollout's creation time (the rollouts_created index: one row read)."""
        rows = self.db.query("SELECT MAX(created) FROM rollouts")
        return rows[0][0] if rows and rows[0][0] is not None else None

    def rollout_states(self, ids: Iterable[str]) -> Dict[str, Dict[str, Any]]:
        """rollout id -> what a service decides on each tick (state, control, deadline,
        created, owner, lease_until): one light query, no spec, stages or jobs."""
        out: Dict[str, Dict[str, Any]] = {}
        for chunk, marks in _batches(sorted(set(ids))):
            for r in self.db.query(
                    "SELECT rollout_id, state, control, deadline, created, owner, lease_until "
                    "FROM rollouts WHERE rollout_id IN ({})".format(marks), chunk):
                out[r[0]] = {"rollout_id": r[0], "state": r[1], "control": r[2],
                             "deadline": r[3], "created": r[4], "owner": r[5],
                             "lease_until": r[6]}
        return out

    def rollout_job_states(self, rollout_id: str
                           ) -> Iterable[Tuple[str, str, Optional[Dict[str, Any]]]]:
        """(device, state, its DeviceRun fields or None when none were saved yet) of each job:
        what ``durable.load`` needs, one row at a time. A job still PENDING with nothing saved
        is as a new ``DeviceRun`` is, so not read (a new stage of 50,000 devices: no rows)."""
        for dev, state, data in self.db.query(
                "SELECT device_id, state, data FROM jobs WHERE rollout_id = ? AND NOT "
                "(state = 'PENDING' AND data = '{}')", (rollout_id,)):
            yield dev, state, (_loads(data) if data and data != "{}" else None)

    def rollout_jobs(self, rollout_id: str) -> List[Dict[str, Any]]:
        """Per-device jobs of a rollout in stage order: the ``DeviceRun`` fields."""
        rows = self.db.query("SELECT device_id, stage, state, data, updated FROM jobs WHERE "
                             "rollout_id = ?", (rollout_id,))
        out = []
        for dev, stage, state, data, updated in rows:
            item = dict(_loads(data) or {})
            item.update({"device": dev, "stage": stage, "state": state, "updated": updated})
            out.append(item)
        return out

    def save_rollout(self, rollout_id: str, fields: Mapping[str, Any],
                     jobs: Mapping[str, Tuple[int, str, Mapping[str, Any]]],
                     history: Sequence[Sequence[Any]] = (),
                     outbox: Sequence[Tuple[str, bytes, bool]] = (),
                     fence: Optional[Tuple[str, int, float]] = None) -> List[int]:
        """One atomic step of a rollout: its row, the changed jobs (device -> (stage, state,
        data)), new history rows and the messages to publish. Returns the outbox ids.
        ``fence`` (holder, epoch, lease_s): written only while that holder still holds the
        lease at that epoch (renewed here), else ``database.leases.LeaseLost`` and nothing
        is written."""
        from agent.fleet.database import leases

        now = time.time()
        ids: List[int] = []
        with self.db.transaction():
            if fence is not None:
                leases.fenced_renew(self.db, rollout_id, fence)
            if fields:
                cols = sorted(fields)
                self.db.execute("UPDATE rollouts SET {}, updated = ? WHERE rollout_id = ?".format(
                    ", ".join("{} = ?".format(c) for c in cols)),
                    [fields[c] for c in cols] + [now, rollout_id])
            self.db.executemany(
                "UPDATE jobs SET stage = ?, state = ?, data = ?, updated = ? WHERE "
                "rollout_id = ? AND device_id = ?",
                [(st, state, _dumps(dict(data)), now, rollout_id, dev)
                 for dev, (st, state, data) in sorted(jobs.items())])
            self.db.executemany(
                "INSERT INTO job_history (rollout_id, device_id, job_id, version, state, stage, "
                "ts, received) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [tuple(h) + (now,) for h in history])
            for topic, payload, retain in outbox:
                ids.append(self._outbox_insert(rollout_id, topic, payload, retain, now,
                                               fence[1] if fence is not None else None))
        return ids

    def _outbox_insert(self, rollout_id: Optional[str], topic: str, payload: bytes,
                       retain: bool, now: float, epoch: Optional[int] = None) -> int:
        sql = ("INSERT INTO outbox (rollout_id, topic, payload, retain, created, epoch) VALUES "
               "(?, ?, ?, ?, ?, ?)")
        params = (rollout_id, topic, bytes(payload), 1 if retain else 0, now, epoch)
        if self.dialect == "postgresql":
            return int(self.db.execute(sql + " RETURNING id", params).fetchone()[0])
        return int(self.db.execute(sql, params).lastrowid)

    def outbox(self, rollout_ids: Optional[Iterable[str]] = None
               ) -> List[Tuple[int, str, bytes, bool]]:
        rows = self.db.query("SELECT id, rollout_id, topic, payload, retain FROM outbox "
                             "ORDER BY id")
        keep = None if rollout_ids is None else set(rollout_ids)
        return [(int(i), t, bytes(p or b""), bool(r)) for i, rid, t, p, r in rows
                if keep is None or rid in keep]

    def outbox_of_finished(self) -> List[Tuple[int, str, bytes, bool]]:
        """Messages still owed for rollouts that ended (their last clears and cancels): no
        instance takes those rollouts over, so whoever starts sends them."""
        rows = self.db.query("SELECT o.id, o.topic, o.payload, o.retain FROM outbox o JOIN "
                             "rollouts r ON r.rollout_id = o.rollout_id WHERE r.state NOT IN "
                             "('running', 'paused') ORDER BY o.id")
        return [(int(i), t, bytes(p or b""), bool(r)) for i, t, p, r in rows]

    def outbox_done(self, rows: Sequence[Any], holder: Optional[str] = None) -> None:
        """Delete acknowledged outbox rows: ids, or (id, fence key) with ``holder``: a key
        (rollout id, epoch) deletes only where that rollout is still the holder's at that
        epoch or has finished (database.leases.outbox_delete_sql); the instance's own ("",
        generation), unconditionally."""
        keyed = [r for r in rows if isinstance(r, tuple)]
        plain = [(int(r),) for r in rows if not isinstance(r, tuple)] + [
            (int(i),) for i, key in keyed if not key[0]]
        fenced = [(int(i), key[0], holder, int(key[1])) for i, key in keyed if key[0]]
        from agent.fleet.database import leases

        with self.db.transaction():
            self.db.executemany("DELETE FROM outbox WHERE id = ?", plain)
            self.db.executemany(leases.outbox_delete_sql(), fenced)

    def job_history(self, rollout_id: str, device: Optional[str] = None
                    ) -> List[Dict[str, Any]]:
        sql = ("SELECT device_id, job_id, version, state, stage, ts, received FROM job_history "
               "WHERE rollout_id = ?")
        params: List[Any] = [rollout_id]
        if device is not None:
            sql += " AND device_id = ?"
            params.append(device)
        rows = self.db.query(sql + " ORDER BY id", params)
        return [{"device": r[0], "job_id": r[1], "version": r[2], "state": r[3],
                 "stage": r[4], "ts": r[5], "received": r[6]} for r in rows]

    def device_jobs(self, device: Optional[str] = None) -> List[Dict[str, Any]]:
        """Every per-device job (all rollouts), for ``fleet jobs``: no limit."""
        sql = ("SELECT j.rollout_id, j.device_id, j.state, j.data, j.updated FROM jobs j "
               "JOIN rollouts r ON r.rollout_id = j.rollout_id")
        params: List[Any] = []
        if device is not None:
            sql += " WHERE j.device_id = ?"
            params.append(device)
        rows = self.db.query(sql + " ORDER BY j.device_id, r.created", params)
        out = []
        for rid, dev, state, data, updated in rows:
            item = _loads(data) or {}
            out.append({"rollout_id": rid, "device": dev, "state": state,
                        "job_id": item.get("job_id") or rid, "phase": item.get("phase"),
                        "job_stage": item.get("job_stage"), "error": item.get("error"),
                        "updated": updated})
        return out

    # -- control and leases -------------------------------------------------------------------

    def request_control(self, rollout_id: str, control: str) -> Dict[str, Any]:
        """Ask the service driving a rollout to pause, resume or cancel it."""
        current = self.rollout(rollout_id)
        if current is None:
            raise AgentError("unknown_job", "no rollout {!r} in {}".format(
                rollout_id, redact(self.url)))
        if current["state"] not in ACTIVE:
            raise AgentError("bad_state_transition", "rollout {} is {} ({}); only running or "
                             "paused rollouts can be {}".format(
                                 rollout_id, current["state"], current["outcome"] or "-",
                                 {"pause": "paused", "resume": "resumed",
                                  "cancel": "cancelled"}[control]))
        self.db.execute("UPDATE rollouts SET control = ?, updated = ? WHERE rollout_id = ?",
                        (control, time.time(), rollout_id))
        return dict(current, control=control)

    def claim(self, instance: str, lease_s: float, now: Optional[float] = None,
              only: Optional[Iterable[str]] = None) -> List[str]:
        """Take (or renew) the lease of every active rollout that is free, expired or ours
        (``only``: of these ids). Returns the ids this instance drives now. ``now`` None: the
        database's clock (a service uses ``database.leases.claim``, with fencing epochs)."""
        if now is None:
            from agent.fleet.database.leases import db_now

            now = db_now(self.db)
        ids = None if only is None else sorted(only)
        if ids is not None and not ids:
            return []
        where = "" if ids is None else " AND rollout_id IN ({})".format(
            ", ".join("?" for _ in ids))
        with self.db.transaction():
            self.db.execute("UPDATE rollouts SET owner = ?, lease_until = ? WHERE state IN "
                            "('running', 'paused') AND (owner IS NULL OR owner = ? OR "
                            "lease_until < ?)" + where,
                            [instance, now + lease_s, instance, now] + (ids or []))
            rows = self.db.query("SELECT rollout_id FROM rollouts WHERE owner = ? AND state IN "
                                 "('running', 'paused') ORDER BY created", (instance,))
        return [r[0] for r in rows]

    def release(self, instance: str) -> None:
        self.db.execute("UPDATE rollouts SET owner = NULL, lease_until = NULL, lease_holder = "
                        "NULL WHERE owner = ?", (instance,))

    def forget_service(self, instance: str) -> None:
        """An instance that stopped for good (an embedded rollout's) is no running service."""
        self.db.execute("DELETE FROM services WHERE instance = ?", (instance,))

    def heartbeat(self, instance: str, pid: int, host: str, started: float,
                  boot_id: Optional[str] = None) -> None:
        """The service's row, its heartbeat on the database's clock (database.leases)."""
        from agent.fleet.database.leases import now_sql

        self.db.execute("INSERT INTO services (instance, heartbeat, pid, host, started, boot_id) "
                        "VALUES (?, {}, ?, ?, ?, ?) ON CONFLICT (instance) DO UPDATE SET "
                        "heartbeat = excluded.heartbeat, pid = excluded.pid, host = "
                        "excluded.host, started = excluded.started, boot_id = excluded.boot_id"
                        .format(now_sql(self.dialect)), (instance, pid, host, started, boot_id))

    def services(self, fresh_s: Optional[float] = None) -> List[Dict[str, Any]]:
        rows = self.db.query("SELECT instance, heartbeat, pid, host, started FROM services "
                             "ORDER BY instance")
        now = time.time()
        return [{"instance": r[0], "heartbeat": r[1], "pid": r[2], "host": r[3],
                 "started": r[4]} for r in rows
                if fresh_s is None or (r[1] or 0) >= now - fresh_s]
