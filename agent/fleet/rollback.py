"""``fleet rollback``: make devices go back to the previous engine of a model (the device's
journal keeps the active and the previous engine of every model; the ``rollback`` device
command swaps them). Per device (the model defaults to the device's one active engine, from
its retained status) or per rollout (every device of a rollout in the fleet database, the
rollout's model). ``send`` is also what the dashboard's rollback button calls.
"""

import argparse
import json
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from agent.errors import AgentError
from agent.wire import protocol
from agent.wire.topics import TopicInfo

EXIT_OK, EXIT_FAILED = 0, 1


def command(model: str, request_id: Optional[str] = None) -> Dict[str, Any]:
    return {"protocol": protocol.PROTOCOL_VERSION, "command": "rollback",
            "request_id": request_id or "r" + uuid.uuid4().hex[:10], "model": model}


def send(conn: Any, device: str, model: str) -> str:
    """Publish the command (QoS 1: kept for an offline device's session); its request id."""
    protocol.check_id("device", device)
    cmd = command(model)
    conn.client.publish(conn.topics.commands(device), protocol.encode(cmd), qos=1)
    return str(cmd["request_id"])


def _check_sha(model: str) -> str:
    if not protocol.valid_sha256(model):
        raise AgentError("bad_argument", "--model wants the model's sha256 (64 lower-case hex "
                         "digits), found {!r}".format(model[:80]))
    return model


def targets(args: argparse.Namespace, statuses: Dict[str, Dict[str, Any]]
            ) -> List[Tuple[str, str]]:
    """(device, model sha256) pairs to roll back."""
    if args.rollout:
        from agent.cli.fleet_db import db_url
        from agent.fleet.store import Store

        store = Store(db_url(args, existing=True))
        try:
            row = store.rollout(args.rollout)
            if row is None:
                raise AgentError("unknown_job", "no rollout {!r} in the fleet database".format(
                    args.rollout))
            model = _check_sha(args.model or ((row["spec"] or {}).get("artifacts", {}).get(
                "model") or {}).get("sha256", ""))
            done = [j["device"] for j in store.rollout_jobs(args.rollout)
                    if j["state"] == "SUCCEEDED"]
        finally:
            store.close()
        chosen = [d for d in done if not args.device or d in args.device]
        if not chosen:
            raise AgentError("unknown_device", "no device of rollout {} succeeded{}: nothing to "
                             "roll back".format(args.rollout, " among " + ", ".join(
                                 args.device) if args.device else ""))
        return [(d, model) for d in sorted(chosen)]
    out = []
    for dev in args.device:
        protocol.check_id("device", dev)
        if args.model:
            out.append((dev, _check_sha(args.model)))
            continue
        st = statuses.get(dev)
        if st is None:
            raise AgentError("unknown_device", "device {} has no retained status on the broker; "
                             "give --model SHA256".format(dev))
        models = sorted({str(e["model"]) for e in st.get("active_engines") or []
                         if isinstance(e, dict) and e.get("model")})
        if len(models) != 1:
            raise AgentError("bad_argument", "device {} has {} active engines ({}); choose one "
                             "with --model SHA256".format(dev, len(models), ", ".join(
                                 m[:12] for m in models) or "none"))
        out.append((dev, models[0]))
    return out


def run(args: argparse.Namespace, connect: Any) -> int:
    if not args.device and not args.rollout:
        raise AgentError("bad_argument", "fleet rollback needs --device ID (repeatable) or "
                         "--rollout ID")
    conn = connect(args)
    replies: Dict[str, Dict[str, Any]] = {}
    requests: Dict[str, Tuple[str, str]] = {}
    try:
        def on_message(info: TopicInfo, msg: Any) -> None:
            if info.kind == "command_reply" and msg.get("request_id") in requests:
                replies[msg["request_id"]] = msg

        conn.subscribe([conn.topics.prefix + "/devices/+/commands/reply",
                        conn.topics.prefix + "/devices/+/status"])  # active engines
        conn.settle(on_message)
        for dev, model in targets(args, conn.directory.status):
            rid = "r" + uuid.uuid4().hex[:10]
            requests[rid] = (dev, model)
            conn.publish(conn.topics.commands(dev), protocol.encode(command(model, rid)), qos=1)
        conn.flush()
        deadline = time.monotonic() + max(0.0, args.wait)
        while len(replies) < len(requests) and time.monotonic() < deadline:
            conn.pump(on_message, 0.2)
    finally:
        conn.close()
    out: List[Dict[str, Any]] = []
    for rid, (dev, model) in sorted(requests.items(), key=lambda kv: kv[1]):
        reply = replies.get(rid)
        out.append({"device": dev, "model": model, "request_id": rid, "ok": bool(
            reply and reply.get("ok")), "result": (reply or {}).get("result"),
            "error": (reply or {}).get("error"), "replied": reply is not None})
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        for r in out:
            if not r["replied"]:
                what = "no reply in {:g} s (an offline device gets the command when it " \
                       "reconnects)".format(args.wait)
            elif r["ok"]:
                res = r["result"] or {}
                what = "rolled back to {} ({}, job {}); {} dropped".format(
                    res.get("engine_key"), res.get("precision"), res.get("job_id"),
                    res.get("replaced"))
            else:
                err = r["error"] or {}
                what = "not rolled back: {} {}".format(err.get("code"), err.get("message", ""))
            print("{} {}: {}".format(r["device"], r["model"][:12], what))
    return EXIT_OK if out and all(r["ok"] for r in out) else EXIT_FAILED


def add_parser(fsub: Any, add_connection_args: Any, connect: Any) -> None:
    from agent.cli.fleet_db import add_db_args

    b = fsub.add_parser("rollback", help="make devices go back to a model's previous engine",
                        description="Send the rollback command: each device makes the "
                        "previous engine of the model active again (its journal keeps one). "
                        "Per device (--device; the model defaults to its one active engine) or "
                        "per rollout (--rollout: its devices that succeeded, its model; needs "
                        "--db).")
    add_connection_args(b)
    add_db_args(b)
    b.add_argument("--device", action="append", metavar="ID", help="this device (repeatable; "
                   "with --rollout: only these of its devices)")
    b.add_argument("--rollout", metavar="ID", help="every device of this rollout that succeeded")
    b.add_argument("--model", metavar="SHA256", help="the model whose engine to roll back")
    b.add_argument("--wait", type=float, default=10.0, metavar="S",
                   help="wait S seconds for the devices' replies (default 10)")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=lambda a: run(a, connect))
