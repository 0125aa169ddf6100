"""The fleet database's tables, created when missing, in both dialects (``{serial}`` and
``{blob}`` are the only words that differ), and the schema version stamp.
"""

from agent.fleet.db import Db

SCHEMA_VERSION = 1

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS devices (
  device_id TEXT PRIMARY KEY, online INTEGER, boot BIGINT, board TEXT, platform TEXT,
  status TEXT, reason TEXT, first_seen DOUBLE PRECISION, last_seen DOUBLE PRECISION,
  telemetry TEXT, telemetry_ts DOUBLE PRECISION);
CREATE TABLE IF NOT EXISTS rollouts (
  rollout_id TEXT PRIMARY KEY, spec TEXT NOT NULL, state TEXT NOT NULL, outcome TEXT,
  reason TEXT, current_stage INTEGER, halted INTEGER, paused INTEGER,
  created DOUBLE PRECISION, deadline DOUBLE PRECISION, updated DOUBLE PRECISION,
  finished DOUBLE PRECISION, owner TEXT, lease_until DOUBLE PRECISION, control TEXT);
CREATE INDEX IF NOT EXISTS rollouts_created ON rollouts (created);
CREATE TABLE IF NOT EXISTS stages (
  rollout_id TEXT NOT NULL, idx INTEGER NOT NULL, devices TEXT NOT NULL,
  PRIMARY KEY (rollout_id, idx));
CREATE TABLE IF NOT EXISTS jobs (
  rollout_id TEXT NOT NULL, device_id TEXT NOT NULL, stage INTEGER NOT NULL,
  state TEXT NOT NULL, data TEXT NOT NULL, updated DOUBLE PRECISION,
  PRIMARY KEY (rollout_id, device_id));
CREATE INDEX IF NOT EXISTS jobs_device ON jobs (device_id, state);
CREATE TABLE IF NOT EXISTS job_history (
  id {serial} PRIMARY KEY, rollout_id TEXT NOT NULL, device_id TEXT NOT NULL,
  job_id TEXT NOT NULL, version BIGINT, state TEXT, stage TEXT, ts DOUBLE PRECISION,
  received DOUBLE PRECISION);
CREATE INDEX IF NOT EXISTS job_history_run ON job_history (rollout_id, device_id);
CREATE TABLE IF NOT EXISTS artifacts (
  sha256 TEXT PRIMARY KEY, size BIGINT NOT NULL, name TEXT, path TEXT NOT NULL,
  added DOUBLE PRECISION);
CREATE TABLE IF NOT EXISTS signing_seq (key_id TEXT PRIMARY KEY, seq BIGINT NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (
  id {serial} PRIMARY KEY, rollout_id TEXT, topic TEXT NOT NULL, payload {blob},
  retain INTEGER NOT NULL, created DOUBLE PRECISION);
CREATE TABLE IF NOT EXISTS device_models (
  device_id TEXT PRIMARY KEY, boot BIGINT, message TEXT NOT NULL, updated DOUBLE PRECISION);
CREATE TABLE IF NOT EXISTS rollbacks (
  request_id TEXT PRIMARY KEY, rollout_id TEXT, device_id TEXT NOT NULL, model TEXT,
  name TEXT, version TEXT, sent DOUBLE PRECISION NOT NULL, replied DOUBLE PRECISION,
  ok INTEGER, error_code TEXT, error_message TEXT, result TEXT, origin TEXT);
CREATE INDEX IF NOT EXISTS rollbacks_rollout ON rollbacks (rollout_id, sent);
CREATE INDEX IF NOT EXISTS rollbacks_device ON rollbacks (device_id, sent);
CREATE TABLE IF NOT EXISTS services (
  instance TEXT PRIMARY KEY, heartbeat DOUBLE PRECISION, pid INTEGER, host TEXT,
  started DOUBLE PRECISION);
"""


def create(db: Db) -> None:
    """The missing tables and the version stamp, in one transaction (PostgreSQL: under an
    advisory lock, for two services starting at once)."""
    serial = "BIGSERIAL" if db.dialect == "postgresql" else "INTEGER"
    blob = "BYTEA" if db.dialect == "postgresql" else "BLOB"
    with db.transaction():
        if db.dialect == "postgresql":
            db.execute("SELECT pg_advisory_xact_lock(7216)")
        from agent.fleet import deployments, labels, registry

        # The registry, labels and deployments own their tables (same dialect words).
        ddl = _DDL + registry.DDL + labels.DDL + deployments.DDL
        for stmt in ddl.format(serial=serial, blob=blob).split(";"):
            if stmt.strip():
                db.execute(stmt)
        db.execute("INSERT INTO meta (key, value) VALUES ('schema', ?) ON CONFLICT "
                   "(key) DO NOTHING", (str(SCHEMA_VERSION),))
