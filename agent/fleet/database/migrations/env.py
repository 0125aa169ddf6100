"""Alembic's environment for the fleet database: always online, on the connection that
``agent.fleet.database.migrate`` opened (already in its transaction, under its lock); never from
``alembic.ini`` or a URL of its own."""

from alembic import context

from agent.fleet.database import tables
from agent.fleet.database.migrate import compare_type

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=tables.metadata,
                  compare_type=compare_type)
with context.begin_transaction():
    context.run_migrations()
