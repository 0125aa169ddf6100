"""The model registry (``model_versions``), operator-assigned device labels (``device_labels``)
and deployments as desired state (``deployments``, ``deployment_rollouts``,
``deployment_devices``, ``deployment_retries``): agent.fleet.deployments.registry, labels,
deployments. Created only where missing.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

NAMES = ("model_versions", "device_labels", "deployments", "deployment_rollouts",
         "deployment_devices", "deployment_retries")


def _tables() -> sa.MetaData:
    T, D = sa.Text, sa.DOUBLE_PRECISION
    m = sa.MetaData()
    sa.Table("model_versions", m, sa.Column("name", T, primary_key=True),
             sa.Column("version", T, primary_key=True), sa.Column("digest", T, nullable=False),
             sa.Column("record", T, nullable=False), sa.Column("created", D))
    sa.Table("device_labels", m, sa.Column("device_id", T, primary_key=True),
             sa.Column("labels", T, nullable=False), sa.Column("updated", D, nullable=False),
             sa.Index("device_labels_updated", "updated"))
    sa.Table("deployments", m, sa.Column("deployment_id", T, primary_key=True),
             sa.Column("name", T, nullable=False), sa.Column("version", T, nullable=False),
             sa.Column("selector", T, nullable=False), sa.Column("spec", T, nullable=False),
             sa.Column("state", T, nullable=False), sa.Column("reason", T),
             sa.Column("superseded_by", T), sa.Column("created", D), sa.Column("updated", D))
    sa.Table("deployment_rollouts", m, sa.Column("rollout_id", T, primary_key=True),
             sa.Column("deployment_id", T, nullable=False), sa.Column("kind", T, nullable=False),
             sa.Column("created", D), sa.Index("deployment_rollouts_dep", "deployment_id"))
    sa.Table("deployment_devices", m, sa.Column("deployment_id", T, primary_key=True),
             sa.Column("device_id", T, primary_key=True), sa.Column("state", T, nullable=False),
             sa.Column("reason", T), sa.Column("updated", D),
             sa.Index("deployment_devices_device", "device_id"))
    sa.Table("deployment_retries", m, sa.Column("deployment_id", T, primary_key=True),
             sa.Column("device_id", T, primary_key=True), sa.Column("at", D, nullable=False))
    return m


def upgrade() -> None:
    _tables().create_all(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    for name in reversed(NAMES):
        op.drop_table(name)
