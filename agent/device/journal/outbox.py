"""The journal's outbox: messages kept until the broker acknowledges them (PUBACK), sent in
the order queued, retained state coalesced per topic. Functions over the journal's connection:
the journal calls them under its lock, the writes inside its transactions, so a job's state
change and its status message enter the journal together.
"""

import logging
import sqlite3
from typing import Any, List, NamedTuple, Optional

from agent.errors import AgentError
from agent.wire import message_caps, protocol

log = logging.getLogger("agent.device.journal.store")  # the outbox is part of the journal

# The largest outbox message: a job status (agent.wire.message_caps keeps them under it).
OUTBOX_MAX_BYTES = protocol.MAX_BYTES["job_status"]


class OutboxItem(NamedTuple):
    seq: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    created: float


def insert(db: sqlite3.Connection, topic: str, payload: bytes, qos: int, retain: bool,
           coalesce: bool, now: float) -> int:
    """Queue a message; its seq. ``coalesce`` first drops pending messages to the same topic
    (right for retained state)."""
    payload = fit(topic, payload)
    if coalesce:
        db.execute("DELETE FROM outbox WHERE topic = ?", (topic,))
    cur = db.execute(
        "INSERT INTO outbox (topic, payload, qos, retain, created) VALUES (?, ?, ?, ?, ?)",
        (topic, bytes(payload), int(qos), 1 if retain else 0, now))
    return int(cur.lastrowid or 0)


def fit(topic: str, payload: bytes) -> bytes:
    """Checked before anything is stored: the outbox never holds a message over its topic's
    limit (a broker would refuse it and drop the connection on every resend). An oversized
    job status becomes its short form; anything else is refused."""
    limit = OUTBOX_MAX_BYTES
    if len(payload) <= limit:
        return payload
    short = message_caps.short_job_status_payload(payload)
    if short is not None and len(short) <= limit:
        log.warning("outbox: a %d-byte status on %s stored in its short form (%d bytes)",
                    len(payload), topic[:200], len(short))
        return short
    raise AgentError("message_too_large", "an outbox message may be at most {} bytes, "
                     "found {}".format(limit, len(payload)))


def replace(db: sqlite3.Connection, seq: int, payload: bytes) -> bool:
    """Put ``payload`` in place of message ``seq`` (a short form the broker accepts); False
    when ``seq`` is no longer pending."""
    row = db.execute("SELECT topic FROM outbox WHERE seq = ?", (int(seq),)).fetchone()
    if row is None:
        return False
    payload = fit(row[0], payload)
    return db.execute("UPDATE outbox SET payload = ? WHERE seq = ?",
                      (bytes(payload), int(seq))).rowcount > 0


def pending(db: sqlite3.Connection, limit: Optional[int] = None) -> List[OutboxItem]:
    """Unacknowledged messages in the order they were queued."""
    sql = "SELECT seq, topic, payload, qos, retain, created FROM outbox ORDER BY seq"
    args: List[Any] = []
    if limit is not None:
        sql += " LIMIT ?"
        args.append(int(limit))
    return [OutboxItem(int(r[0]), r[1], bytes(r[2]), int(r[3]), bool(r[4]), float(r[5]))
            for r in db.execute(sql, tuple(args)).fetchall()]


def ack(db: sqlite3.Connection, seq: int) -> bool:
    """The broker acknowledged message ``seq``: forget it. False if unknown (already
    acknowledged, or coalesced away)."""
    return db.execute("DELETE FROM outbox WHERE seq = ?", (int(seq),)).rowcount > 0


def count(db: sqlite3.Connection) -> int:
    return int(db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0])
