"""The audit trail (``audit``): one row per operator action, who, when, what and the outcome
(agent.fleet.database.audit). Created only where missing.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def _tables() -> sa.MetaData:
    T, D = sa.Text, sa.DOUBLE_PRECISION
    m = sa.MetaData()
    sa.Table("audit", m,
             sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"),
                       primary_key=True, autoincrement=True),
             sa.Column("ts", D, nullable=False), sa.Column("actor", T, nullable=False),
             sa.Column("via", T, nullable=False), sa.Column("action", T, nullable=False),
             sa.Column("target", T), sa.Column("args", T), sa.Column("outcome", T, nullable=False),
             sa.Column("message", T), sa.Index("audit_ts", "ts"))
    return m


def upgrade() -> None:
    _tables().create_all(op.get_bind(), checkfirst=True)


def downgrade() -> None:
    op.drop_table("audit")
