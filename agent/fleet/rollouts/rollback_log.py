"""Rollbacks the controller sent, and what the devices answered, kept in the fleet database
(table ``rollbacks``) against the rollout they undo: ``fleet rollback`` and the dashboard's
button record each command (``record``); the reply (from the waiting CLI, or from ``fleet
serve``, which hears every command reply) completes it (``on_reply``). The views read them per
rollout (``of_rollouts``: one query per page) and per device (``of_device``), so a rolled-back
rollout shows it, and a refused rollback shows the device's reason.
"""

import json
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from agent.fleet.rollouts.rollout import SEARCH_SUFFIX
from agent.wire import model_names

_COLUMNS = ("request_id, rollout_id, device_id, model, name, version, sent, replied, ok, "
            "error_code, error_message, result, origin")
MAX_TEXT = 1024  # a device's error message, as stored


def record(store: Any, items: Sequence[Mapping[str, Any]], now: Optional[float] = None
           ) -> None:
    """Commands just sent: each {request_id, device, rollout_id?, model?, name?, version?,
    origin?} ("cli" or "dashboard")."""
    now = time.time() if now is None else now
    store.db.executemany(
        "INSERT INTO rollbacks (request_id, rollout_id, device_id, model, name, version, sent, "
        "origin) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (request_id) DO NOTHING",
        [(i["request_id"], i.get("rollout_id"), i["device"], i.get("model"), i.get("name"),
          i.get("version"), now, i.get("origin") or "cli") for i in items])


def on_reply(store: Any, device: str, reply: Mapping[str, Any],
             now: Optional[float] = None) -> bool:
    """A device's command reply: completes the rollback it answers (same request id and
    device; the first reply wins). False when it answers no recorded rollback."""
    rid = reply.get("request_id")
    if not isinstance(rid, str) or reply.get("command") not in (None, "rollback"):
        return False
    err: Mapping[str, Any] = reply["error"] if isinstance(reply.get("error"), Mapping) else {}
    result = reply.get("result") if isinstance(reply.get("result"), Mapping) else None
    cur = store.db.execute(
        "UPDATE rollbacks SET replied = ?, ok = ?, error_code = ?, error_message = ?, "
        "result = ? WHERE request_id = ? AND device_id = ? AND replied IS NULL",
        (time.time() if now is None else now, 1 if reply.get("ok") else 0,
         str(err.get("code"))[:64] if err.get("code") else None,
         str(err.get("message"))[:MAX_TEXT] if err.get("message") else None,
         json.dumps(result, sort_keys=True, default=str)[:8192] if result else None,
         rid, device))
    return bool(getattr(cur, "rowcount", 0))


def rollout_for(store: Any, device: str, name: Optional[str] = None,
                sha: Optional[str] = None, job_id: Optional[str] = None) -> Optional[str]:
    """The rollout a rollback of ``device`` undoes: the one whose job ``job_id`` activated the
    engine, else the newest that succeeded there with this model name (or sha256)."""
    if job_id:
        rid = job_id[:-len(SEARCH_SUFFIX)] if job_id.endswith(SEARCH_SUFFIX) else job_id
        if store.db.query("SELECT 1 FROM jobs WHERE rollout_id = ? AND device_id = ?",
                          (rid, device)):
            return rid
    if not name and not sha:
        return None
    rows = store.db.query("SELECT j.rollout_id, r.spec FROM jobs j JOIN rollouts r ON "
                          "r.rollout_id = j.rollout_id WHERE j.device_id = ? AND j.state = "
                          "'SUCCEEDED' ORDER BY r.created DESC", (device,))
    for rid, spec_text in rows:
        spec = json.loads(spec_text) if spec_text else {}
        model = ((spec.get("artifacts") or {}).get("model") or {}).get("sha256")
        given = spec.get("model_name") or (model_names.derived_name(model)
                                           if isinstance(model, str) and len(model) == 64
                                           else None)  # the name devices give it
        if (name and given == name) or (sha and not name and model == sha):
            return str(rid)
    return None


def _row(r: Sequence[Any]) -> Dict[str, Any]:
    ok = None if r[8] is None else bool(r[8])
    return {"request_id": r[0], "rollout_id": r[1], "device": r[2], "model": r[3],
            "name": r[4], "version": r[5], "sent": r[6], "replied": r[7], "ok": ok,
            "error_code": r[9], "error_message": r[10],
            "result": json.loads(r[11]) if r[11] else None, "origin": r[12],
            "outcome": outcome_text(ok, r[7], r[9], r[10])}


def outcome_text(ok: Optional[bool], replied: Any, code: Any, message: Any) -> str:
    if replied is None:
        return "sent, no reply yet"
    if ok:
        return "rolled back"
    return "refused: {}{}".format(code or "error", ": " + str(message) if message else "")


def of_rollouts(store: Any, rollout_ids: Sequence[str]) -> Dict[str, List[Dict[str, Any]]]:
    """rollout id -> its rollbacks, oldest first: one query per 500 rollouts."""
    out: Dict[str, List[Dict[str, Any]]] = {r: [] for r in rollout_ids}
    ids = sorted(set(rollout_ids))
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        for r in store.db.query("SELECT {} FROM rollbacks WHERE rollout_id IN ({}) ORDER BY "
                                "sent, request_id".format(_COLUMNS, ", ".join(
                                    "?" for _ in chunk)), chunk):
            out[r[1]].append(_row(r))
    return out


def of_device(store: Any, device: str, limit: int = 20) -> List[Dict[str, Any]]:
    """The device's last ``limit`` rollbacks, newest first."""
    return [_row(r) for r in store.db.query(
        "SELECT {} FROM rollbacks WHERE device_id = ? ORDER BY sent DESC, request_id LIMIT ?"
        .format(_COLUMNS), (device, max(1, int(limit))))]


def summary(rows: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Of a rollout's rollbacks: devices rolled back, refused (the last answer of each
    device counts), waiting for a reply."""
    last: Dict[str, Mapping[str, Any]] = {}
    for r in rows:
        last[str(r["device"])] = r
    done = sorted(d for d, r in last.items() if r["ok"])
    refused = sorted(d for d, r in last.items() if r["replied"] is not None and not r["ok"])
    waiting = sorted(d for d, r in last.items() if r["replied"] is None)
    return {"rolled_back": done, "refused": refused, "waiting": waiting}
