"""``fleet rollback``: which devices get which rollback command (``targets``), and the round
trip (``run``): record the rollbacks against the rollouts they undo, pin a device a deployment
governs, publish, wait for the replies and settle the records. The commands themselves and the
per-device plan are agent.fleet.rollouts.rollback's (pure; the dashboard's button uses them
too).
"""

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional

from agent.errors import AgentError
from agent.fleet.database import device_models
from agent.fleet.rollouts import rollback_log
from agent.fleet.rollouts.rollback import check_sha, command, plan_one
from agent.wire import model_names, protocol
from agent.wire.topics import TopicInfo


@dataclass
class Request:
    """What the operator asked: per device (``devices``) or per rollout (``rollout``: its
    devices that succeeded, restricted to ``devices`` when given), by ``name`` (and a kept
    ``version``) or by the ``model``'s sha256."""
    devices: List[str] = field(default_factory=list)
    rollout: Optional[str] = None
    name: Optional[str] = None
    version: Optional[str] = None
    model: Optional[str] = None
    wait: float = 10.0
    reason: Optional[str] = None

    def check(self) -> None:
        if not self.devices and not self.rollout:
            raise AgentError("bad_argument", "fleet rollback needs --device ID (repeatable) "
                             "or --rollout ID")


def targets(req: Request, statuses: Mapping[str, Dict[str, Any]],
            models: Optional[Mapping[str, Dict[str, Any]]] = None, store: Any = None
            ) -> List[Dict[str, Any]]:
    """What to send: {device, name, version, model, rollout_id} per device."""
    models = models or {}
    name = model_names.validate_name(req.name) if req.name else None
    version = req.version
    if version is not None:
        if name is None:
            raise AgentError("bad_argument", "--version names a kept version of a model: "
                             "expected --name NAME with it, found none")
        model_names.validate_version(version)
    given = check_sha(req.model) if req.model else None
    if req.rollout:
        return _rollout_targets(req, statuses, models, store, name, given)
    out = []
    for dev in req.devices:
        protocol.check_id("device", dev)
        st, rid, hint = statuses.get(dev), None, None
        if store is not None and (name or given):
            rid = rollback_log.rollout_for(store, dev, name, given)
            row = store.rollout(rid) if rid and not device_models.named(st) else None
            hint = (((row or {}).get("spec") or {}).get("artifacts", {}).get("model") or
                    {}).get("sha256")  # an older device: the sha256 that name deployed
        plan = plan_one(dev, st, models.get(dev), name, version, given, hint)
        if store is not None and rid is None:
            rid = rollback_log.rollout_for(store, dev, plan["name"], plan["model"])
        out.append(dict(plan, rollout_id=rid))
    return out


def _rollout_targets(req: Request, statuses: Mapping[str, Dict[str, Any]],
                     models: Mapping[str, Dict[str, Any]], store: Any, name: Optional[str],
                     given: Optional[str]) -> List[Dict[str, Any]]:
    row = store.rollout(req.rollout) if store is not None else None
    if row is None:
        raise AgentError("unknown_job", "no rollout {!r} in the fleet database".format(
            req.rollout))
    spec = row["spec"] or {}
    sha = ((spec.get("artifacts") or {}).get("model") or {}).get("sha256")
    done = [j["device"] for j in store.rollout_jobs(req.rollout) if j["state"] == "SUCCEEDED"]
    chosen = sorted(d for d in done if not req.devices or d in req.devices)
    if not chosen:
        raise AgentError("unknown_device", "no device of rollout {} succeeded{}: nothing to "
                         "roll back".format(req.rollout, " among " + ", ".join(
                             req.devices) if req.devices else ""))
    rollout_name = name or spec.get("model_name") or (model_names.derived_name(sha)
                                                      if sha else None)
    out = []
    for dev in chosen:
        st = statuses.get(dev)
        plan = plan_one(dev, st, models.get(dev),
                        rollout_name if device_models.named(st) else name, req.version,
                        given, sha)
        out.append(dict(plan, rollout_id=req.rollout))
    return out


def run(req: Request, connect: Callable[[], Any], store: Any = None, hold: Any = None
        ) -> List[Dict[str, Any]]:
    """Send the rollbacks and wait up to ``req.wait`` s for the replies: one result per
    device, sorted ({device, model, name, version, rollout_id, request_id, ok, result, error,
    replied, pinned_by}). ``store``: the fleet database to record in (or None). ``hold``:
    (pin, settle) of agent.fleet.deployments.pins: a rollback of a model a deployment governs
    becomes a pin (recorded before the command leaves, so the deployment never sends its
    version back in between), settled by the device's reply."""
    req.check()
    if store is not None and req.rollout and store.rollout(req.rollout) is None:
        raise AgentError("unknown_job", "no rollout {!r} in the fleet database".format(
            req.rollout))
    conn = connect()
    pinned: Dict[str, str] = {}  # request id -> the deployment its pin holds the device from
    replies: Dict[str, Dict[str, Any]] = {}
    requests: Dict[str, Dict[str, Any]] = {}
    try:
        def on_message(info: TopicInfo, msg: Any) -> None:
            if info.kind == "command_reply" and msg.get("request_id") in requests and \
                    requests[msg["request_id"]]["device"] == info.device:
                replies[msg["request_id"]] = msg

        base = conn.topics.prefix + "/devices/+"
        conn.subscribe([base + "/commands/reply", base + "/status", base + "/models"])
        conn.settle(on_message)
        for t in targets(req, conn.directory.status, conn.directory.models, store):
            rid = "r" + uuid.uuid4().hex[:10]
            requests[rid] = dict(t, request_id=rid)
        if store is not None:  # before the commands leave: a fast reply finds its record
            rollback_log.record(store, list(requests.values()))
            if hold:
                pinned = hold[0](store, list(requests.values()), req.reason)
        for rid, t in requests.items():
            conn.publish(conn.topics.commands(t["device"]), protocol.encode(command(
                t["model"], rid, t["name"], t["version"])), qos=1)
        conn.flush()
        deadline = time.monotonic() + max(0.0, req.wait)
        while len(replies) < len(requests) and time.monotonic() < deadline:
            conn.pump(on_message, 0.2)
    finally:
        conn.close()
    if store is not None:
        for rid, answer in replies.items():
            rollback_log.on_reply(store, requests[rid]["device"], answer)
            if rid in pinned and hold:  # the version it went back to, or no pin (refused)
                hold[1](store, requests[rid]["device"], answer)
    out: List[Dict[str, Any]] = []
    for rid, t in sorted(requests.items(), key=lambda kv: kv[1]["device"]):
        reply = replies.get(rid)
        out.append({"device": t["device"], "model": t["model"], "name": t["name"],
                    "version": t["version"], "rollout_id": t["rollout_id"],
                    "request_id": rid, "ok": bool(reply and reply.get("ok")),
                    "result": (reply or {}).get("result"), "error": (reply or {}).get("error"),
                    "replied": reply is not None, "pinned_by": pinned.get(rid)})
    return out
