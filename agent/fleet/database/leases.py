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
- **Acting: a local deadline.** A holder acts for a rollout only until ``lease - margin``
  after its last renewal began, timed on the monotonic clock from before that renewal's
  transaction (``LeaseBook``); the instance itself (block answers, its other messages, outbox
  deletes) until ``lease - margin`` after its last claim began. The deadline is checked where
  the act happens: before a rollout's messages are handed to the MQTT client, before an
  outbox delete, before a block request is answered, and on the MQTT client's thread just
  before each message's packet is written
  (``may_send``, agent.wire.send_gate: messages queued in the client past their deadline are
  dropped, never sent). A process stopped (SIGSTOP, a VM paused) long enough for another
  instance to take over finds its deadlines passed when it runs again, and sends nothing.
  A claim that finds the instance's own deadline passed (it was held up) starts a new
  generation: the instance's own messages of an older one are never sent, and it sits out
  one lease (``lease_s``) before acting on its own account again: what was queued for it
  while it was held up (block requests at the broker, in its socket) arrives meanwhile and is
  dropped. Only rows committed under a then-current epoch are ever published; a new holder
  publishes again what the outbox still holds.
- **Outbox deletes under the epoch.** A row leaves the outbox (its message acknowledged) only
  where its rollout is still held by the deleting holder at the epoch it sent it under, or has
  finished (``outbox_delete_sql``): a resumed stale holder deletes nothing.
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
# A message's fence key: (rollout id, epoch), or ("", generation) for the instance's own.
Key = Tuple[str, int]
MAX_FINISHED = 1024  # rollouts finished here whose last messages may still be in flight


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


def outbox_delete_sql() -> str:
    """Delete one outbox row (id, rollout id, holder, epoch) only where its rollout has
    finished or is still held by that holder at that epoch."""
    return ("DELETE FROM outbox WHERE id = ? AND EXISTS (SELECT 1 FROM rollouts r WHERE "
            "r.rollout_id = ? AND (NOT {} OR (r.lease_holder = ? AND r.lease_epoch = ?)))"
            .format(ACTIVE_SQL.replace("state", "r.state")))


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
    """What this process holds: rollout id -> epoch, and until when (monotonic) it may act for
    each (``lease_s - margin`` after the start of the transaction that last renewed it), and
    for itself (``act_until``: the same after the start of its last claim, unbounded before
    its first; not before ``quiet_until`` after it was held up). ``may_send`` is read on the
    MQTT client's thread: the maps are replaced or updated one entry at a time, never left
    half made."""

    def __init__(self, holder: str, lease_s: float, margin_s: Optional[float] = None) -> None:
        self.holder = holder
        self.lease_s = float(lease_s)
        self.margin_s = max(0.5, 0.25 * self.lease_s) if margin_s is None else float(margin_s)
        self.epochs: Dict[str, int] = {}
        self.until: Dict[str, float] = {}
        self.act_until = float("inf")
        self.quiet_until = 0.0
        self.generation = 0  # one more each time the instance was found held up
        self.held_up_s = 0.0  # how far past its deadline it was, the last time
        # rollout id -> the epoch it finished under here: its last messages need no lease
        # (no instance takes a finished rollout), only this instance's own deadline.
        self.finished: Dict[str, int] = {}

    def claimed(self, held: Dict[str, int], started: float) -> None:
        """The result of a ``claim`` whose transaction began at ``started`` (monotonic)."""
        until = started + self.lease_s - self.margin_s
        self.until = {rid: until for rid in held}  # (before the epochs: see may_send)
        self.epochs = dict(held)
        if started >= self.act_until:  # held up past its own deadline before this claim
            self.generation += 1
            self.held_up_s = started - self.act_until
            self.quiet_until = time.monotonic() + self.lease_s
        self.act_until = until

    def renewed(self, rollout_id: str, started: float) -> None:
        if rollout_id in self.epochs:
            self.until[rollout_id] = started + self.lease_s - self.margin_s

    def fence(self, rollout_id: str) -> Optional[Fence]:
        epoch = self.epochs.get(rollout_id)
        return None if epoch is None else (self.holder, epoch, self.lease_s)

    def key(self, rollout_id: Optional[str] = None) -> Key:
        """The fence key of a rollout's messages, or (None, or not leased here) of the
        instance's own."""
        epoch = self.epochs.get(rollout_id) if rollout_id is not None else None
        return ("", self.generation) if epoch is None else (str(rollout_id), epoch)

    def may_act(self) -> bool:
        """Whether this instance may act on its own account now (answer block requests,
        delete acknowledged outbox rows, send messages of no lease)."""
        return self.quiet_until <= time.monotonic() < self.act_until

    def may_publish(self, rollout_id: str) -> bool:
        if rollout_id not in self.epochs:
            return self.may_act()  # not leased (an embedded rollout's own store, a finished one)
        return time.monotonic() < self.until.get(rollout_id, 0.0)

    def may_send(self, key: Key) -> bool:
        """(The MQTT client's thread, just before writing.) Whether a message of ``key`` may
        go: its rollout still held at its epoch and within the deadline, or finished here
        under that epoch and the instance within its own."""
        rid, epoch = key
        if not rid:
            return epoch == self.generation and self.may_act()
        if self.epochs.get(rid) == epoch:
            return time.monotonic() < self.until.get(rid, 0.0)
        return self.finished.get(rid) == epoch and self.may_act()

    def finish(self, rollout_id: str) -> None:
        """Its final state is written under this holder's epoch: its last messages go on
        under the instance's own deadline once the lease ends."""
        epoch = self.epochs.get(rollout_id)
        if epoch is None:
            return
        self.finished[rollout_id] = epoch
        while len(self.finished) > MAX_FINISHED:
            self.finished.pop(next(iter(self.finished)))

    def forget(self, rollout_id: str) -> None:
        self.epochs.pop(rollout_id, None)
        self.until.pop(rollout_id, None)
