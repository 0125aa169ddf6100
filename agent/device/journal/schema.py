"""The journal's SQLite file: its tables, opening it (WAL, ``synchronous=FULL``), the schema
version check and its in-place upgrades, and the JSON columns' encoding that every part of the
journal shares.

Schema versions: 1 kept engines per model content hash (``engines``: slots active/previous);
2 keeps named models and their versions (``models``, ``rejected_versions``). A version-1 journal
is upgraded in place, in the opening transaction: each model's engines become the versions of
the name ``sha-<first 12 hex>`` (active: version ``<12 hex>``; previous: ``<12 hex>+<first 8 of
its engine key>``, the same rule as a second engine for a version now). The ``engines`` table
stays as it was (nothing is dropped), unused.
"""

import json
import sqlite3
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from agent.errors import AgentError
from agent.wire import protocol

SCHEMA_VERSION = 2
JOB_COLUMNS = ("job_id, kind, doc, state, version, stage, progress_done, progress_of, details, "
                "result, error, received, updated, attempts")

Progress = Union[Tuple[int, int], Mapping[str, int], None]  # (done, of), a dict, or none

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    doc TEXT,
    state TEXT NOT NULL,
    version INTEGER NOT NULL,
    stage TEXT,
    progress_done INTEGER,
    progress_of INTEGER,
    details TEXT NOT NULL DEFAULT '{}',
    result TEXT,
    error TEXT,
    received REAL NOT NULL,
    updated REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_by_state ON jobs (state);
CREATE TABLE IF NOT EXISTS transfers (
    sha256 TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    block_size INTEGER NOT NULL,
    bitmap BLOB NOT NULL,
    updated REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    topic TEXT NOT NULL,
    payload BLOB NOT NULL,
    qos INTEGER NOT NULL,
    retain INTEGER NOT NULL,
    created REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS outbox_by_topic ON outbox (topic);
CREATE TABLE IF NOT EXISTS engines (
    model_sha TEXT NOT NULL,
    slot TEXT NOT NULL CHECK (slot IN ('active', 'previous')),
    engine_key TEXT NOT NULL,
    precision TEXT,
    activated REAL NOT NULL,
    job_id TEXT,
    info TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (model_sha, slot)
);
CREATE TABLE IF NOT EXISTS models (
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    active INTEGER NOT NULL DEFAULT 0,
    state TEXT NOT NULL CHECK (state IN ('pending', 'committed')),
    model_sha TEXT NOT NULL,
    engine_key TEXT NOT NULL,
    precision TEXT,
    activated REAL NOT NULL,
    job_id TEXT,
    info TEXT NOT NULL DEFAULT '{}',
    deadline REAL,
    previous TEXT,
    PRIMARY KEY (name, version)
);
CREATE INDEX IF NOT EXISTS models_active ON models (active, name);
CREATE TABLE IF NOT EXISTS rejected_versions (
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    model_sha TEXT,
    reason TEXT NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (name, version)
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""


def connect(path: str) -> sqlite3.Connection:
    """One connection for every thread (the journal serialises them with its lock); WAL, so
    other processes (the ``status`` CLI) read while the daemon writes."""
    db = sqlite3.connect(path, timeout=30.0, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    return db


def create(db: sqlite3.Connection, path: str) -> None:
    """Inside a write transaction: the missing tables, then the version stamp. A journal
    written by a newer agent is refused rather than misread."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise AgentError(
            "internal_error",
            "journal {} has schema version {}, this agent knows up to {}".format(
                path, version, SCHEMA_VERSION))
    for statement in _SCHEMA.split(";"):
        if statement.strip():
            db.execute(statement)
    if version == 1:
        _upgrade_1_to_2(db)
    db.execute("PRAGMA user_version={}".format(SCHEMA_VERSION))


def _upgrade_1_to_2(db: sqlite3.Connection) -> None:
    """Per-sha engines -> the versions of the name ``sha-<12 hex>`` (see the module's text)."""
    rows = db.execute("SELECT model_sha, slot, engine_key, precision, activated, job_id, info "
                      "FROM engines ORDER BY model_sha, slot").fetchall()
    by_sha: Dict[str, Dict[str, Tuple[Any, ...]]] = {}
    for row in rows:
        by_sha.setdefault(row[0], {})[row[1]] = row
    for sha, slots in by_sha.items():
        name, active_version = "sha-" + sha[:12], sha[:12]
        previous = slots.get("previous")
        previous_version = None
        if previous is not None:
            previous_version = "{}+{}".format(sha[:12], previous[2][:8])
            _insert_upgraded(db, name, previous_version, 0, previous, None)
        if "active" in slots:
            _insert_upgraded(db, name, active_version, 1, slots["active"], previous_version)


def _insert_upgraded(db: sqlite3.Connection, name: str, version: str, active: int,
                     row: Tuple[Any, ...], previous: Optional[str]) -> None:
    db.execute("INSERT OR IGNORE INTO models (name, version, active, state, model_sha, "
               "engine_key, precision, activated, job_id, info, deadline, previous) VALUES "
               "(?, ?, ?, 'committed', ?, ?, ?, ?, ?, ?, NULL, ?)",
               (name, version, active, row[0], row[2], row[3], row[4], row[5], row[6],
                previous))


def dumps(value: Any) -> str:
    return protocol.encode(value).decode("utf-8")


def loads(text: Optional[str]) -> Any:
    return None if text is None else json.loads(text)


def progress_columns(progress: Progress) -> Tuple[Optional[int], Optional[int]]:
    """A job's progress as its two columns (done, of); AgentError bad_argument."""
    if progress is None:
        return None, None
    if isinstance(progress, Mapping):
        done, of = progress.get("done"), progress.get("of")
    else:
        done, of = progress
    if not isinstance(done, int) or not isinstance(of, int) or done < 0 or of < 0:
        raise AgentError("bad_argument",
                         "progress must be (done, of) non-negative integers, found {!r}".format(
                             progress))
    return done, of


def job_row(r: Tuple[Any, ...]) -> Dict[str, Any]:
    return {
        "job_id": r[0],
        "kind": r[1],
        "doc": loads(r[2]),
        "state": r[3],
        "version": int(r[4]),
        "stage": r[5],
        "progress": None if r[6] is None else {"done": int(r[6]), "of": int(r[7])},
        "details": loads(r[8]) or {},
        "result": loads(r[9]),
        "error": loads(r[10]),
        "received": float(r[11]),
        "updated": float(r[12]),
        "attempts": int(r[13]),
    }
