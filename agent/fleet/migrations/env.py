"""Alembic's environment for the fleet database: always online, on the connection that
``agent.fleet.migrate`` opened (already in its transaction, under its lock); never from
``alembic.ini`` or a URL of its own."""

from typing import Any, Optional

import sqlalchemy as sa
from alembic import context

from agent.fleet import tables


def compare_type(_ctx: Any, _inspected: Any, _declared: Any, found: Any, declared: Any
                 ) -> Optional[bool]:
    """Floats are equal (SQLite reflects DOUBLE PRECISION as REAL); else Alembic decides."""
    if isinstance(found, sa.Float) and isinstance(declared, sa.Float):
        return False
    return None


connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=tables.metadata,
                  compare_type=compare_type)
with context.begin_transaction():
    context.run_migrations()
