"""``fleet engines ls`` and ``fleet engines revoke SHA256``: the engines builders shared
(docs/fleet.md, "Engine sharing"), as data. ``revoke`` records the revocation (the service
never hands the engine out again) and sends ``revoke_engine`` to the adopters that list the
feature; a device of an earlier release is named with the ``fleet rollback`` that does the
same for it.
"""

import time
import uuid
from typing import Any, Callable, Dict, List

from agent.errors import AgentError
from agent.fleet.database import device_models
from agent.wire import protocol
from agent.wire.topics import TopicInfo

RECENT_ROLLOUTS = 200  # ls and revoke look at this many of the newest rollouts


def shared_engines(store: Any, limit: int = RECENT_ROLLOUTS) -> List[Dict[str, Any]]:
    """One row per builder upload: sha256, builder, class, rollout, state, why, adopters."""
    revoked = store.engine_revocations()
    out: List[Dict[str, Any]] = []
    for ro in store.rollouts(limit=limit):
        jobs = store.rollout_jobs(ro["rollout_id"])
        adopters: Dict[str, List[str]] = {}
        for job in jobs:
            share = job.get("share") or {}
            if share.get("role") == "adopting" and share.get("engine"):
                adopters.setdefault(str(share["engine"]), []).append(job["device"])
        for job in jobs:
            share = job.get("share") or {}
            if share.get("role") != "builder":
                continue
            refused = {str(r.get("sha256")): str(r.get("why") or "")
                       for r in share.get("refused") or [] if isinstance(r, dict)}
            for offer in share.get("offers") or []:
                sha = str(offer.get("sha256") or "")
                state, why = "awaiting the builder's report", ""
                if sha in revoked:
                    state, why = "revoked", str(revoked[sha].get("reason") or "")
                elif sha in refused:
                    state, why = "refused", refused[sha]
                elif share.get("judged"):
                    state = "accepted"
                out.append({"sha256": sha, "builder": job["device"],
                            "class": share.get("class"), "rollout": ro["rollout_id"],
                            "state": state, "why": why, "adopters": sorted(adopters.get(sha, []))})
    return out


def revoke(store: Any, sha256: str, reason: str, connect: Callable[[], Any], wait: float
           ) -> List[Dict[str, Any]]:
    """Revoke the engine fleet-wide and wait up to ``wait`` s for its adopters' replies: one
    row per adopter ({device, ok, replied, result, error}). ``store`` is closed by the
    caller; it is used before the broker is."""
    sha = str(sha256).lower()
    if not protocol.valid_sha256(sha):
        raise AgentError("bad_argument", "fleet engines revoke wants the engine's sha256 (64 "
                         "hex digits), found {!r}".format(str(sha256)[:80]))
    store.revoke_engine(sha, reason)
    devices = sorted({d for r in shared_engines(store) if r["sha256"] == sha
                      for d in r["adopters"]})
    conn = connect()
    replies: Dict[str, Dict[str, Any]] = {}
    requests: Dict[str, str] = {}  # request id -> device
    older: List[str] = []
    try:
        def on_message(info: TopicInfo, msg: Any) -> None:
            if info.kind == "command_reply" and requests.get(msg.get("request_id")) == \
                    info.device:
                replies[msg["request_id"]] = msg

        base = conn.topics.prefix + "/devices/+"
        conn.subscribe([base + "/commands/reply", base + "/status"])
        conn.settle(on_message)
        for dev in devices:
            # Capability-gated: a device of an earlier release would refuse the command.
            if "revoke_engine" not in device_models.features(conn.directory.status.get(dev)):
                older.append(dev)
                continue
            rid = "v" + uuid.uuid4().hex[:10]
            requests[rid] = dev
            conn.publish(conn.topics.commands(dev), protocol.encode({
                "protocol": protocol.PROTOCOL_VERSION, "command": "revoke_engine",
                "request_id": rid, "engine": sha}), qos=1)
        conn.flush()
        deadline = time.monotonic() + max(0.0, wait)
        while len(replies) < len(requests) and time.monotonic() < deadline:
            conn.pump(on_message, 0.2)
    finally:
        conn.close()
    out = [_row(dev, replies.get(rid)) for rid, dev in sorted(requests.items(),
                                                              key=lambda kv: kv[1])]
    out += [{"device": dev, "ok": False, "replied": False, "result": None,
             "error": {"code": "unsupported", "message": "an earlier release without "
                       "revoke_engine: use fleet rollback --device {}".format(dev)}}
            for dev in older]
    return out


def _row(device: str, reply: Any) -> Dict[str, Any]:
    versions = ((reply or {}).get("result") or {}).get("versions") or []
    # ok: the device answered and no version of it stays on the engine.
    return {"device": device, "ok": bool(reply and reply.get("ok")) and
            not any(v.get("error") for v in versions if isinstance(v, dict)),
            "replied": reply is not None, "result": (reply or {}).get("result"),
            "error": (reply or {}).get("error")}
