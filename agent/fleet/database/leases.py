"""Rollout leases on the database's clock, with a fencing epoch: who may drive a rollout, and
when a service may still publish for it.

- **The database's clock.** A lease runs until ``lease_until``, computed and compared by the
  database (``now_sql``: ``clock_timestamp()`` on PostgreSQL, ``julianday('now')`` on SQLite),
  never by an instance: instances on hosts whose clocks disagree still agree on who holds it.
- **The fencing epoch.** Every change of holder adds one to ``rollouts.lease_epoch``; the holder
  (``lease_holder``: one per process, ``holder_token``) keeps the epoch it took. Every write of
  a rollout (``database.store.Store.save_rollout`` with a ``fence``) first renews the lease
  where the holder and the epoch are still its own, in the transaction that writes the state
  and the outbox rows (which record the epoch): a stale holder's write changes nothing and
  raises ``LeaseLost``, so nothing it decided reaches the outbox, nor the broker.
- **Publishing.** A holder publishes a rollout's messages only within ``lease - margin`` of
  its last renewal, timed from before that renewal's transaction on the monotonic clock
  (``LeaseBook``): a process stopped (SIGSTOP, a VM paused) long enough for another instance
  to take over finds its deadline passed when it runs again, and publishes nothing. Only rows
  committed under a then-current epoch are ever published; a new holder publishes again what
  the outbox still holds.
- **Takeover.** ``claim`` renews this process's leases, and takes those that are free, expired,
  or held under this instance's own name by another process (a dead predecessor: the
  instance's name is only ever reused once the process that held it is dead,
  ``agent.fleet.database.instance_name``), each with a new epoch.
"""

import os
import socket
import time
import uuid
from typing import Any, Dict, Iterable, Optional, Tuple

ACTIVE_SQL = "state IN ('running', 'paused')"
Fence = Tuple[str, int, float]  # (holder, epoch, lease_s)


class LeaseLost(Exception):
    """A write under a lease another process took over since: nothing was written."""

    def __init__(self, rollout_id: str, epoch: int) -> None:
        super().__init__("rollout {}: expected to hold its lease at epoch {}, found it taken "
                         "over by another instance".format(rollout_id, epoch))
        self.rollout_id = rollout_id
        self.epoch = epoch


def now_sql(dialect: str) -> str:
    """The database's clock as seconds since the epoch, an SQL expression."""
    if dialect == "postgresql":
        return "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)"
    return "((julianday('now') - 2440587.5) * 86400.0)"


def db_now(db: Any) -> float:
    return float(db.query("SELECT " + now_sql(db.dialect))[0][0])


def holder_token(instance: str) -> str:
    """This process's lease holder: the instance's name, host, PID and a random part."""
    return "{}|{}|{}|{}".format(instance, socket.gethostname(), os.getpid(),
                                uuid.uuid4().hex[:8])


def claim(db: Any, instance: str, holder: str, lease_s: float,
          only: Optional[Iterable[str]] = None) -> Dict[str, int]:
    """Renew this holder's leases and take the free, expired and own-name ones (``only``: of
    these ids). Returns rollout id -> the epoch this holder drives it under."""
    ids = None if only is None else sorted(only)
    if ids is not None and not ids:
        return {}
    where = "" if ids is None else " AND rollout_id IN ({})".format(", ".join("?" for _ in ids))
    now = now_sql(db.dialect)
    with db.transaction():
        db.execute("UPDATE rollouts SET lease_until = {} + ? WHERE lease_holder = ? AND "
                   "owner = ? AND {}".format(now, ACTIVE_SQL) + where,
                   [float(lease_s), holder, instance] + (ids or []))
        db.execute("UPDATE rollouts SET owner = ?, lease_holder = ?, lease_until = {0} + ?, "
                   "lease_epoch = COALESCE(lease_epoch, 0) + 1 WHERE {1} AND (owner IS NULL OR "
                   "lease_until IS NULL OR lease_until < {0} OR (owner = ? AND (lease_holder IS "
                   "NULL OR lease_holder <> ?)))".format(now, ACTIVE_SQL) + where,
                   [instance, holder, float(lease_s), instance, holder] + (ids or []))
        rows = db.query("SELECT rollout_id, lease_epoch FROM rollouts WHERE lease_holder = ? "
                        "AND {} ORDER BY created".format(ACTIVE_SQL), (holder,))
    return {str(r[0]): int(r[1] or 0) for r in rows}


def fenced_renew(db: Any, rollout_id: str, fence: Fence) -> None:
    """In the caller's transaction: renew the lease if ``fence`` (holder, epoch) still holds
    it, else raise ``LeaseLost`` (the caller's transaction is rolled back)."""
    holder, epoch, lease_s = fence
    cur = db.execute("UPDATE rollouts SET lease_until = {} + ? WHERE rollout_id = ? AND "
                     "lease_holder = ? AND lease_epoch = ?".format(now_sql(db.dialect)),
                     (float(lease_s), rollout_id, holder, int(epoch)))
    if cur.rowcount != 1:
        raise LeaseLost(rollout_id, int(epoch))


class LeaseBook(object):
    """What this process holds: rollout id -> epoch, and until when (monotonic) it may publish
    for each: ``lease_s - margin`` after the start of the transaction that last renewed it."""

    def __init__(self, holder: str, lease_s: float, margin_s: Optional[float] = None) -> None:
        self.holder = holder
        self.lease_s = float(lease_s)
        self.margin_s = max(0.5, 0.25 * self.lease_s) if margin_s is None else float(margin_s)
        self.epochs: Dict[str, int] = {}
        self.until: Dict[str, float] = {}
        self.suppressed = 0  # messages not published: the lease may have gone

    def claimed(self, held: Dict[str, int], started: float) -> None:
        """The result of a ``claim`` whose transaction began at ``started`` (monotonic)."""
        self.epochs = dict(held)
        self.until = {rid: started + self.lease_s - self.margin_s for rid in held}

    def renewed(self, rollout_id: str, started: float) -> None:
        if rollout_id in self.epochs:
            self.until[rollout_id] = started + self.lease_s - self.margin_s

    def fence(self, rollout_id: str) -> Optional[Fence]:
        epoch = self.epochs.get(rollout_id)
        return None if epoch is None else (self.holder, epoch, self.lease_s)

    def may_publish(self, rollout_id: str) -> bool:
        if rollout_id not in self.epochs:
            return True  # not a leased rollout (an embedded one's own store, a finished one)
        return time.monotonic() < self.until.get(rollout_id, 0.0)

    def forget(self, rollout_id: str) -> None:
        self.epochs.pop(rollout_id, None)
        self.until.pop(rollout_id, None)
