"""``fleet rollback``: make devices go back to a model's previous version. A device with the
feature ``named_models`` gets the command by name (``--name``; ``--version`` to go to a kept
version); an older device gets today's form, the model's sha256 (its journal keeps the active
and the previous engine of every model). Per device (``--device``; the model defaults to the
device's one model, from its retained models message or status) or per rollout (``--rollout``:
every device of a rollout in the fleet database that succeeded, the rollout's model).

Every rollback sent is recorded in the fleet database against the rollout it undoes
(``rollback_log``) when there is one (``--rollout``, ``--db``, or a service running on the
default database); the devices' replies complete the records, so the rollout's page shows it
rolled back, or the device's reason for refusing. ``send`` is what the dashboard's button
calls.
"""

import argparse
import json
import time
import uuid
from typing import Any, Dict, List, Mapping, Optional

from agent.errors import AgentError
from agent.fleet.database import device_models
from agent.fleet.rollouts import rollback_log
from agent.wire import model_names, protocol
from agent.wire.topics import TopicInfo

EXIT_OK, EXIT_FAILED = 0, 1


def command(model: Optional[str] = None, request_id: Optional[str] = None,
            name: Optional[str] = None, version: Optional[str] = None) -> Dict[str, Any]:
    """The rollback command: by ``name`` (and ``version``) for devices with the feature
    ``named_models``, else by the ``model``'s sha256."""
    cmd: Dict[str, Any] = {"protocol": protocol.PROTOCOL_VERSION, "command": "rollback",
                           "request_id": request_id or "r" + uuid.uuid4().hex[:10]}
    if name is not None:
        cmd["name"] = model_names.validate_name(name)
        if version is not None:
            cmd["version"] = model_names.validate_version(version)
    else:
        cmd["model"] = _check_sha(str(model or ""))
    return cmd


def send(conn: Any, device: str, model: Optional[str] = None, name: Optional[str] = None,
         version: Optional[str] = None) -> str:
    """Publish the command (QoS 1: kept for an offline device's session); its request id."""
    protocol.check_id("device", device)
    cmd = command(model, name=name, version=version)
    conn.client.publish(conn.topics.commands(device), protocol.encode(cmd), qos=1)
    return str(cmd["request_id"])


def _check_sha(model: str) -> str:
    if not protocol.valid_sha256(model):
        raise AgentError("bad_argument", "--model wants the model's sha256 (64 lower-case hex "
                         "digits), found {!r}".format(model[:80]))
    return model


def plan_one(device: str, status: Optional[Mapping[str, Any]],
             models: Optional[Mapping[str, Any]], name: Optional[str] = None,
             version: Optional[str] = None, model: Optional[str] = None,
             rollout_sha: Optional[str] = None) -> Dict[str, Any]:
    """What to send one device: {device, name, version, model} with either ``name`` (it lists
    ``named_models``) or ``model`` (it does not: today's form). Pure."""
    if device_models.named(status):
        held = device_models.entries(status, models)
        if name is None and model is not None:  # a sha given: the name that holds it
            name = next((m["name"] for m in held if m.get("model") == model), None) or \
                model_names.derived_name(model)
        if name is None:
            names = sorted({m["name"] for m in held})
            if len(names) != 1:
                raise AgentError("bad_argument", "device {} holds {} models ({}); choose one "
                                 "with --name NAME".format(device, len(names),
                                                           ", ".join(names) or "none"))
            name = names[0]
        return {"device": device, "name": name, "version": version, "model": None}
    if version is not None:
        raise AgentError("bad_argument", "device {} does not list the feature named_models "
                         "(an earlier release): it can only go back to the previous engine; "
                         "expected no --version, found {!r}".format(device, version))
    if model is None and rollout_sha is not None:
        model = rollout_sha
    if model is None:
        if status is None:
            raise AgentError("unknown_device", "device {} has no retained status on the broker; "
                             "give --model SHA256".format(device))
        shas = sorted({str(m["model"]) for m in device_models.entries(status, None)
                       if name is None or m["name"] == name})
        if len(shas) != 1:
            raise AgentError("bad_argument", "device {} does not list the feature named_models "
                             "(an earlier release) and has {} active engines{} ({}); choose "
                             "one with --model SHA256{}".format(
                                 device, len(shas), " named " + name if name else "",
                                 ", ".join(s[:12] for s in shas) or "none",
                                 " (or --rollout ID, or --db with the rollout that deployed "
                                 "it)" if name else ""))
        model = shas[0]
    return {"device": device, "name": None, "version": None, "model": _check_sha(model)}


def _db(args: argparse.Namespace) -> Optional[str]:
    """The fleet database to record in: --db, else the default one when --rollout needs it
    or a service runs on it."""
    from agent.cli.fleet_db import db_url, service_up

    if args.db or args.rollout:
        return db_url(args, existing=True)
    url = db_url(args)
    return url if service_up(url) else None


def targets(args: argparse.Namespace, statuses: Mapping[str, Dict[str, Any]],
            models: Optional[Mapping[str, Dict[str, Any]]] = None, store: Any = None
            ) -> List[Dict[str, Any]]:
    """What to send: {device, name, version, model, rollout_id} per device."""
    models = models or {}
    name = model_names.validate_name(args.name) if getattr(args, "name", None) else None
    version = getattr(args, "version", None)
    if version is not None:
        if name is None:
            raise AgentError("bad_argument", "--version names a kept version of a model: "
                             "expected --name NAME with it, found none")
        model_names.validate_version(version)
    given = _check_sha(args.model) if args.model else None
    if args.rollout:
        row = store.rollout(args.rollout) if store is not None else None
        if row is None:
            raise AgentError("unknown_job", "no rollout {!r} in the fleet database".format(
                args.rollout))
        spec = row["spec"] or {}
        sha = ((spec.get("artifacts") or {}).get("model") or {}).get("sha256")
        done = [j["device"] for j in store.rollout_jobs(args.rollout)
                if j["state"] == "SUCCEEDED"]
        chosen = sorted(d for d in done if not args.device or d in args.device)
        if not chosen:
            raise AgentError("unknown_device", "no device of rollout {} succeeded{}: nothing to "
                             "roll back".format(args.rollout, " among " + ", ".join(
                                 args.device) if args.device else ""))
        rollout_name = name or spec.get("model_name") or (model_names.derived_name(sha)
                                                          if sha else None)
        out = []
        for dev in chosen:
            st = statuses.get(dev)
            plan = plan_one(dev, st, models.get(dev),
                            rollout_name if device_models.named(st) else name, version,
                            given, sha)
            out.append(dict(plan, rollout_id=args.rollout))
        return out
    out = []
    for dev in args.device:
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


def _outcome(r: Mapping[str, Any], wait: float) -> str:
    if not r["replied"]:
        return "no reply in {:g} s (an offline device gets the command when it reconnects)" \
            .format(wait)
    res = r["result"] or {}
    if r["ok"]:
        if res.get("version"):
            return "rolled back to {}{}".format(model_names.label(res.get("name") or r["name"],
                                                                  res["version"]),
                                                " (from {})".format(res["replaced"])
                                                if res.get("replaced") else "")
        return "rolled back to {} ({}, job {}); {} dropped".format(
            res.get("engine_key"), res.get("precision"), res.get("job_id"), res.get("replaced"))
    err = r["error"] or {}
    return "refused: {} {}".format(err.get("code"), err.get("message", ""))


def run(args: argparse.Namespace, connect: Any, hold: Any = None) -> int:
    """``hold``: (pin, settle) of agent.fleet.deployments.pins, wired by the CLI: a rollback of
    a model a deployment governs becomes a pin (recorded before the command leaves, so the
    deployment never sends its version back in between), settled by the device's reply."""
    if not args.device and not args.rollout:
        raise AgentError("bad_argument", "fleet rollback needs --device ID (repeatable) or "
                         "--rollout ID")
    url = _db(args)
    store = None
    if url is not None:
        from agent.fleet.database.store import Store

        store = Store(url)
    try:
        return _run(args, connect, store, hold)
    finally:
        if store is not None:
            store.close()


def _run(args: argparse.Namespace, connect: Any, store: Any, hold: Any = None) -> int:
    if store is not None and args.rollout and store.rollout(args.rollout) is None:
        raise AgentError("unknown_job", "no rollout {!r} in the fleet database".format(
            args.rollout))
    conn = connect(args)
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
        for t in targets(args, conn.directory.status, conn.directory.models, store):
            rid = "r" + uuid.uuid4().hex[:10]
            requests[rid] = dict(t, request_id=rid)
        if store is not None:  # before the commands leave: a fast reply finds its record
            rollback_log.record(store, list(requests.values()))
            if hold:
                pinned = hold[0](store, list(requests.values()), getattr(args, "reason", None))
        for rid, t in requests.items():
            conn.publish(conn.topics.commands(t["device"]), protocol.encode(command(
                t["model"], rid, t["name"], t["version"])), qos=1)
        conn.flush()
        deadline = time.monotonic() + max(0.0, args.wait)
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
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        for r in out:
            what = r["name"] or r["model"][:12]
            print("{} {}: {}{}".format(r["device"], what, _outcome(r, args.wait),
                                       "; pinned: deployment {} leaves it there (fleet unpin {} "
                                       "{})".format(r["pinned_by"], r["device"], r["name"])
                                       if r["pinned_by"] and (r["ok"] or not r["replied"])
                                       else ""))
    return EXIT_OK if out and all(r["ok"] for r in out) else EXIT_FAILED


def add_parser(fsub: Any, add_connection_args: Any, connect: Any, hold: Any = None) -> None:
    from agent.cli.fleet_db import add_db_args

    b = fsub.add_parser("rollback", help="make devices go back to a model's previous version",
                        description="Send the rollback command: each device makes the "
                        "previous version of the model active again. By name (--name; "
                        "devices of this release) or by the model's sha256 (--model; devices "
                        "of earlier releases, which keep one previous engine per model). Per "
                        "device (--device; the model defaults to its one model) or per rollout "
                        "(--rollout: its devices that succeeded, its model; needs --db). "
                        "Recorded against the rollout in the fleet database, with each "
                        "device's answer.")
    add_connection_args(b)
    add_db_args(b)
    b.add_argument("--device", action="append", metavar="ID", help="this device (repeatable; "
                   "with --rollout: only these of its devices)")
    b.add_argument("--rollout", metavar="ID", help="every device of this rollout that succeeded")
    b.add_argument("--name", metavar="NAME", help="the model to roll back, by name (devices "
                   "without the feature named_models get its sha256 instead)")
    b.add_argument("--version", metavar="V", help="with --name: go to this kept version "
                   "(default: the previous one)")
    b.add_argument("--model", metavar="SHA256", help="the model whose engine to roll back, by "
                   "sha256 (today's form)")
    b.add_argument("--wait", type=float, default=10.0, metavar="S",
                   help="wait S seconds for the devices' replies (default 10)")
    b.add_argument("--reason", metavar="TEXT", help="why: kept with the pin a rollback of a "
                   "device that a deployment governs becomes")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=lambda a: run(a, connect, hold))
