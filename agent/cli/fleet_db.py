"""The fleet database and artifact store as the CLI names them: the ``--db``/``--store``
arguments and their defaults, and ``fleet db upgrade|current|history`` (the schema's
migrations: docs/fleet.md, "The database: schema and migrations"). What they do is
``agent.fleet.commands.db``'s.
"""

import argparse
import json
import os
import sys
from typing import Any

from agent.cli import EXIT_OK
from agent.fleet.commands import db as db_command
from agent.fleet.database import store_schema


def add_db_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet database")
    g.add_argument("--db", metavar="URL", default=os.environ.get("JETSON_AGENT_FLEET_DB"),
                   help="sqlite:///PATH (default $JETSON_AGENT_FLEET_DB or "
                        "$XDG_STATE_HOME/jetson-agent/fleet.db) or postgresql://...")
    g.add_argument("--store", metavar="DIR", default=os.environ.get("JETSON_AGENT_FLEET_STORE"),
                   help="content-addressed artifact store the service serves from (default: "
                        "fleet-artifacts next to a SQLite database; $JETSON_AGENT_FLEET_STORE)")


def db_url(args: argparse.Namespace, existing: bool = False) -> str:
    """``--db`` resolved and checked (agent.fleet.commands.db.resolve_url)."""
    return db_command.resolve_url(args.db, existing)


# ---------------------------------------------------------------------------- fleet db

def add_db_parser(fsub: Any) -> None:
    d = fsub.add_parser("db", help="the fleet database's schema: upgrade, current, history",
                        description="Migrations of the fleet database (Alembic). `fleet serve` "
                        "upgrades on start unless --no-db-upgrade; read-only commands never "
                        "do. See docs/fleet.md, \"The database: schema and migrations\".")
    dsub = d.add_subparsers(dest="db_command", metavar="upgrade|current|history")
    u = dsub.add_parser("upgrade", help="upgrade the database to this version's schema "
                        "(creates an empty one; stamps one made before migrations)")
    add_db_args(u)
    u.add_argument("--json", action="store_true")
    u.set_defaults(func=run_db_upgrade)
    c = dsub.add_parser("current", help="the database's revision and whether it is this "
                        "version's (changes nothing)")
    add_db_args(c)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=run_db_current)
    h = dsub.add_parser("history", help="every revision of the schema, newest first")
    h.add_argument("--json", action="store_true")
    h.set_defaults(func=run_db_history)
    d.set_defaults(func=lambda args: d.print_help() or 2)


def run_db_upgrade(args: argparse.Namespace) -> int:
    out = db_command.upgrade(db_url(args), args.store)
    before, after = out["before"], out["revision"]
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    elif before == after:
        print("fleet database {}: at revision {} (the newest), nothing to do".format(
            out["db"], after))
    else:
        print("fleet database {}: {} -> revision {}".format(
            out["db"], {None: "empty", "legacy": "made before migrations (stamped at the "
                        "baseline {})".format(store_schema.BASELINE)}.get(
                before, "revision {}".format(before)), after))
    return EXIT_OK


def run_db_current(args: argparse.Namespace) -> int:
    url = db_url(args, existing=True)
    out = db_command.current(url)
    state, rev = out["state"], out["revision"]
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return EXIT_OK
    if state == "current":
        print("{} (the newest)".format(rev))
    elif state == "empty":
        print("empty: no fleet tables (`{}` creates them)".format(
            store_schema.upgrade_command(url)))
    elif state == "newer":
        print("revision {}: newer than this jetson-agent knows (its newest is {}); a newer "
              "jetson-agent upgraded it: upgrade jetson-agent, not the database".format(
                  rev, store_schema.HEAD))
    else:
        print("{}: {}; upgrade with: {}".format(
            "made before migrations (no version stamp; the baseline {})".format(rev)
            if state == "legacy" else "revision {}".format(rev),
            "the newest is {}".format(store_schema.HEAD), store_schema.upgrade_command(url)))
    return EXIT_OK


def run_db_history(args: argparse.Namespace) -> int:
    rows = db_command.history()
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return EXIT_OK
    for r in rows:
        sys.stdout.write("{} -> {}{}: {}\n".format(r["down_revision"] or "<base>", r["revision"],
                                                  " (head)" if r["head"] else "", r["doc"]))
    return EXIT_OK
