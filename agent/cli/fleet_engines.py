"""``fleet engines ls`` and ``fleet engines revoke SHA256``: the engines builders shared
(docs/fleet.md, "Engine sharing").

``ls`` lists every upload of the recent rollouts' builders: accepted (its builder's signed
report named it), refused (with why), revoked, or awaiting the builder's report. ``revoke``
withdraws an engine fleet-wide: recorded in the fleet database (the service never hands it
out again) and sent as the ``revoke_engine`` command to the devices that adopted it and list
the feature ``revoke_engine``; they roll back from it. A device of an earlier release is
named, with the ``fleet rollback`` that does the same for it. Arguments and output here; what
they do is agent.fleet.commands.engines'.
"""

import argparse
import json
from typing import Any, Mapping

from agent.wire import protocol

EXIT_OK, EXIT_FAILED = 0, 1


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
        from agent.fleet.commands.engines import shared_engines

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
    from agent.fleet.commands.engines import revoke

    sha = str(args.sha256).lower()
    store = _store(args) if protocol.valid_sha256(sha) else None  # else revoke says why
    try:
        out = revoke(store, sha, str(args.reason or ""), lambda: connect(args), args.wait)
    finally:
        if store is not None:
            store.close()
    if args.json:
        print(json.dumps({"engine": sha, "revoked": True, "devices": out}, indent=2,
                         sort_keys=True))
    else:
        print("engine {} revoked: no longer offered".format(sha[:16]))
        for r in out:
            print("{}: {}".format(r["device"], _outcome(r, args.wait)))
    return EXIT_OK if all(r["ok"] for r in out) else EXIT_FAILED


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
