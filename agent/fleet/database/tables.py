"""The fleet database's schema, declared once: every table and index the controller keeps, as
SQLAlchemy Core ``Table`` metadata. Dialect differences are types here, not words in DDL
strings: ``SERIAL`` (BIGSERIAL on PostgreSQL, a rowid ``INTEGER PRIMARY KEY`` on SQLite) and
``LargeBinary`` (BYTEA / BLOB).

This is the schema *now*; ``agent/fleet/database/migrations/versions/`` is how a database gets here
(tests/integration/test_fleet_migrations.py checks that upgrading any database gives exactly
this). To add a table or a column: declare it here AND add a revision (docs/fleet.md, "The
database: schema and migrations"). Queries stay in SQL strings through ``agent.fleet.database.db``.

Only the database modules import this (SQLAlchemy is the controller's, and lazy: see
``agent.fleet.database.store_schema``).
"""

import sqlalchemy as sa

metadata = sa.MetaData()

TEXT = sa.Text
DOUBLE = sa.DOUBLE_PRECISION
# An auto-numbered id: BIGSERIAL on PostgreSQL; on SQLite an INTEGER PRIMARY KEY (the rowid).
SERIAL = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _id() -> sa.Column:
    return sa.Column("id", SERIAL, primary_key=True, autoincrement=True)


meta = sa.Table(
    "meta", metadata,
    sa.Column("key", TEXT, primary_key=True), sa.Column("value", TEXT))

devices = sa.Table(
    "devices", metadata,
    sa.Column("device_id", TEXT, primary_key=True), sa.Column("online", sa.Integer),
    sa.Column("boot", sa.BigInteger), sa.Column("board", TEXT), sa.Column("platform", TEXT),
    sa.Column("status", TEXT), sa.Column("reason", TEXT), sa.Column("first_seen", DOUBLE),
    sa.Column("last_seen", DOUBLE), sa.Column("telemetry", TEXT),
    sa.Column("telemetry_ts", DOUBLE))

rollouts = sa.Table(
    "rollouts", metadata,
    sa.Column("rollout_id", TEXT, primary_key=True), sa.Column("spec", TEXT, nullable=False),
    sa.Column("state", TEXT, nullable=False), sa.Column("outcome", TEXT),
    sa.Column("reason", TEXT), sa.Column("current_stage", sa.Integer),
    sa.Column("halted", sa.Integer), sa.Column("paused", sa.Integer),
    sa.Column("created", DOUBLE), sa.Column("deadline", DOUBLE), sa.Column("updated", DOUBLE),
    sa.Column("finished", DOUBLE), sa.Column("owner", TEXT), sa.Column("lease_until", DOUBLE),
    sa.Column("control", TEXT),
    # database.leases (revision 0004): the fencing epoch and the process holding the lease.
    sa.Column("lease_epoch", sa.BigInteger), sa.Column("lease_holder", TEXT),
    sa.Index("rollouts_created", "created"))

stages = sa.Table(
    "stages", metadata,
    sa.Column("rollout_id", TEXT, primary_key=True, nullable=False),
    sa.Column("idx", sa.Integer, primary_key=True, nullable=False, autoincrement=False),
    sa.Column("devices", TEXT, nullable=False))

jobs = sa.Table(
    "jobs", metadata,
    sa.Column("rollout_id", TEXT, primary_key=True, nullable=False),
    sa.Column("device_id", TEXT, primary_key=True, nullable=False),
    sa.Column("stage", sa.Integer, nullable=False), sa.Column("state", TEXT, nullable=False),
    sa.Column("data", TEXT, nullable=False), sa.Column("updated", DOUBLE),
    sa.Index("jobs_device", "device_id", "state"))

job_history = sa.Table(
    "job_history", metadata,
    _id(), sa.Column("rollout_id", TEXT, nullable=False),
    sa.Column("device_id", TEXT, nullable=False), sa.Column("job_id", TEXT, nullable=False),
    sa.Column("version", sa.BigInteger), sa.Column("state", TEXT), sa.Column("stage", TEXT),
    sa.Column("ts", DOUBLE), sa.Column("received", DOUBLE),
    sa.Index("job_history_run", "rollout_id", "device_id"),
    # The device page lists a device's last status changes (agent.fleet.web.views.status_history).
    sa.Index("job_history_dev", "device_id", "id"))

artifacts = sa.Table(
    "artifacts", metadata,
    sa.Column("sha256", TEXT, primary_key=True), sa.Column("size", sa.BigInteger,
                                                           nullable=False),
    sa.Column("name", TEXT), sa.Column("path", TEXT, nullable=False),
    sa.Column("added", DOUBLE))

signing_seq = sa.Table(
    "signing_seq", metadata,
    sa.Column("key_id", TEXT, primary_key=True), sa.Column("seq", sa.BigInteger,
                                                           nullable=False))

outbox = sa.Table(
    "outbox", metadata,
    _id(), sa.Column("rollout_id", TEXT), sa.Column("topic", TEXT, nullable=False),
    sa.Column("payload", sa.LargeBinary), sa.Column("retain", sa.Integer, nullable=False),
    sa.Column("created", DOUBLE), sa.Column("epoch", sa.BigInteger))  # epoch: revision 0004

device_models = sa.Table(
    "device_models", metadata,
    sa.Column("device_id", TEXT, primary_key=True), sa.Column("boot", sa.BigInteger),
    sa.Column("message", TEXT, nullable=False), sa.Column("updated", DOUBLE))

rollbacks = sa.Table(
    "rollbacks", metadata,
    sa.Column("request_id", TEXT, primary_key=True), sa.Column("rollout_id", TEXT),
    sa.Column("device_id", TEXT, nullable=False), sa.Column("model", TEXT),
    sa.Column("name", TEXT), sa.Column("version", TEXT),
    sa.Column("sent", DOUBLE, nullable=False), sa.Column("replied", DOUBLE),
    sa.Column("ok", sa.Integer), sa.Column("error_code", TEXT),
    sa.Column("error_message", TEXT), sa.Column("result", TEXT), sa.Column("origin", TEXT),
    sa.Index("rollbacks_rollout", "rollout_id", "sent"),
    sa.Index("rollbacks_device", "device_id", "sent"))

services = sa.Table(
    "services", metadata,
    sa.Column("instance", TEXT, primary_key=True), sa.Column("heartbeat", DOUBLE),
    sa.Column("pid", sa.Integer), sa.Column("host", TEXT), sa.Column("started", DOUBLE),
    sa.Column("boot_id", TEXT))  # boot_id: revision 0004 (agent.fleet.database.instance_name)

# agent.fleet.database.history: one row per device sample (no key: rows are only appended and
# pruned).
telemetry_history = sa.Table(
    "telemetry_history", metadata,
    sa.Column("device_id", TEXT, nullable=False), sa.Column("ts", DOUBLE, nullable=False),
    sa.Column("metrics", TEXT, nullable=False),
    sa.Index("telemetry_history_dev", "device_id", "ts"))

# agent.fleet.admission.admission (revision 0002): each device's admission state and pinned key.
device_keys = sa.Table(
    "device_keys", metadata,
    sa.Column("device_id", TEXT, primary_key=True), sa.Column("state", TEXT, nullable=False),
    sa.Column("key_id", TEXT), sa.Column("public_key", TEXT),
    sa.Column("pending_key_id", TEXT), sa.Column("pending_public_key", TEXT),
    sa.Column("pending_since", DOUBLE), sa.Column("pending_status", TEXT),
    sa.Column("updated", DOUBLE),
    sa.Index("device_keys_state", "state", "pending_since"))

# agent.fleet.deployments.registry, labels, deployments (revision 0003): the model registry, the
# labels an operator assigns, and deployments as desired state with their devices, rollouts and
# retries.
model_versions = sa.Table(
    "model_versions", metadata,
    sa.Column("name", TEXT, primary_key=True), sa.Column("version", TEXT, primary_key=True),
    sa.Column("digest", TEXT, nullable=False), sa.Column("record", TEXT, nullable=False),
    sa.Column("created", DOUBLE))

device_labels = sa.Table(
    "device_labels", metadata,
    sa.Column("device_id", TEXT, primary_key=True), sa.Column("labels", TEXT, nullable=False),
    sa.Column("updated", DOUBLE, nullable=False),
    sa.Index("device_labels_updated", "updated"))

deployments = sa.Table(
    "deployments", metadata,
    sa.Column("deployment_id", TEXT, primary_key=True), sa.Column("name", TEXT, nullable=False),
    sa.Column("version", TEXT, nullable=False), sa.Column("selector", TEXT, nullable=False),
    sa.Column("spec", TEXT, nullable=False), sa.Column("state", TEXT, nullable=False),
    sa.Column("reason", TEXT), sa.Column("superseded_by", TEXT), sa.Column("created", DOUBLE),
    sa.Column("updated", DOUBLE))

deployment_rollouts = sa.Table(
    "deployment_rollouts", metadata,
    sa.Column("rollout_id", TEXT, primary_key=True),
    sa.Column("deployment_id", TEXT, nullable=False), sa.Column("kind", TEXT, nullable=False),
    sa.Column("created", DOUBLE),
    sa.Index("deployment_rollouts_dep", "deployment_id"))

deployment_devices = sa.Table(
    "deployment_devices", metadata,
    sa.Column("deployment_id", TEXT, primary_key=True),
    sa.Column("device_id", TEXT, primary_key=True), sa.Column("state", TEXT, nullable=False),
    sa.Column("reason", TEXT), sa.Column("updated", DOUBLE),
    sa.Index("deployment_devices_device", "device_id"))

deployment_retries = sa.Table(
    "deployment_retries", metadata,
    sa.Column("deployment_id", TEXT, primary_key=True),
    sa.Column("device_id", TEXT, primary_key=True), sa.Column("at", DOUBLE, nullable=False))

# agent.fleet.database.audit (revision 0007): one row per operator action (bounded by age and
# count).
audit = sa.Table(
    "audit", metadata,
    _id(), sa.Column("ts", DOUBLE, nullable=False), sa.Column("actor", TEXT, nullable=False),
    sa.Column("via", TEXT, nullable=False), sa.Column("action", TEXT, nullable=False),
    sa.Column("target", TEXT), sa.Column("args", TEXT), sa.Column("outcome", TEXT,
                                                                  nullable=False),
    sa.Column("message", TEXT),
    sa.Index("audit_ts", "ts"))
# agent.fleet.database.blobs (revision 0006): the registry's content-addressed blob store (the
# directory is meta.blob_store) and each version's references to its blobs.
blobs = sa.Table(
    "blobs", metadata,
    sa.Column("sha256", TEXT, primary_key=True), sa.Column("size", sa.BigInteger,
                                                           nullable=False),
    sa.Column("added", DOUBLE), sa.Column("checked", DOUBLE), sa.Column("stat", TEXT),
    sa.Column("problem", TEXT))

blob_refs = sa.Table(
    "blob_refs", metadata,
    sa.Column("name", TEXT, primary_key=True), sa.Column("version", TEXT, primary_key=True),
    sa.Column("role", TEXT, primary_key=True), sa.Column("sha256", TEXT, nullable=False),
    sa.Index("blob_refs_sha256", "sha256"))
# agent.fleet.deployments.pins, revisions (revision 0008): an operator's pins of a device's
# model to a version (version NULL: pinned to what a rollback in flight makes active), and
# every spec a deployment has had.
device_pins = sa.Table(
    "device_pins", metadata,
    sa.Column("device_id", TEXT, primary_key=True), sa.Column("name", TEXT, primary_key=True),
    sa.Column("version", TEXT), sa.Column("actor", TEXT), sa.Column("reason", TEXT),
    sa.Column("created", DOUBLE))

deployment_revisions = sa.Table(
    "deployment_revisions", metadata,
    sa.Column("deployment_id", TEXT, primary_key=True),
    sa.Column("revision", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("version", TEXT, nullable=False),
    sa.Column("selector", TEXT, nullable=False), sa.Column("spec", TEXT, nullable=False),
    sa.Column("actor", TEXT), sa.Column("created", DOUBLE))
