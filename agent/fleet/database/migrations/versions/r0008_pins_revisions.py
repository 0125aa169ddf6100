"""Pins and deployment revisions (agent.fleet.deployments.pins, revisions): ``device_pins``
holds an operator's pin of one device's model to a version (``fleet pin``, or ``fleet
rollback`` of a device a deployment governs), which deployments honour; ``deployment_revisions``
keeps every spec a deployment has had, for ``fleet deployments undo`` (an existing
deployment's spec becomes its revision 1). Created only where missing.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

NAMES = ("device_pins", "deployment_revisions")


def _tables() -> sa.MetaData:
    T, D, N = sa.Text, sa.DOUBLE_PRECISION, sa.Integer
    m = sa.MetaData()
    sa.Table("device_pins", m, sa.Column("device_id", T, primary_key=True),
             sa.Column("name", T, primary_key=True), sa.Column("version", T),
             sa.Column("actor", T), sa.Column("reason", T), sa.Column("created", D))
    sa.Table("deployment_revisions", m, sa.Column("deployment_id", T, primary_key=True),
             sa.Column("revision", N, primary_key=True, autoincrement=False),
             sa.Column("version", T, nullable=False),
             sa.Column("selector", T, nullable=False), sa.Column("spec", T, nullable=False),
             sa.Column("actor", T), sa.Column("created", D))
    return m


def upgrade() -> None:
    _tables().create_all(op.get_bind(), checkfirst=True)
    # The deployments of the previous release: their spec as it is now is revision 1.
    op.execute("INSERT INTO deployment_revisions (deployment_id, revision, version, selector, "
               "spec, created) SELECT deployment_id, 1, version, selector, spec, created FROM "
               "deployments WHERE deployment_id NOT IN (SELECT deployment_id FROM "
               "deployment_revisions)")


def downgrade() -> None:
    for name in reversed(NAMES):
        op.drop_table(name)
