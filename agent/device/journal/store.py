"""Durable agent state in SQLite: jobs, artifact transfers, the outbox, named models, boot.

WAL mode with ``synchronous=FULL``: every write is one transaction that is on disk when the
call returns, so a SIGKILL or a power cut leaves either the old or the new state, never half of
one. One connection guarded by a lock serves every thread of the daemon; other processes (the
``status`` CLI) may read the same file concurrently.

``Journal`` owns the connection, the lock and the transactions, and the jobs and small notes
itself; the other tables are its parts: ``journal_schema`` (tables, version, opening),
``journal_outbox``, ``journal_transfers`` (partial downloads) and ``journal_models`` (named
models, their versions and rejections).
"""

import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Mapping,
    Optional,
    Set,
    Tuple,
)

from agent.device.journal import models as journal_models
from agent.device.journal import outbox as journal_outbox
from agent.device.journal import schema as journal_schema
from agent.device.journal import transfers as journal_transfers
from agent.device.journal.schema import Progress, dumps, loads
from agent.errors import AgentError
from agent.wire import protocol


class _Unset(object):
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Any = _Unset()  # "leave this field as it is" in set_state

Emit = Callable[[Dict[str, Any]], protocol.Publication]


class Journal(object):
    """The agent's durable state. Every method is thread-safe; every write is a transaction."""

    def __init__(self, path: str, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.RLock()
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        try:
            self._db = journal_schema.connect(path)
            with self._tx() as db:
                journal_schema.create(db, path)
        except sqlite3.DatabaseError as exc:
            raise AgentError("internal_error", "cannot open the journal {}: {}".format(path, exc))

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> "Journal":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction (BEGIN IMMEDIATE: takes the write lock up front)."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    self._db.execute("COMMIT")
                finally:
                    if self._db.in_transaction:  # an exception, or a failed COMMIT
                        self._db.execute("ROLLBACK")
            except sqlite3.OperationalError as exc:
                if "full" in str(exc):
                    raise AgentError("disk_full", "the journal {} cannot grow: {}".format(
                        self.path, exc))
                raise

    def _read(self, sql: str, args: Iterable[Any] = ()) -> List[Tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, tuple(args)).fetchall()

    # ------------------------------------------------------------------------------- jobs

    def add_job(
        self,
        doc: Mapping[str, Any],
        state: str = "QUEUED",
        error: Optional[Mapping[str, Any]] = None,
        emit: Optional[Emit] = None,
    ) -> bool:
        """Record a newly received job (version 1). False when the id is already known: a job
        id runs at most once. ``state`` is QUEUED, or REJECTED for a document that failed
        validation (``doc`` may then hold only ``job_id`` and maybe ``kind``)."""
        job_id = protocol.check_id("job id", doc.get("job_id"))
        if not protocol.next_state_ok(None, state):
            raise AgentError("bad_state_transition",
                             "a new job starts QUEUED or REJECTED, found {!r}".format(state))
        kind = doc.get("kind")
        kind = kind if isinstance(kind, str) and len(kind) <= 64 else ""
        now = self._clock()
        with self._tx() as db:
            cur = db.execute(
                "INSERT OR IGNORE INTO jobs (job_id, kind, doc, state, version, details, error, "
                "received, updated, attempts) VALUES (?, ?, ?, ?, 1, '{}', ?, ?, ?, 0)",
                (job_id, kind, dumps(doc), state, dumps(error) if error else None, now, now),
            )
            if cur.rowcount == 0:
                return False
            if emit is not None:
                self._emit(db, emit, job_id)
        return True

    def set_state(
        self,
        job_id: str,
        state: str,
        *,
        stage: Optional[str] = UNSET,
        progress: Progress = UNSET,
        details: Optional[Mapping[str, Any]] = None,
        error: Optional[Mapping[str, Any]] = None,
        result: Optional[Mapping[str, Any]] = None,
        emit: Optional[Emit] = None,
    ) -> int:
        """Move a job to ``state`` (the same state records progress) and return its new
        version. Fields left out keep their value; ``details`` replaces the statusDetails map.
        ``emit(row)`` builds a Publication of the updated row that enters the outbox in the
        same transaction (coalesced per topic when retained), so a state change and its
        status message are never separated by a crash.
        AgentError unknown_job, bad_state_transition, bad_argument."""
        if state not in protocol.STATES:
            raise AgentError("bad_argument", "job state must be one of {}, found {!r}".format(
                ", ".join(protocol.STATES), state))
        sets = ["state = ?", "version = version + 1", "updated = ?"]
        args: List[Any] = [state, self._clock()]
        if stage is not UNSET:
            if stage is not None and stage not in protocol.STAGES:
                raise AgentError("bad_argument", "job stage must be one of {}, found {!r}".format(
                    ", ".join(protocol.STAGES), stage))
            sets.append("stage = ?")
            args.append(stage)
        if progress is not UNSET:
            done, of = journal_schema.progress_columns(progress)
            sets += ["progress_done = ?", "progress_of = ?"]
            args += [done, of]
        if details is not None:
            sets.append("details = ?")
            args.append(dumps({str(k): str(v) for k, v in details.items()}))
        if error is not None:
            if not isinstance(error.get("code"), str):
                raise AgentError("bad_argument", "a job error needs a code, found {!r}".format(
                    error))
            sets.append("error = ?")
            args.append(dumps(error))
        if result is not None:
            sets.append("result = ?")
            args.append(dumps(result))
        with self._tx() as db:
            row = db.execute("SELECT state, version FROM jobs WHERE job_id = ?",
                             (job_id,)).fetchone()
            if row is None:
                raise AgentError("unknown_job", "no job {!r} in the journal".format(job_id))
            if not protocol.next_state_ok(row[0], state):
                raise AgentError("bad_state_transition", "job {!r} cannot go from {} to {}".format(
                    job_id, row[0], state))
            if row[0] == "QUEUED" and state == "IN_PROGRESS":
                sets.append("attempts = attempts + 1")
            db.execute("UPDATE jobs SET {} WHERE job_id = ?".format(", ".join(sets)),
                       args + [job_id])
            if emit is not None:
                self._emit(db, emit, job_id)
            return int(row[1]) + 1

    def _emit(self, db: sqlite3.Connection, emit: Emit, job_id: str) -> None:
        row = db.execute("SELECT {} FROM jobs WHERE job_id = ?".format(journal_schema.JOB_COLUMNS),
                         (job_id,)).fetchone()
        pub = emit(journal_schema.job_row(row))
        journal_outbox.insert(db, pub.topic, pub.payload, pub.qos, pub.retain, pub.retain,
                              self._clock())

    def bump_attempts(self, job_id: str) -> int:
        """Count one more attempt (a job re-run after an agent restart); returns the count."""
        with self._tx() as db:
            cur = db.execute("UPDATE jobs SET attempts = attempts + 1 WHERE job_id = ?",
                             (job_id,))
            if cur.rowcount == 0:
                raise AgentError("unknown_job", "no job {!r} in the journal".format(job_id))
            return int(db.execute("SELECT attempts FROM jobs WHERE job_id = ?",
                                  (job_id,)).fetchone()[0])

    def job(self, job_id: str) -> Optional[Dict[str, Any]]:
        rows = self._read("SELECT {} FROM jobs WHERE job_id = ?".format(
            journal_schema.JOB_COLUMNS), (job_id,))
        return journal_schema.job_row(rows[0]) if rows else None

    def jobs(self, states: Optional[Iterable[str]] = None,
             limit: Optional[int] = None) -> List[Dict[str, Any]]:
        """Jobs, oldest received first, optionally only those in ``states``."""
        sql = "SELECT {} FROM jobs".format(journal_schema.JOB_COLUMNS)
        args: List[Any] = []
        if states is not None:
            wanted = list(states)
            sql += " WHERE state IN ({})".format(", ".join("?" * len(wanted)) or "NULL")
            args += wanted
        sql += " ORDER BY received, rowid"
        if limit is not None:
            sql += " LIMIT ?"
            args.append(int(limit))
        return [journal_schema.job_row(r) for r in self._read(sql, args)]

    def unfinished_jobs(self) -> List[Dict[str, Any]]:
        """QUEUED and IN_PROGRESS jobs, oldest first: what a restarted agent must pick up."""
        return self.jobs(("QUEUED", "IN_PROGRESS"))

    def prune(self, keep: int = 1000) -> int:
        """Drop document and result of all but the ``keep`` newest finished jobs; their ids and
        states stay, so a replayed old job is still recognised. Returns rows pruned."""
        terminal = sorted(protocol.TERMINAL_STATES)
        with self._tx() as db:
            cur = db.execute(
                "UPDATE jobs SET doc = NULL, result = NULL WHERE doc IS NOT NULL AND state IN "
                "({q}) AND job_id NOT IN (SELECT job_id FROM jobs WHERE state IN ({q}) "
                "ORDER BY updated DESC LIMIT ?)".format(q=", ".join("?" * len(terminal))),
                terminal + terminal + [int(keep)])
            return int(cur.rowcount)

    def referenced_artifacts(self) -> Set[str]:
        """Artifacts that must not be evicted: those of unfinished jobs and the models of
        active and previous engines."""
        out: Set[str] = set()
        for job in self.unfinished_jobs():
            for ref in ((job["doc"] or {}).get("artifacts") or {}).values():
                if isinstance(ref, dict) and protocol.valid_sha256(ref.get("sha256")):
                    out.add(ref["sha256"])
        out.update(r[0] for r in self._read("SELECT DISTINCT model_sha FROM models"))
        return out

    # ------------------------------------------------------------------------------- outbox

    def outbox_put(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                   coalesce: bool = False) -> int:
        """Queue a message until the broker acknowledges it; returns its seq. ``coalesce``
        first drops pending messages to the same topic (right for retained state)."""
        with self._tx() as db:
            return journal_outbox.insert(db, topic, payload, qos, retain, coalesce,
                                         self._clock())

    def outbox_replace(self, seq: int, payload: bytes) -> bool:
        with self._tx() as db:
            return journal_outbox.replace(db, seq, payload)

    def outbox_pending(self, limit: Optional[int] = None) -> List[journal_outbox.OutboxItem]:
        with self._lock:
            return journal_outbox.pending(self._db, limit)

    def outbox_ack(self, seq: int) -> bool:
        with self._tx() as db:
            return journal_outbox.ack(db, seq)

    def outbox_count(self) -> int:
        with self._lock:
            return journal_outbox.count(self._db)

    # ------------------------------------------------------------------------------- transfers

    def transfer_get(self, sha256: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            return journal_transfers.get(self._db, sha256)

    def transfer_put(self, sha256: str, size: int, block_size: int, bitmap: bytes) -> None:
        with self._tx() as db:
            journal_transfers.put(db, sha256, size, block_size, bitmap, self._clock())

    def transfer_update(self, sha256: str, bitmap: bytes) -> None:
        with self._tx() as db:
            journal_transfers.update(db, sha256, bitmap, self._clock())

    def transfer_delete(self, sha256: str) -> None:
        with self._tx() as db:
            journal_transfers.delete(db, sha256)

    def transfers(self) -> List[Dict[str, Any]]:
        with self._lock:
            return journal_transfers.every(self._db)

    # ------------------------------------------------------------------------------- models

    def activate_version(self, name: str, version: str, model_sha: str, engine_key: str,
                         precision: Optional[str] = None, job_id: Optional[str] = None,
                         info: Optional[Mapping[str, Any]] = None, state: str = "committed",
                         deadline: Optional[float] = None, keep: int = 2
                         ) -> Tuple[Optional[Dict[str, Any]], List[str]]:
        """Make ``version`` the active version of ``name``; returns (the version it replaced,
        versions no longer kept), see ``journal_models.activate``."""
        now = self._clock()
        with self._tx() as db:
            return journal_models.activate(db, name, version, model_sha, engine_key, precision,
                                           job_id, info or {}, now, state, deadline, keep)

    def commit_version(self, name: str, version: str, keep: int = 2) -> List[str]:
        with self._tx() as db:
            return journal_models.commit(db, name, version, keep)

    def expire_pending(self, name: str, version: str, reason: str) -> None:
        with self._tx() as db:
            journal_models.expire(db, name, version, reason)

    def retry_pending(self, name: str, version: str, deadline: float, retries: int,
                      reason: str) -> None:
        with self._tx() as db:
            journal_models.retry_pending(db, name, version, deadline, retries, reason)

    def restore_version(self, name: str, to_version: Optional[str],
                        reject_reason: Optional[str] = None) -> Optional[Dict[str, Any]]:
        """The kept ``to_version`` active again; returns the dropped active row."""
        with self._tx() as db:
            return journal_models.restore(db, name, to_version, self._clock(), reject_reason)

    def reject_version(self, name: str, version: str, model_sha: Optional[str],
                       reason: str) -> None:
        with self._tx() as db:
            journal_models.reject(db, name, version, model_sha, reason, self._clock())

    def forget_model(self, name: str) -> List[str]:
        """Every kept version of ``name`` (journal_models.forget_name)."""
        with self._tx() as db:
            return journal_models.forget_name(db, name)

    def forget_rejected(self, name: str, version: str) -> bool:
        with self._tx() as db:
            return journal_models.forget_rejected(db, name, version)

    def rejected_versions(self, name: Optional[str] = None) -> List[Dict[str, Any]]:
        with self._lock:
            return journal_models.rejected(self._db, name)

    def active_version(self, name: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            return journal_models.active(self._db, name)

    def model_version(self, name: str, version: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            return journal_models.version(self._db, name, version)

    def model_versions(self, name: Optional[str] = None) -> List[Dict[str, Any]]:
        """Kept versions of ``name`` (active first), or of every name."""
        with self._lock:
            if name is None:
                return journal_models.every(self._db)
            return journal_models.versions(self._db, name)

    def active_versions(self) -> List[Dict[str, Any]]:
        with self._lock:
            return journal_models.every_active(self._db)

    def pending_versions(self) -> List[Dict[str, Any]]:
        return [r for r in self.active_versions() if r["state"] == "pending"]

    # Today's per-model-sha view (status ``active_engines``, ``rollback`` by ``model``).

    def active_engines(self) -> List[Dict[str, Any]]:
        """The active version of every name as today's engine rows (``model`` = its sha)."""
        return [_engine_row(r) for r in self.active_versions()]

    def active_engine(self, model_sha: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            row = journal_models.by_model(self._db, model_sha)
        return _engine_row(row) if row else None

    def previous_engine(self, model_sha: str) -> Optional[Dict[str, Any]]:
        with self._lock:
            row = journal_models.by_model(self._db, model_sha)
            prev = (journal_models.version(self._db, row["name"], row["previous"])
                    if row and row["previous"] else None)
        return _engine_row(prev) if prev else None

    # ------------------------------------------------------------------------------- boot

    def next_boot(self) -> int:
        """Count one more start of the agent and return the counter (1 on the first)."""
        with self._tx() as db:
            row = db.execute("SELECT value FROM meta WHERE key = 'boot'").fetchone()
            boot = (int(row[0]) if row else 0) + 1
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('boot', ?)", (str(boot),))
            return boot

    def boot(self) -> int:
        rows = self._read("SELECT value FROM meta WHERE key = 'boot'")
        return int(rows[0][0]) if rows else 0

    def note_put(self, key: str, value: Mapping[str, Any]) -> None:
        """Keep a small JSON note (``connection``: the last session takeover) for ``status``."""
        with self._tx() as db:
            db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                       ("note:" + key, dumps(value)))

    def note(self, key: str) -> Optional[Dict[str, Any]]:
        rows = self._read("SELECT value FROM meta WHERE key = ?", ("note:" + key,))
        value = loads(rows[0][0]) if rows else None
        return value if isinstance(value, dict) else None

    # ------------------------------------------------------------------------------- signing

    def last_sequence(self, key_id: str) -> int:
        """The highest job-signature sequence accepted from ``key_id`` (0: none yet)."""
        rows = self._read("SELECT value FROM meta WHERE key = ?", ("seq:" + key_id,))
        return int(rows[0][0]) if rows else 0

    def record_sequence(self, key_id: str, seq: int) -> None:
        """Remember an accepted sequence; never lowers the stored one (replay protection)."""
        with self._tx() as db:
            row = db.execute("SELECT value FROM meta WHERE key = ?", ("seq:" + key_id,)).fetchone()
            if row is None or int(row[0]) < seq:
                db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                           ("seq:" + key_id, str(int(seq))))


def _engine_row(r: Mapping[str, Any]) -> Dict[str, Any]:
    return {"model": r["model"], "engine_key": r["engine_key"], "precision": r["precision"],
            "activated": r["activated"], "job_id": r["job_id"], "info": r["info"],
            "name": r["name"], "version": r["version"], "state": r["state"]}
