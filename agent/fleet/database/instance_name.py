"""A fleet service's instance name: stable across restarts by default, never shared by two live
processes.

The default name is the host's name and a hash of the database's URL (``default_name``): a
service restarted on the same host and database has its predecessor's name, so its rollouts are
taken back at once (``agent.fleet.database.leases.claim`` takes a lease held under the own name by
another process) instead of after the lease. ``register`` makes that safe: it takes the name in
the ``services`` table only when the process that last registered it is dead (same host: its
PID is gone or a zombie, or the host rebooted since (``boot_id``); another host: its heartbeat,
on the database's clock, is older than ``stale_s``). Else a default name gets this PID as a
suffix (two live services on one host each keep their own leases), and a name given with
``--instance`` is refused (``instance_in_use``), after waiting up to ``stale_s`` for a holder on
another host to go silent.
"""

import hashlib
import os
import socket
import time
from typing import Any, Optional, Sequence

from agent.errors import AgentError
from agent.fleet.database import leases

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def boot_id(path: str = BOOT_ID_PATH) -> str:
    """This host's boot id ("" where the kernel does not say)."""
    try:
        with open(path) as f:
            return f.read(100).strip()
    except OSError:
        return ""


def default_name(url: str) -> str:
    """HOST-HASH: the host's name and 8 hex digits of the database's URL (a SQLite path made
    absolute, a PostgreSQL URL without its password)."""
    from agent.fleet.database.db import redact, sqlite_path

    if url.startswith(("postgresql://", "postgres://")):
        key = redact(url)
    else:
        key = "sqlite:" + os.path.realpath(sqlite_path(url))
    return "{}-{}".format(socket.gethostname().split(".")[0] or "host",
                          hashlib.sha256(key.encode("utf-8")).hexdigest()[:8])


def pid_alive(pid: Any) -> bool:
    """A process with this PID runs on this host (a zombie does not)."""
    try:
        pid = int(pid)
    except (TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open("/proc/{}/stat".format(pid)) as f:
            return f.read(400).rsplit(")", 1)[-1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def holder_alive(row: Optional[Sequence[Any]], db_now: float, stale_s: float) -> bool:
    """Whether the process of a ``services`` row (heartbeat, pid, host, boot_id) may still run."""
    if row is None:
        return False
    heartbeat, pid, host, boot = row
    if host == socket.gethostname():
        if boot and boot_id() and boot != boot_id():
            return False  # the host rebooted since
        return int(pid or 0) != os.getpid() and pid_alive(pid)
    return heartbeat is not None and float(heartbeat) >= db_now - stale_s


def _wait_other_host(db: Any, name: str, stale_s: float) -> None:
    """A name last registered from another host whose heartbeat is still fresh (a service
    moved to a new host, a container restarted with a new host name): wait until it is stale
    (at most ``stale_s``), then it is taken; a live one is refused by ``register``."""
    deadline = time.monotonic() + stale_s + 1.0
    while time.monotonic() < deadline:
        rows = db.query("SELECT heartbeat, pid, host, boot_id FROM services WHERE instance = ?",
                        (name,))
        if not rows or rows[0][2] == socket.gethostname() or \
                not holder_alive(rows[0], leases.db_now(db), stale_s):
            return
        time.sleep(0.5)


def register(store: Any, explicit: Optional[str], stale_s: float, started: float) -> str:
    """Take this process's name in ``services`` (see the module's docstring) and return it."""
    db = store.db
    base = explicit or default_name(store.url)
    if explicit:
        _wait_other_host(db, explicit, stale_s)
    for name in (base, "{}-{}".format(base, os.getpid())):
        with db.transaction():
            if db.dialect == "postgresql":  # two starting at once: one after the other
                db.query("SELECT pg_advisory_xact_lock(hashtext(?))", ("fleet-instance:" + name,))
            rows = db.query("SELECT heartbeat, pid, host, boot_id FROM services WHERE instance "
                            "= ?" + (" FOR UPDATE" if db.dialect == "postgresql" else ""),
                            (name,))
            row = rows[0] if rows else None
            if holder_alive(row, leases.db_now(db), stale_s):
                if explicit:
                    assert row is not None
                    raise AgentError("instance_in_use", "expected no live fleet service named "
                                     "{!r}, found one: PID {} on {} (heartbeat {:.0f} s ago); "
                                     "stop it, or give this one another --instance".format(
                                         name, row[1], row[2],
                                         leases.db_now(db) - float(row[0] or 0)),
                                     {"instance": name, "pid": row[1], "host": row[2]})
                continue
            db.execute("INSERT INTO services (instance, heartbeat, pid, host, started, boot_id) "
                       "VALUES (?, {}, ?, ?, ?, ?) ON CONFLICT (instance) DO UPDATE SET "
                       "heartbeat = excluded.heartbeat, pid = excluded.pid, host = "
                       "excluded.host, started = excluded.started, boot_id = excluded.boot_id"
                       .format(leases.now_sql(db.dialect)),
                       (name, os.getpid(), socket.gethostname(), started, boot_id()))
            return name
    raise AgentError("instance_in_use", "expected a free fleet service name on this host, "
                     "found {!r} and {!r} held by live processes".format(
                         base, "{}-{}".format(base, os.getpid())))


def stale_after(lease_s: float) -> float:
    """How old another host's heartbeat may be while its service still counts as live."""
    return max(3.0 * float(lease_s), 10.0)
