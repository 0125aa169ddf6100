"""The journal's engine slots: per model, the active engine and the one it replaced (kept for
``rollback``). Functions over the journal's connection, called under its lock (writes in its
transactions).
"""

import sqlite3
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent.device.journal_schema import dumps, loads

_COLUMNS = "model_sha, engine_key, precision, activated, job_id, info"


def activate(db: sqlite3.Connection, model_sha: str, engine_key: str, precision: Optional[str],
             job_id: Optional[str], info: Optional[Mapping[str, Any]], now: float
             ) -> Optional[Dict[str, Any]]:
    """Make ``engine_key`` the active engine of a model; the engine it replaces becomes the
    previous one (for rollback). Returns the previous engine (None if none).
    Re-activating the active engine only refreshes its time, job and info."""
    current = engine(db, model_sha, "active")
    if current is not None and current["engine_key"] == engine_key:
        db.execute("UPDATE engines SET precision = ?, activated = ?, job_id = ?, "
                   "info = ? WHERE model_sha = ? AND slot = 'active'",
                   (precision, now, job_id, dumps(info or {}), model_sha))
        return engine(db, model_sha, "previous")
    if current is not None:
        db.execute("DELETE FROM engines WHERE model_sha = ? AND slot = 'previous'",
                   (model_sha,))
        db.execute("UPDATE engines SET slot = 'previous' WHERE model_sha = ? AND "
                   "slot = 'active'", (model_sha,))
    db.execute("INSERT INTO engines (model_sha, slot, engine_key, precision, activated, "
               "job_id, info) VALUES (?, 'active', ?, ?, ?, ?, ?)",
               (model_sha, engine_key, precision, now, job_id, dumps(info or {})))
    return current


def rollback(db: sqlite3.Connection, model_sha: str, now: float) -> Optional[Dict[str, Any]]:
    """Make the previous engine active again (the current one is dropped); returns the
    restored engine, or None (nothing changes) when there is no previous one."""
    previous = engine(db, model_sha, "previous")
    if previous is None:
        return None
    db.execute("DELETE FROM engines WHERE model_sha = ? AND slot = 'active'", (model_sha,))
    db.execute("UPDATE engines SET slot = 'active', activated = ? WHERE model_sha = ? "
               "AND slot = 'previous'", (now, model_sha))
    return engine(db, model_sha, "active")


def engine(db: sqlite3.Connection, model_sha: str, slot: str) -> Optional[Dict[str, Any]]:
    row = db.execute("SELECT {} FROM engines WHERE model_sha = ? AND slot = ?".format(_COLUMNS),
                     (model_sha, slot)).fetchone()
    return _row(row) if row else None


def active(db: sqlite3.Connection) -> List[Dict[str, Any]]:
    """Active engine of every model: model, engine_key, precision, activated, job_id, info;
    oldest activation first."""
    return [_row(r) for r in db.execute(
        "SELECT {} FROM engines WHERE slot = 'active' ORDER BY activated, model_sha".format(
            _COLUMNS)).fetchall()]


def _row(r: Tuple[Any, ...]) -> Dict[str, Any]:
    return {"model": r[0], "engine_key": r[1], "precision": r[2], "activated": float(r[3]),
            "job_id": r[4], "info": loads(r[5]) or {}}
