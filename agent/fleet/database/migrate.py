"""Migrations of the fleet database (Alembic over SQLAlchemy Core): ``upgrade`` a database to
the newest revision (creating it when empty; a database made before migrations, which has the
baseline's tables and no ``alembic_version``, is completed to the baseline, stamped there, then
upgraded), ``revisions`` (the history) and ``known`` (whether a revision is one of ours).

Everything runs in one transaction on one connection: on PostgreSQL under the advisory lock the
store always took for its DDL (two services starting at once: the second waits, then finds
the database current), on SQLite under ``BEGIN IMMEDIATE`` (DDL is transactional there too).
Imported only when a schema must change or be listed (``agent.fleet.database.store_schema`` decides,
with plain SQL, whether it must): SQLAlchemy and Alembic are the controller's, and slow to import.
"""

import importlib
import os
from typing import Any, Dict, List, Optional, Tuple

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from agent.errors import AgentError
from agent.fleet.database import store_schema
from agent.fleet.database.db import sqlite_path

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "migrations")
LOCK = 7216  # the advisory lock id the store's DDL has always used


def engine_url(url: str) -> str:
    """The SQLAlchemy URL of a ``--db`` URL: ``postgresql://`` and ``postgres://`` are psycopg 3
    (``postgresql+psycopg://``); ``sqlite:///PATH`` and ``sqlite:PATH`` are ``sqlite:///PATH``."""
    for scheme in ("postgresql://", "postgres://"):
        if url.startswith(scheme):
            return "postgresql+psycopg://" + url[len(scheme):]
    if url.startswith("postgresql+"):
        return url
    return "sqlite:///" + sqlite_path(url)


def engine(url: str, db: Any = None) -> sa.engine.Engine:
    """An engine of one connection. SQLite: the driver's own transaction handling off, so that
    ``begin()`` is a real ``BEGIN IMMEDIATE`` around DDL too; ``:memory:`` uses ``db``'s
    connection (another one would be another database)."""
    target = engine_url(url)
    if not target.startswith("sqlite:"):
        return sa.create_engine(target, poolclass=sa.pool.NullPool,
                                connect_args={"connect_timeout": 10})
    if sqlite_path(url) == ":memory:" and db is not None:
        eng = sa.create_engine("sqlite://", creator=lambda: db.conn,
                               poolclass=sa.pool.StaticPool)
    else:
        eng = sa.create_engine(target, poolclass=sa.pool.NullPool,
                               connect_args={"timeout": 30.0})

    @sa.event.listens_for(eng, "connect")
    def _autocommit_driver(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None

    @sa.event.listens_for(eng, "begin")
    def _begin_immediate(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    return eng


def compare_type(_ctx: Any, _inspected: Any, _declared: Any, found: Any, declared: Any
                 ) -> Optional[bool]:
    """For Alembic's comparisons (env.py, the tests): floats are equal (SQLite reflects DOUBLE
    PRECISION as REAL); else Alembic decides."""
    if isinstance(found, sa.Float) and isinstance(declared, sa.Float):
        return False
    return None


def config(connection: Any = None, blob_store: Optional[str] = None) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPTS)
    cfg.attributes["connection"] = connection
    cfg.attributes["blob_store"] = blob_store  # revision 0006 imports the registry's files there
    return cfg


def scripts() -> ScriptDirectory:
    return ScriptDirectory.from_config(config())


def head() -> str:
    return str(scripts().get_current_head())


def known(revision: str) -> bool:
    try:
        return scripts().get_revision(revision) is not None
    except Exception:  # noqa: BLE001 - alembic.util.CommandError and kin: not ours
        return False


def revisions() -> List[Dict[str, Any]]:
    """Every revision, newest first: {revision, down_revision, doc, head}."""
    script = scripts()
    top = script.get_current_head()
    return [{"revision": s.revision, "down_revision": s.down_revision,
             "doc": (s.doc or "").strip().splitlines()[0] if s.doc else "",
             "head": s.revision == top} for s in script.walk_revisions()]


def _baseline() -> Any:
    return importlib.import_module("agent.fleet.database.migrations.versions.r0001_baseline")


def _check_legacy(conn: Any, names: set) -> None:
    """A database without a version table is taken for one made before migrations only when
    each baseline table it has carries the baseline's columns."""
    inspector = sa.inspect(conn)
    for table in _baseline().baseline_metadata().sorted_tables:
        if table.name not in names:
            continue
        have = {c["name"] for c in inspector.get_columns(table.name)}
        missing = sorted(set(table.columns.keys()) - have)
        if missing:
            raise AgentError("db_schema", "expected the fleet database's table {} with columns "
                             "{}, found it without {}: not a database this jetson-agent made; "
                             "nothing was changed".format(
                                 table.name, ", ".join(table.columns.keys()),
                                 ", ".join(missing)))


def upgrade(url: str, target: str = "head", db: Any = None, blob_store: Optional[str] = None
            ) -> Tuple[Optional[str], Optional[str]]:
    """Upgrade the database to ``target`` (default the newest revision); returns (revision
    before or "legacy" or None when empty, revision after)."""
    eng = engine(url, db)
    try:
        with eng.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql("SELECT pg_advisory_xact_lock({})".format(LOCK))
            names = set(sa.inspect(conn).get_table_names())
            cfg = config(conn, blob_store)
            before: Optional[str] = None
            if "alembic_version" in names:
                before = MigrationContext.configure(conn).get_current_revision()
                if before is not None and not known(before):
                    raise AgentError("db_schema", store_schema.newer_message(url, before))
            elif names & set(store_schema.BASELINE_TABLES):
                _check_legacy(conn, names)
                _baseline().create(conn, checkfirst=True)
                command.stamp(cfg, store_schema.BASELINE)
                before = "legacy"
            command.upgrade(cfg, target)
            after = MigrationContext.configure(conn).get_current_revision()
    finally:
        if not (db is not None and sqlite_path(url) == ":memory:"):
            eng.dispose()
    return before, after
