"""The audit trail: one row per operator action (who, when, what, outcome), written by the two
places operators act through: the ``fleet`` CLI's dispatcher (``agent.cli.fleet_audit``) and the
dashboard's actions (``agent.fleet.web.server``). Commands added later are covered by those two
points, not by each command.

A row never holds a secret: callers pass the arguments worth keeping and ``clean_args`` drops
any whose name says token, password, secret or private key, and bounds the rest (sizes, count).
Bounded in time and count (``prune`` after every write: operator actions are rare, the deletes
use the primary key and the ``ts`` index). A database at a revision before the table reads as
an empty trail and records nothing (``exists``): the command itself still runs.
"""

import json
import time
from typing import Any, Dict, List, Mapping, Optional

from agent.fleet.database import store_schema
from agent.fleet.database.store import Store

RETENTION_S = 365 * 86400.0
MAX_ROWS = 100000
MAX_ARGS = 24  # arguments kept per action
MAX_TEXT = 200  # characters per value, actor, target and message
SECRET_WORDS = ("token", "password", "passwd", "secret", "private", "credential", "key_file",
                "signing_key")
OUTCOME_OK = "ok"


def exists(store: Store) -> bool:
    return "audit" in store_schema.table_names(store.db)


def _text(value: Any, limit: int = MAX_TEXT) -> str:
    s = "" if value is None else str(value)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def clean_args(args: Mapping[str, Any]) -> Dict[str, Any]:
    """The arguments worth recording: no secret, no empty value, each bounded."""
    out: Dict[str, Any] = {}
    for key in sorted(args):
        value = args[key]
        name = str(key).lower()
        if any(w in name for w in SECRET_WORDS) or value in (None, "", [], {}, False):
            continue
        if len(out) >= MAX_ARGS:
            break
        if isinstance(value, bool) or isinstance(value, (int, float)):
            out[_text(key, 64)] = value
        elif isinstance(value, (list, tuple)):
            out[_text(key, 64)] = [_text(v) for v in list(value)[:MAX_ARGS]]
        else:
            out[_text(key, 64)] = _text(value)
    return out


def record(store: Store, actor: str, via: str, action: str, target: Optional[str] = None,
           args: Optional[Mapping[str, Any]] = None, outcome: str = OUTCOME_OK,
           message: Optional[str] = None, now: Optional[float] = None,
           retention_s: float = RETENTION_S, max_rows: int = MAX_ROWS) -> bool:
    """Append one action; False when this database has no audit table yet."""
    if not exists(store):
        return False
    now = time.time() if now is None else now
    with store.transaction():
        store.db.execute(
            "INSERT INTO audit (ts, actor, via, action, target, args, outcome, message) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (now, _text(actor or "unknown"), _text(via, 32), _text(action, 64),
             None if target is None else _text(target),
             json.dumps(clean_args(args or {}), sort_keys=True), _text(outcome, 64),
             None if message is None else _text(message, 500)))
        prune(store, now, retention_s, max_rows)
    return True


def prune(store: Store, now: Optional[float] = None, retention_s: float = RETENTION_S,
          max_rows: int = MAX_ROWS) -> int:
    """Drop rows older than ``retention_s`` and the oldest beyond ``max_rows``."""
    now = time.time() if now is None else now
    cur = store.db.execute("DELETE FROM audit WHERE ts < ?", (now - retention_s,))
    deleted = max(0, cur.rowcount or 0)
    cur = store.db.execute("DELETE FROM audit WHERE id <= (SELECT id FROM audit ORDER BY id DESC "
                           "LIMIT 1 OFFSET ?)", (max(1, int(max_rows)),))
    return deleted + max(0, cur.rowcount or 0)


def rows(store: Store, since: Optional[float] = None, limit: int = 1000,
         newest_first: bool = False) -> List[Dict[str, Any]]:
    """The trail in the order the actions were recorded (``newest_first``: the last ``limit``
    ones, newest first, as a page shows them)."""
    if not exists(store):
        return []
    limit = max(1, min(int(limit), MAX_ROWS))
    found = store.db.query(
        "SELECT id, ts, actor, via, action, target, args, outcome, message FROM audit "
        "WHERE ts >= ? ORDER BY id DESC LIMIT ?", (-1.0 if since is None else since, limit))
    out = []
    for r in found:
        try:
            args = json.loads(r[6] or "{}")
        except ValueError:
            args = {}
        out.append({"id": int(r[0]), "ts": r[1], "actor": r[2], "via": r[3], "action": r[4],
                    "target": r[5], "args": args if isinstance(args, dict) else {},
                    "outcome": r[7], "message": r[8]})
    return out if newest_first else list(reversed(out))
