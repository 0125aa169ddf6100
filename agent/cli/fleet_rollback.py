"""``fleet rollback``: its arguments and its output; what it does is
agent.fleet.commands.rollback's (docs/fleet.md)."""

import argparse
import json
from typing import Any, Mapping

from agent.cli import EXIT_FAILED, EXIT_OK
from agent.cli.fleet_db import add_db_args
from agent.wire import model_names


def run(args: argparse.Namespace, connect: Any, hold: Any = None) -> int:
    from agent.fleet.commands import rollback
    from agent.fleet.commands.db import recording_url

    req = rollback.Request(devices=list(args.device or []), rollout=args.rollout,
                           name=args.name, version=args.version, model=args.model,
                           wait=args.wait, reason=args.reason)
    req.check()  # before any database is looked for
    url = recording_url(args.db, required=bool(args.rollout))
    store = None
    if url is not None:
        from agent.fleet.database.store import Store

        store = Store(url)
    try:
        out = rollback.run(req, lambda: connect(args), store, hold)
    finally:
        if store is not None:
            store.close()
    return _print(out, args)


def _print(out: Any, args: argparse.Namespace) -> int:
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


def add_parser(fsub: Any, add_connection_args: Any, connect: Any, hold: Any = None) -> None:
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
