"""The fleet database's revisions (Alembic), each frozen once released."""
