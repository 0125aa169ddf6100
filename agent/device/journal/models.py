"""The journal's named models: per model name, the active version (``pending`` until the app
confirms it, then ``committed``) and the versions kept before it (``keep`` in all, the active
one included: the rollback targets), and the versions the app rejected on this device (never
activated again until an operator retries them). Functions over the journal's connection,
called under its lock (writes in its transactions). Rows are dicts: name, version, active,
state, model (sha256), engine_key, precision, activated, job_id, info, deadline, previous.
"""

import sqlite3
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent.device.journal.schema import dumps, loads

_COLUMNS = ("name, version, active, state, model_sha, engine_key, precision, activated, job_id, "
            "info, deadline, previous")
MAX_REJECTED_PER_NAME = 16  # the oldest rejections beyond this are forgotten
# A version rolled back because nobody answered in its commit window (no report, no commit,
# the daemon down) is ``unconfirmed``, not rejected: the app never judged it, so a job may
# activate it again. Marked by its reason's prefix (the table has no state column to add).
UNCONFIRMED = "unconfirmed"
UNCONFIRMED_PREFIX = UNCONFIRMED + ": "


def activate(db: sqlite3.Connection, name: str, version: str, model_sha: str, engine_key: str,
             precision: Optional[str], job_id: Optional[str], info: Mapping[str, Any],
             now: float, state: str, deadline: Optional[float], keep: int
             ) -> Tuple[Optional[Dict[str, Any]], List[str]]:
    """Make ``version`` the active version of ``name`` (``state`` pending or committed); the
    version it replaces stays kept (and is this one's ``previous``). Returns (the replaced
    active version or None, versions no longer kept: their directories go)."""
    current = active(db, name)
    previous = None
    if current is not None and current["version"] != version:
        previous = current["version"]
        db.execute("UPDATE models SET active = 0, deadline = NULL WHERE name = ? AND version = ?",
                   (name, previous))
    elif current is not None:
        previous = current["previous"]
    db.execute("INSERT OR REPLACE INTO models ({}) VALUES (?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
               .format(_COLUMNS), (name, version, state, model_sha, engine_key, precision, now,
                                   job_id, dumps(dict(info)), deadline, previous))
    # A pending version is not kept yet: pruning waits for its commit, so every version an
    # operator could roll back to before it came is still there if it is refused.
    dropped = [] if state == "pending" else _prune(db, name, keep)
    return (current if current is not None and current["version"] != version else None), dropped


def commit(db: sqlite3.Connection, name: str, version: str, keep: int) -> List[str]:
    """The pending active version committed; returns versions no longer kept."""
    db.execute("UPDATE models SET state = 'committed', deadline = NULL WHERE name = ? AND "
               "version = ? AND active = 1", (name, version))
    return _prune(db, name, keep)


def _prune(db: sqlite3.Connection, name: str, keep: int) -> List[str]:
    """The kept versions beyond ``keep`` (the active one included), oldest first, dropped."""
    dropped = []
    for row in [r for r in versions(db, name) if not r["active"]][max(0, keep - 1):]:
        db.execute("DELETE FROM models WHERE name = ? AND version = ?", (name, row["version"]))
        dropped.append(row["version"])
    return dropped


def restore(db: sqlite3.Connection, name: str, to_version: Optional[str], now: float,
            reject_reason: Optional[str]) -> Optional[Dict[str, Any]]:
    """Make the kept ``to_version`` active (committed) again (None: the name has no version
    left); the version active until now is dropped (and remembered as rejected with
    ``reject_reason`` when given). Returns the dropped active row (None if there was none)."""
    current = active(db, name)
    if current is not None and current["version"] != to_version:
        db.execute("DELETE FROM models WHERE name = ? AND version = ?",
                   (name, current["version"]))
        if reject_reason is not None:
            reject(db, name, current["version"], current["model"], reject_reason, now)
    if to_version is None:
        return current
    rest = [r for r in versions(db, name) if r["version"] != to_version]
    previous = rest[0]["version"] if rest else None
    db.execute("UPDATE models SET active = 1, state = 'committed', deadline = NULL, "
               "activated = ?, previous = ? WHERE name = ? AND version = ?",
               (now, previous, name, to_version))
    return current if current is not None and current["version"] != to_version else None


def expire(db: sqlite3.Connection, name: str, ver: str, reason: str) -> None:
    """A pending version about to be rolled back: its deadline set in the past (with the
    reason), so a daemon killed during the rollback finishes it on restart."""
    row = version(db, name, ver)
    if row is not None and row["state"] == "pending":
        info = dict(row["info"], rollback_reason=reason[:500])
        db.execute("UPDATE models SET deadline = 0, info = ? WHERE name = ? AND version = ?",
                   (dumps(info), name, ver))


def retry_pending(db: sqlite3.Connection, name: str, ver: str, deadline: float, retries: int,
                  reason: str) -> None:
    """A pending version nobody answered for: its commit window reopened (a new deadline), the
    count and the last silence in its info."""
    row = version(db, name, ver)
    if row is not None and row["state"] == "pending":
        info = dict(row["info"], unconfirmed_retries=retries, unconfirmed_reason=reason[:500])
        info.pop("rollback_reason", None)
        db.execute("UPDATE models SET deadline = ?, info = ? WHERE name = ? AND version = ?",
                   (deadline, dumps(info), name, ver))


def reject(db: sqlite3.Connection, name: str, version: str, model_sha: Optional[str],
           reason: str, now: float) -> None:
    db.execute("INSERT OR REPLACE INTO rejected_versions (name, version, model_sha, reason, at) "
               "VALUES (?, ?, ?, ?, ?)", (name, version, model_sha, reason[:500], now))
    db.execute("DELETE FROM rejected_versions WHERE name = ? AND version NOT IN (SELECT version "
               "FROM rejected_versions WHERE name = ? ORDER BY at DESC LIMIT ?)",
               (name, name, MAX_REJECTED_PER_NAME))


def forget_name(db: sqlite3.Connection, name: str) -> List[str]:
    """Every kept version of ``name`` forgotten (the model removed from the device); returns
    them. Its rejections stay: a version the app refused is not tried again if it returns."""
    gone = [r["version"] for r in versions(db, name)]
    db.execute("DELETE FROM models WHERE name = ?", (name,))
    return gone


def forget_rejected(db: sqlite3.Connection, name: str, version: str) -> bool:
    return db.execute("DELETE FROM rejected_versions WHERE name = ? AND version = ?",
                      (name, version)).rowcount > 0


def rejected(db: sqlite3.Connection, name: Optional[str] = None) -> List[Dict[str, Any]]:
    sql = "SELECT name, version, model_sha, reason, at FROM rejected_versions"
    args: Tuple[Any, ...] = ()
    if name is not None:
        sql, args = sql + " WHERE name = ?", (name,)
    return [{"name": r[0], "version": r[1], "model": r[2], "reason": r[3], "at": float(r[4]),
             "state": UNCONFIRMED if r[3].startswith(UNCONFIRMED_PREFIX) else "rejected"}
            for r in db.execute(sql + " ORDER BY name, at", args).fetchall()]


def active(db: sqlite3.Connection, name: str) -> Optional[Dict[str, Any]]:
    row = db.execute("SELECT {} FROM models WHERE name = ? AND active = 1".format(_COLUMNS),
                     (name,)).fetchone()
    return _row(row) if row else None


def version(db: sqlite3.Connection, name: str, ver: str) -> Optional[Dict[str, Any]]:
    row = db.execute("SELECT {} FROM models WHERE name = ? AND version = ?".format(_COLUMNS),
                     (name, ver)).fetchone()
    return _row(row) if row else None


def versions(db: sqlite3.Connection, name: str) -> List[Dict[str, Any]]:
    """Every kept version of ``name``: the active one first, then newest activation first."""
    return [_row(r) for r in db.execute(
        "SELECT {} FROM models WHERE name = ? ORDER BY active DESC, activated DESC, version"
        .format(_COLUMNS), (name,)).fetchall()]


def every_active(db: sqlite3.Connection) -> List[Dict[str, Any]]:
    """The active version of every name, oldest activation first."""
    return [_row(r) for r in db.execute(
        "SELECT {} FROM models WHERE active = 1 ORDER BY activated, name".format(_COLUMNS))
        .fetchall()]


def every(db: sqlite3.Connection) -> List[Dict[str, Any]]:
    return [_row(r) for r in db.execute(
        "SELECT {} FROM models ORDER BY name, active DESC, activated DESC".format(_COLUMNS))
        .fetchall()]


def by_model(db: sqlite3.Connection, model_sha: str) -> Optional[Dict[str, Any]]:
    """The active version of the name that holds model ``model_sha`` (today's rollback form):
    the derived name ``sha-<12 hex>`` first, else any active version of those bytes."""
    rows = [r for r in every_active(db) if r["model"] == model_sha]
    rows.sort(key=lambda r: r["name"] != "sha-" + model_sha[:12])
    return rows[0] if rows else None


def _row(r: Tuple[Any, ...]) -> Dict[str, Any]:
    return {"name": r[0], "version": r[1], "active": bool(r[2]), "state": r[3], "model": r[4],
            "engine_key": r[5], "precision": r[6], "activated": float(r[7]), "job_id": r[8],
            "info": loads(r[9]) or {}, "deadline": None if r[10] is None else float(r[10]),
            "previous": r[11]}
