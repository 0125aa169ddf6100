"""The fleet database and artifact store as the CLI names them: the ``--db``/``--store``
arguments and their defaults, whether a ``fleet serve`` is up on a database, and a rollout's
files registered in the store (copied into it when a service will serve them).
"""

import argparse
import os
import shutil
from typing import Any, Dict

from agent.errors import AgentError
from agent.fleet.db import redact, sqlite_path
from agent.fleet.store import Store, default_db_url

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
            raise AgentError("bad_argument", "--db {}: no fleet database at {} (expected the "
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
    store = Store(url)
    try:
        return bool(store.services(SERVICE_FRESH_S))
    finally:
        store.close()
