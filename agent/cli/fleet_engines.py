"""``fleet engines ls`` and ``fleet engines revoke SHA256``: the engines builders shared
(docs/fleet.md, "Engine sharing").

``ls`` lists every upload of the recent rollouts' builders: accepted (its builder's signed
report named it), refused (with why), revoked, or awaiting the builder's report. ``revoke``
withdraws an engine fleet-wide: recorded in the fleet database (the service never hands it
out again) and sent as the ``revoke_engine`` command to the devices that adopted it and list
the feature ``revoke_engine``; they roll back from it. A device of an earlier release is
named, with the ``fleet rollback`` that does the same for it.
"""

import argparse
import json
import time
import uuid
from typing import Any, Dict, List, Mapping

from agent.errors import AgentError
from agent.fleet.database import device_models
from agent.wire import protocol
from agent.wire.topics import TopicInfo

EXIT_OK, EXIT_FAILED = 0, 1
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


def add_parser(fsub: Any, add_connection_args: Any, connect: Any) -> None:
    from agent.cli.fleet_db import add_db_args

    e = fsub.add_parser("engines", help="engines shared by builders: list, revoke")
    esub = e.add_subparsers(dest="engines_command", metavar="ls|revoke")
    esub.required = True
    ls = esub.add_parser("ls", help="uploads of builders: accepted, refused (why), revoked")
    add_db_args(ls)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=run_ls)
    r = esub.add_parser("revoke", help="withdraw a shared engine fleet-wide; its adopters "
                        "roll back from it")
    add_connection_args(r)
    add_db_args(r)
    r.add_argument("sha256", metavar="SHA256", help="the shared engine (fleet engines ls)")
    r.add_argument("--reason", default="", help="recorded with the revocation")
    r.add_argument("--wait", type=float, default=10.0, metavar="S",
                   help="wait S seconds for the devices' replies (default 10)")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=lambda a: run_revoke(a, connect))


def _store(args: argparse.Namespace) -> Any:
    from agent.cli.fleet_db import db_url
    from agent.fleet.database.store import Store

    return Store(db_url(args, existing=True))


def run_ls(args: argparse.Namespace) -> int:
    store = _store(args)
    try:
        rows = shared_engines(store)
    finally:
        store.close()
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return EXIT_OK
    for r in rows:
        print("{} {} by {} (rollout {}){}{}".format(
            r["sha256"][:16], r["state"], r["builder"], r["rollout"],
            ": " + r["why"] if r["why"] else "",
            "; adopted by " + ", ".join(r["adopters"]) if r["adopters"] else ""))
    return EXIT_OK


def run_revoke(args: argparse.Namespace, connect: Any) -> int:
    sha = str(args.sha256).lower()
    if not protocol.valid_sha256(sha):
        raise AgentError("bad_argument", "fleet engines revoke wants the engine's sha256 (64 "
                         "hex digits), found {!r}".format(str(args.sha256)[:80]))
    store = _store(args)
    try:
        store.revoke_engine(sha, str(args.reason or ""))
        devices = sorted({d for r in shared_engines(store) if r["sha256"] == sha
                          for d in r["adopters"]})
    finally:
        store.close()
    conn = connect(args)
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
        deadline = time.monotonic() + max(0.0, args.wait)
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
    if args.json:
        print(json.dumps({"engine": sha, "revoked": True, "devices": out}, indent=2,
                         sort_keys=True))
    else:
        print("engine {} revoked: no longer offered".format(sha[:16]))
        for r in out:
            print("{}: {}".format(r["device"], _outcome(r, args.wait)))
    return EXIT_OK if all(r["ok"] for r in out) else EXIT_FAILED


def _row(device: str, reply: Any) -> Dict[str, Any]:
    versions = ((reply or {}).get("result") or {}).get("versions") or []
    # ok: the device answered and no version of it stays on the engine.
    return {"device": device, "ok": bool(reply and reply.get("ok")) and
            not any(v.get("error") for v in versions if isinstance(v, dict)),
            "replied": reply is not None, "result": (reply or {}).get("result"),
            "error": (reply or {}).get("error")}


def _outcome(r: Mapping[str, Any], wait: float) -> str:
    if r["error"]:
        return "refused: {} {}".format(r["error"].get("code"), r["error"].get("message", ""))
    if not r["replied"]:
        return "no reply in {:g} s (an offline device gets the command when it reconnects)" \
            .format(wait)
    parts = []
    for v in (r["result"] or {}).get("versions") or []:
        back = v.get("rolled_back") or {}
        parts.append("{} rolled back to {}".format(v["name"], back.get("version"))
                     if back else "{} not rolled back: {}".format(
                         v["name"], (v.get("error") or {}).get("message")))
    return "; ".join(parts) or "not running it"
