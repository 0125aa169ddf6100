"""Baseline: the schema of the release before migrations.

The fleet database exactly as that release made it (schema version 1 in ``meta``; tables and
indexes of the store, the rollback log, device models and the telemetry history). Frozen: a
later change is a later revision, never an edit here.

A database made before migrations (no ``alembic_version`` table) is recognised by its tables,
completed with whatever of this it lacks (``create(bind, checkfirst=True)``) and stamped here
by ``agent.fleet.database.migrate``.

Revision ID: 0001
Revises:
Create Date: 2026-01-01
"""

from typing import Any

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

T = sa.Text
D = sa.DOUBLE_PRECISION


def _serial() -> Any:
    return sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def baseline_metadata() -> sa.MetaData:
    m = sa.MetaData()
    sa.Table("meta", m, sa.Column("key", T, primary_key=True), sa.Column("value", T))
    sa.Table("devices", m, sa.Column("device_id", T, primary_key=True),
             sa.Column("online", sa.Integer), sa.Column("boot", sa.BigInteger),
             sa.Column("board", T), sa.Column("platform", T), sa.Column("status", T),
             sa.Column("reason", T), sa.Column("first_seen", D), sa.Column("last_seen", D),
             sa.Column("telemetry", T), sa.Column("telemetry_ts", D))
    sa.Table("rollouts", m, sa.Column("rollout_id", T, primary_key=True),
             sa.Column("spec", T, nullable=False), sa.Column("state", T, nullable=False),
             sa.Column("outcome", T), sa.Column("reason", T),
             sa.Column("current_stage", sa.Integer), sa.Column("halted", sa.Integer),
             sa.Column("paused", sa.Integer), sa.Column("created", D),
             sa.Column("deadline", D), sa.Column("updated", D), sa.Column("finished", D),
             sa.Column("owner", T), sa.Column("lease_until", D), sa.Column("control", T),
             sa.Index("rollouts_created", "created"))
    sa.Table("stages", m, sa.Column("rollout_id", T, primary_key=True, nullable=False),
             sa.Column("idx", sa.Integer, primary_key=True, nullable=False,
                       autoincrement=False),
             sa.Column("devices", T, nullable=False))
    sa.Table("jobs", m, sa.Column("rollout_id", T, primary_key=True, nullable=False),
             sa.Column("device_id", T, primary_key=True, nullable=False),
             sa.Column("stage", sa.Integer, nullable=False),
             sa.Column("state", T, nullable=False), sa.Column("data", T, nullable=False),
             sa.Column("updated", D), sa.Index("jobs_device", "device_id", "state"))
    sa.Table("job_history", m,
             sa.Column("id", _serial(), primary_key=True, autoincrement=True),
             sa.Column("rollout_id", T, nullable=False),
             sa.Column("device_id", T, nullable=False), sa.Column("job_id", T, nullable=False),
             sa.Column("version", sa.BigInteger), sa.Column("state", T),
             sa.Column("stage", T), sa.Column("ts", D), sa.Column("received", D),
             sa.Index("job_history_run", "rollout_id", "device_id"),
             sa.Index("job_history_dev", "device_id", "id"))
    sa.Table("artifacts", m, sa.Column("sha256", T, primary_key=True),
             sa.Column("size", sa.BigInteger, nullable=False), sa.Column("name", T),
             sa.Column("path", T, nullable=False), sa.Column("added", D))
    sa.Table("signing_seq", m, sa.Column("key_id", T, primary_key=True),
             sa.Column("seq", sa.BigInteger, nullable=False))
    sa.Table("outbox", m, sa.Column("id", _serial(), primary_key=True, autoincrement=True),
             sa.Column("rollout_id", T), sa.Column("topic", T, nullable=False),
             sa.Column("payload", sa.LargeBinary), sa.Column("retain", sa.Integer,
                                                              nullable=False),
             sa.Column("created", D))
    sa.Table("device_models", m, sa.Column("device_id", T, primary_key=True),
             sa.Column("boot", sa.BigInteger), sa.Column("message", T, nullable=False),
             sa.Column("updated", D))
    sa.Table("rollbacks", m, sa.Column("request_id", T, primary_key=True),
             sa.Column("rollout_id", T), sa.Column("device_id", T, nullable=False),
             sa.Column("model", T), sa.Column("name", T), sa.Column("version", T),
             sa.Column("sent", D, nullable=False), sa.Column("replied", D),
             sa.Column("ok", sa.Integer), sa.Column("error_code", T),
             sa.Column("error_message", T), sa.Column("result", T), sa.Column("origin", T),
             sa.Index("rollbacks_rollout", "rollout_id", "sent"),
             sa.Index("rollbacks_device", "device_id", "sent"))
    sa.Table("services", m, sa.Column("instance", T, primary_key=True),
             sa.Column("heartbeat", D), sa.Column("pid", sa.Integer), sa.Column("host", T),
             sa.Column("started", D))
    sa.Table("telemetry_history", m, sa.Column("device_id", T, nullable=False),
             sa.Column("ts", D, nullable=False), sa.Column("metrics", T, nullable=False),
             sa.Index("telemetry_history_dev", "device_id", "ts"))
    return m


def create(bind: Any, checkfirst: bool = False) -> None:
    """Every baseline table and index (``checkfirst``: only those missing, indexes of tables
    that exist included) and the ``meta`` row ``schema = 1``."""
    m = baseline_metadata()
    inspector = sa.inspect(bind)
    existing = set(inspector.get_table_names()) if checkfirst else set()
    m.create_all(bind, checkfirst=checkfirst)
    for name in sorted(existing & set(m.tables)):
        have = {i["name"] for i in inspector.get_indexes(name)}
        for index in sorted(m.tables[name].indexes, key=lambda i: str(i.name)):
            if index.name not in have:
                index.create(bind)
    meta = m.tables["meta"]
    if not bind.execute(sa.select(meta.c.key).where(meta.c.key == "schema")).first():
        bind.execute(meta.insert().values(key="schema", value="1"))


def upgrade() -> None:
    create(op.get_bind())


def downgrade() -> None:
    for table in reversed(baseline_metadata().sorted_tables):
        op.drop_table(table.name)
