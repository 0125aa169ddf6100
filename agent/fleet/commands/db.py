"""Which fleet database and artifact store a command works on (``--db``/``--store`` resolved
and checked), whether a ``fleet serve`` is up on a database, a rollout's files registered in
the store (copied into it when a service will serve them), and ``fleet db
upgrade|current|history`` (the schema's migrations: docs/fleet.md, "The database: schema and
migrations").
"""

import json
import os
import shutil
import sys
from typing import Any, Dict, List, Optional

from agent.errors import AgentError
from agent.fleet.database import store_schema
from agent.fleet.database.db import Db, redact, sqlite_path
from agent.fleet.database.store import Store, default_db_url

DB_SCHEMES = ("sqlite:", "postgresql://", "postgres://")

SERVICE_FRESH_S = 15.0  # a service whose heartbeat is older is taken for dead


def resolve_url(db: Optional[str], existing: bool = False) -> str:
    """``--db`` (else the default), checked: a scheme the store speaks; with ``existing`` (the
    commands that only read or change what a service recorded), a SQLite file that is there,
    so a typo is an error instead of a new empty database that says "no rollouts"."""
    return check_db_url(db or default_db_url(), existing)


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


def store_dir(store: Optional[str], url: str) -> str:
    """``--store``, else ``fleet-artifacts`` next to the SQLite database (or the default one's
    directory for PostgreSQL)."""
    if store:
        return store
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


def recording_url(db: Optional[str], required: bool) -> Optional[str]:
    """The database a command records in when one is wanted: ``--db`` (or the default when
    ``required``) checked to exist, else the default one only while a service runs on it."""
    if db or required:
        return resolve_url(db, existing=True)
    url = resolve_url(None)
    return url if service_up(url) else None


# ---------------------------------------------------------------------------- fleet db

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


def upgrade(url: str, blob_store: Optional[str]) -> Dict[str, Any]:
    """``fleet db upgrade``: {db, before, revision, head}."""
    from agent.fleet.database import migrate

    db = Db(url)  # a file that is not a database: bad_argument here, not a traceback
    try:
        store_schema.probe(db)
    finally:
        db.close()
    before, after = migrate.upgrade(url, blob_store=blob_store)
    return {"db": store_schema.shown_url(url), "before": before, "revision": after,
            "head": store_schema.HEAD}


def current(url: str) -> Dict[str, Any]:
    """``fleet db current``: {db, state (current, empty, legacy, other, newer), revision,
    head}; changes nothing."""
    db = Db(url)
    try:
        state, rev = store_schema.probe(db)
    finally:
        db.close()
    if state == "other" and rev is not None:
        from agent.fleet.database import migrate

        if not migrate.known(rev):
            state = "newer"  # made by a newer jetson-agent: upgrading the database cannot help
    return {"db": store_schema.shown_url(url), "state": state, "revision": rev,
            "head": store_schema.HEAD}


def history() -> List[Dict[str, Any]]:
    """``fleet db history``: every revision, newest first."""
    from agent.fleet.database import migrate

    return list(migrate.revisions())
