"""Device admission: ``device_keys`` (each device's admission state and pinned public key,
agent.fleet.admission.admission). Created only where missing: a database a pre-migration build of
this release already gave the table keeps it.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _table(m: sa.MetaData) -> sa.Table:
    T, D = sa.Text, sa.DOUBLE_PRECISION
    return sa.Table(
        "device_keys", m,
        sa.Column("device_id", T, primary_key=True), sa.Column("state", T, nullable=False),
        sa.Column("key_id", T), sa.Column("public_key", T),
        sa.Column("pending_key_id", T), sa.Column("pending_public_key", T),
        sa.Column("pending_since", D), sa.Column("pending_status", T), sa.Column("updated", D),
        sa.Index("device_keys_state", "state", "pending_since"))


def upgrade() -> None:
    bind = op.get_bind()
    _table(sa.MetaData()).create(bind, checkfirst=True)


def downgrade() -> None:
    op.drop_table("device_keys")
