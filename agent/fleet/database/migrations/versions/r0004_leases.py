"""Fast, safe takeover (fleet.database.leases, fleet.database.instance_name): a rollout's lease
carries a fencing epoch (``rollouts.lease_epoch``, one more at every change of holder) and the
process holding it (``rollouts.lease_holder``); each outbox row records the epoch it was
written under (``outbox.epoch``); a service row records its host's boot id
(``services.boot_id``) so that a restart can tell its own dead predecessor from a live
instance. Columns added only where missing.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

COLUMNS = (("rollouts", "lease_epoch", sa.BigInteger), ("rollouts", "lease_holder", sa.Text),
           ("outbox", "epoch", sa.BigInteger), ("services", "boot_id", sa.Text))


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    for table, column, kind in COLUMNS:
        if column not in {c["name"] for c in inspector.get_columns(table)}:
            op.add_column(table, sa.Column(column, kind()))


def downgrade() -> None:
    for table, column, _kind in reversed(COLUMNS):
        with op.batch_alter_table(table) as batch:
            batch.drop_column(column)
