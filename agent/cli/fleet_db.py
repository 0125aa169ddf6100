"""The fleet database and artifact store as the CLI names them: the ``--db``/``--store``
arguments and their defaults, whether a ``fleet serve`` is up on a database, a rollout's
files registered in the store (copied into it when a service will serve them), and ``fleet db
upgrade|current|history`` (the schema's migrations: docs/fleet.md, "The database: schema and
migrations").
"""

import argparse
import json
import os
import shutil
import sys
from typing import Any, Dict, Optional

from agent.cli import EXIT_OK
from agent.errors import AgentError
from agent.fleet.database import store_schema
from agent.fleet.database.db import Db, redact, sqlite_path
from agent.fleet.database.store import Store, default_db_url

DB_SCHEMES = ("sqlite:", "postgresql://", "postgres://")

SERVICE_FRESH_S = 15.0  # a service whose heartbeat is older is taken for dead


def add_db_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("fleet database")
    g.add_argument("--db", metavar="URL", default=os.environ.get("JETSON_AGENT_FLEET_DB"),
                   help="sqlite:///PATH (default $JETSON_AGENT_FLEET_DB or "
                        "$XDG_STATE_HOME/jetson-agent/fleet.db) or postgresql://...")
    g.add_argument("--store", metavar="DIR", default=os.environ.get("JETSON_AGENT_FLEET_STORE"),
                   help="content-addressed artifact store the service serves from (default: "
                        "fleet-artifacts next to a SQLite database; $JETSON_AGENT_FLEET_STORE)")


def db_url(args: argparse.Namespace, existing: bool = False) -> str:
    """``--db`` (else the default), checked: a scheme the store speaks; with ``existing`` (the
    commands that only read or change what a service recorded), a SQLite file that is there,
    so a typo is an error instead of a new empty database that says "no rollouts"."""
    return check_db_url(args.db or default_db_url(), existing)


def check_db_url(url: str, existing: bool = False) -> str:
    if not url.startswith(DB_SCHEMES):
        raise AgentError("bad_argument", "--db expects sqlite:///PATH or postgresql://..., "
                         "found {!r}".format(redact(url)))
    if existing and url.startswith("sqlite:"):
        path = os.path.abspath(sqlite_path(url))
        if not os.path.isfile(path):
            raise AgentError("file_not_found", "--db {}: no fleet database at {} (expected the "
                             "file `fleet serve` writes; check the path)".format(url, path))
    return url


def store_dir(args: argparse.Namespace, url: str) -> str:
    if args.store:
        return args.store
    if url.startswith("sqlite:"):
        path = url.split("sqlite:///", 1)[-1]
        return os.path.join(os.path.dirname(os.path.abspath(path)), "fleet-artifacts")
    return os.path.join(os.path.dirname(default_db_url().split("sqlite:///", 1)[-1]),
                        "fleet-artifacts")


def add_to_store(store: Store, directory: str, artifacts: Dict[str, Dict[str, Any]],
                 files: Dict[str, str], copy: bool) -> None:
    """Register the artifacts; ``copy``: into the content-addressed directory first (the
    service outlives this command and its temporary files)."""
    every = dict(artifacts)
    for role, ref in artifacts.items():  # the per-block hash lists are artifacts too
        if ref.get("blocks"):
            every[role + ".blocks"] = {"sha256": ref["blocks"]["sha256"], "name": role +
                                       ".blocks", "size": os.path.getsize(files[role + ".blocks"])}
    for role, ref in every.items():
        src = files[role]
        path = os.path.abspath(src)
        if copy:
            path = os.path.join(os.path.abspath(directory), ref["sha256"][:2], ref["sha256"])
            if not os.path.exists(path):
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = path + ".tmp{}".format(os.getpid())
                shutil.copyfile(src, tmp)
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
                os.replace(tmp, path)
        store.add_artifact(ref["sha256"], ref["size"], path, ref.get("name"))


def service_up(url: str) -> bool:
    if url.startswith("sqlite:") and not os.path.exists(url.split("sqlite:///", 1)[-1]):
        return False
    try:
        store = Store(url, schema="read")
    except AgentError as exc:
        if exc.code in ("db_schema", "bad_argument"):  # empty, or not this version's schema:
            return False  # no service of this version runs on it
        raise
    try:
        return bool(store.services(SERVICE_FRESH_S))
    finally:
        store.close()


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


def upgrade_in_child(url: str, blob_store: Optional[str] = None) -> None:
    """``fleet serve``'s upgrade on start, in a child process (``fleet db upgrade``): the
    service itself never loads SQLAlchemy and Alembic (memory, and a garbage collector that
    would walk their objects for as long as it runs). The URL goes by the environment, not the
    command line (a password would show in ``ps``)."""
    import subprocess

    db = Db(url)
    try:
        state, _rev = store_schema.probe(db)
    finally:
        db.close()
    if state == "current":
        return
    env = dict(os.environ, JETSON_AGENT_FLEET_DB=url)
    if blob_store:  # where revision 0006 imports the registry's files
        env["JETSON_AGENT_FLEET_STORE"] = blob_store
    out = subprocess.run([sys.executable, "-m", "agent", "fleet", "db", "upgrade", "--json"],
                         env=env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True)
    try:
        reply = json.loads(out.stdout)
    except ValueError:
        reply = {}
    err = reply.get("error") if isinstance(reply, dict) else None
    if out.returncode != 0 or err:
        if isinstance(err, dict) and err.get("code") in ("db_schema", "bad_argument"):
            raise AgentError(str(err["code"]), str(err.get("message")))
        raise AgentError("internal_error", "upgrading the fleet database {} failed: {}".format(
            store_schema.shown_url(url), (out.stderr or out.stdout).strip()[-2000:]))


def run_db_upgrade(args: argparse.Namespace) -> int:
    from agent.fleet.database import migrate

    url = db_url(args)
    db = Db(url)  # a file that is not a database: bad_argument here, not a traceback
    try:
        store_schema.probe(db)
    finally:
        db.close()
    before, after = migrate.upgrade(url, blob_store=args.store)
    out = {"db": store_schema.shown_url(url), "before": before, "revision": after,
           "head": store_schema.HEAD}
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
    db = Db(url)
    try:
        state, rev = store_schema.probe(db)
    finally:
        db.close()
    if state == "other" and rev is not None:
        from agent.fleet.database import migrate

        if not migrate.known(rev):
            state = "newer"  # made by a newer jetson-agent: upgrading the database cannot help
    out = {"db": store_schema.shown_url(url), "state": state, "revision": rev,
           "head": store_schema.HEAD}
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
    from agent.fleet.database import migrate

    rows = migrate.revisions()
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return EXIT_OK
    for r in rows:
        sys.stdout.write("{} -> {}{}: {}\n".format(r["down_revision"] or "<base>", r["revision"],
                                                  " (head)" if r["head"] else "", r["doc"]))
    return EXIT_OK
