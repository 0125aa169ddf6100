"""Alembic's script directory for the fleet database: ``env.py`` (runs on the connection that
``agent.fleet.database.migrate`` hands it) and ``versions/`` (one file per revision, oldest first:
``r0001_baseline.py`` is the schema of the release before migrations)."""
