"""The fleet database's declared schema and its revisions agree with what opening a database
relies on without SQLAlchemy: ``store_schema.HEAD`` is Alembic's head, the baseline's tables are
the ones a database made before migrations is recognised by, and every baseline table is still
declared (a later revision adds tables; none is dropped without its own revision)."""

import importlib

from agent.fleet.database import migrate, store_schema, tables


def test_head_and_baseline_constants_match_the_revisions():
    revs = migrate.revisions()
    assert store_schema.HEAD == migrate.head() == revs[0]["revision"]
    assert revs[-1]["revision"] == store_schema.BASELINE and revs[-1]["down_revision"] is None
    assert len({r["revision"] for r in revs}) == len(revs)


def test_the_baseline_tables_are_declared_and_recognised():
    base = importlib.import_module("agent.fleet.database.migrations.versions.r0001_baseline")
    frozen = base.baseline_metadata()
    assert set(frozen.tables) == set(store_schema.BASELINE_TABLES)
    assert set(frozen.tables) <= set(tables.metadata.tables)
    for name, table in frozen.tables.items():
        assert set(table.columns.keys()) <= set(tables.metadata.tables[name].columns.keys())


def test_database_urls_map_to_sqlalchemy_dialects():
    assert migrate.engine_url("postgresql://u:p@h:5432/db") == "postgresql+psycopg://u:p@h:5432/db"
    assert migrate.engine_url("postgres://h/db") == "postgresql+psycopg://h/db"
    assert migrate.engine_url("sqlite:///var/lib/fleet.db") == "sqlite:///var/lib/fleet.db"
    assert migrate.engine_url("sqlite:////abs/fleet.db") == "sqlite:////abs/fleet.db"
    assert migrate.engine_url("sqlite:rel.db") == "sqlite:///rel.db"
    assert store_schema.upgrade_command("postgresql://ops:secret@h/db") == (
        "jetson-agent fleet db upgrade --db postgresql://ops:PASSWORD@h/db")
