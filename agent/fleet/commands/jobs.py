"""``fleet jobs`` and ``fleet cancel``: the jobs retained on the broker or recorded in the
fleet database, and a job cancelled on its devices with each device's own final state
(bounded wait).
"""

import time
import uuid
from typing import Any, Callable, Dict, List, Optional

from agent import fleet
from agent.errors import AgentError
from agent.wire import protocol
from agent.wire.topics import TopicInfo


def retained_jobs(conn: fleet.FleetConnection) -> Dict[Any, Dict[str, Any]]:
    """(device, job id) -> {"status": last status or None, "document": pending doc or None}"""
    found: Dict[Any, Dict[str, Any]] = {}

    def on_message(info: TopicInfo, msg: Any) -> None:
        if info.kind == "job_status":
            entry = found.setdefault((info.device, info.job_id), {"status": None,
                                                                  "document": None})
            if entry["status"] is None or msg.get("version", 0) > entry["status"].get(
                    "version", 0):
                entry["status"] = msg
        elif info.kind == "job" and msg.payload:
            try:
                doc = protocol.decode("job", msg.payload)
            except AgentError:
                return
            entry = found.setdefault((info.device, info.job_id), {"status": None,
                                                                  "document": None})
            entry["document"] = doc

    base = conn.topics.prefix + "/devices/+"
    conn.subscribe([base + "/status", base + "/jobs/+", base + "/jobs/+/status"])
    conn.settle(on_message)
    return found


def _db_jobs(url: str) -> Dict[Any, Dict[str, Any]]:
    from agent.fleet.database.store import Store

    store = Store(url, schema="read")
    try:
        found: Dict[Any, Dict[str, Any]] = {}
        for j in store.device_jobs():
            found[(j["device"], j["job_id"])] = {"status": {
                "kind": j["phase"], "state": j["state"], "stage": j["job_stage"],
                "ts": j["updated"], "error": j["error"]}, "document": None}
        return found
    finally:
        store.close()


def jobs(url: Optional[str], connect: Callable[[], Any], only: Optional[List[str]] = None
         ) -> List[Dict[str, Any]]:
    """``fleet jobs``: one row per (device, job) from the database of ``fleet serve``
    (``url``: every per-device job of every rollout) or the broker (what it retains), only
    the devices in ``only`` when given."""
    if url:
        found = _db_jobs(url)
    else:
        conn = connect()
        try:
            found = retained_jobs(conn)
        finally:
            conn.close()
    rows = []
    for (dev, job_id), entry in sorted(found.items()):
        if only and dev not in only:
            continue
        st = entry["status"] or {}
        doc = entry["document"] or {}
        state = st.get("state") or "SENT"
        rows.append({"device": dev, "job_id": job_id, "kind": st.get("kind") or doc.get("kind"),
                     "state": state, "stage": None if protocol.is_terminal(state) else
                     st.get("stage"),  # a finished job's last stage (activating) is past
                     "version": st.get("version"), "updated": st.get("ts"),
                     "error": st.get("error"), "pending_document": bool(entry["document"])})
    return rows


def cancel(connect: Callable[[], Any], job_id: str, devices: Optional[List[str]], wait: float
           ) -> List[Dict[str, Any]]:
    """Clear the job's retained documents, send cancel commands and wait up to ``wait`` s for
    each device's own final job state: one row per (device, job) ({device, job_id,
    document_cleared, reply, online, final_state, last_state, outcome})."""
    conn = connect()
    try:
        found = retained_jobs(conn)
        known = conn.directory.known()
        if devices:
            fleet.select_devices(known, devices)
        ids = (job_id, job_id + fleet.SEARCH_SUFFIX)
        targets: Dict[Any, Dict[str, Any]] = {}
        for (dev, job_id), entry in found.items():
            if job_id not in ids or (devices and dev not in devices):
                continue
            st = entry["status"]
            if entry["document"] or st is None or not protocol.is_terminal(st.get("state", "")):
                targets[(dev, job_id)] = entry
        if devices:
            for dev in devices:
                if not any(d == dev for d, _ in targets):
                    targets[(dev, job_id)] = {"status": None, "document": None}
        if not targets:
            raise AgentError("unknown_job", "no device has an unfinished job {!r} (nothing "
                             "retained on the broker under {}/)".format(job_id,
                                                                        conn.topics.prefix))
        replies: Dict[str, Dict[str, Any]] = {}
        requests: Dict[str, Any] = {}
        final: Dict[Any, Dict[str, Any]] = {}  # (device, job) -> its own terminal status
        last: Dict[Any, Dict[str, Any]] = {}

        def on_message(info: TopicInfo, msg: Any) -> None:
            if info.kind == "command_reply" and msg.get("request_id") in requests:
                replies[msg["request_id"]] = msg
            elif info.kind == "job_status" and (info.device, info.job_id) in targets:
                key = (info.device, info.job_id)
                if int(msg.get("version") or 0) > int((last.get(key) or {}).get("version")
                                                      or 0):
                    last[key] = msg
                    if protocol.is_terminal(str(msg.get("state"))):
                        final[key] = msg

        conn.subscribe([conn.topics.prefix + "/devices/+/commands/reply"])
        conn.settle(on_message)
        for key, entry in targets.items():
            if entry["status"]:
                last[key] = entry["status"]
        for (dev, job_id), entry in sorted(targets.items()):
            if entry["document"]:
                conn.publish(conn.topics.job(dev, job_id), b"", qos=1, retain=True)
            rid = "c" + uuid.uuid4().hex[:10]
            requests[rid] = (dev, job_id)
            conn.publish(conn.topics.commands(dev), protocol.encode({
                "protocol": protocol.PROTOCOL_VERSION, "command": "cancel", "request_id": rid,
                "job_id": job_id}), qos=1)
        conn.flush()
        # The device's reply only says the cancel was taken; its job status says when the
        # job really stopped (a build may take seconds to end): wait for that, bounded.
        deadline = time.monotonic() + max(0.0, wait)

        def answered(rid: str) -> bool:
            reply = replies.get(rid)
            if reply is None:
                return False
            return not reply.get("ok") or requests[rid] in final

        while not all(answered(rid) for rid in requests) and time.monotonic() < deadline:
            conn.pump(on_message, 0.2)
    finally:
        conn.close()
    out = []
    for rid, (dev, job_id) in sorted(requests.items(), key=lambda kv: kv[1]):
        reply = replies.get(rid)
        entry = targets[(dev, job_id)]
        fin = final.get((dev, job_id))
        out.append({"device": dev, "job_id": job_id,
                    "document_cleared": bool(entry["document"]),
                    "reply": reply, "online": (conn.directory.status.get(dev) or {}).get(
                        "online"),
                    "final_state": fin.get("state") if fin else None,
                    "last_state": (last.get((dev, job_id)) or {}).get("state"),
                    "outcome": _cancel_outcome(reply, fin)})
    return out


def _cancel_outcome(reply: Optional[Dict[str, Any]], final: Optional[Dict[str, Any]]) -> str:
    """no_reply | refused | cancelled | finished (before the cancel) | requested (no final
    state from the device in time)."""
    if reply is None:
        return "no_reply"
    if not reply.get("ok"):
        return "refused"
    if final is None:
        return "requested"
    return "cancelled" if final.get("state") == "CANCELED" else "finished"
