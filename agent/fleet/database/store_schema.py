"""The fleet database's schema at open, in plain SQL (no SQLAlchemy import on this path): which
revision a database is at (``probe``), and what opening it in a mode does (``ensure``).
The schema itself is declared in ``agent.fleet.database.tables`` and reached through the Alembic
revisions in ``agent/fleet/database/migrations`` (``agent.fleet.database.migrate``).

States: ``empty`` (no fleet table), ``legacy`` (made before migrations: the baseline's tables,
no ``alembic_version``), ``current`` (at ``HEAD``), ``other`` (another revision: older, or
written by a newer jetson-agent). Modes:

- ``upgrade`` (``fleet serve``, ``fleet db upgrade``): anything to ``HEAD``;
- ``require`` (``fleet serve --no-db-upgrade``): ``current`` only, else refused with the
  exact ``fleet db upgrade`` command;
- ``create`` (the default: writers such as ``fleet rollout``, tests): an empty database is
  created at ``HEAD``; a legacy one is used as it is while its schema is the head's (nothing is
  stamped); any other is refused;
- ``read`` (read-only commands): as ``create``, but an empty database is refused, not created.
Read-only commands therefore never migrate.
"""

from typing import Optional, Set, Tuple

from agent.errors import AgentError
from agent.fleet.database.db import Db

HEAD = "0008"  # the newest revision in fleet/database/migrations/versions (a test keeps it so)
BASELINE = "0001"  # the schema of the release before migrations
# The baseline's tables: a database with any of them and no alembic_version is a legacy one.
BASELINE_TABLES = ("meta", "devices", "rollouts", "stages", "jobs", "job_history", "artifacts",
                   "signing_seq", "outbox", "device_models", "rollbacks", "services",
                   "telemetry_history")
MODES = ("upgrade", "require", "create", "read")


def table_names(db: Db) -> Set[str]:
    if db.dialect == "postgresql":
        rows = db.query("SELECT table_name FROM information_schema.tables WHERE table_schema "
                        "= current_schema()")
    else:
        rows = db.query("SELECT name FROM sqlite_master WHERE type = 'table'")
    return {str(r[0]) for r in rows}


def probe(db: Db) -> Tuple[str, Optional[str]]:
    """(state, revision): ``revision`` is the stamped one, ``BASELINE`` for a legacy database,
    None for an empty one."""
    names = table_names(db)
    if "alembic_version" in names:
        rows = db.query("SELECT version_num FROM alembic_version")
        rev = str(rows[0][0]) if rows else None
        if rev is None:
            return ("empty", None) if not names & set(BASELINE_TABLES) else ("other", None)
        return ("current" if rev == HEAD else "other"), rev
    if names & set(BASELINE_TABLES):
        return "legacy", BASELINE
    return "empty", None


def shown_url(url: str) -> str:
    """The URL as a command line may show it: a password replaced by ``PASSWORD``."""
    if "://" in url and "@" in url:
        scheme, rest = url.split("://", 1)
        cred, host = rest.rsplit("@", 1)
        if ":" in cred:
            cred = cred.split(":", 1)[0] + ":PASSWORD"
        return "{}://{}@{}".format(scheme, cred, host)
    return url


def upgrade_command(url: str) -> str:
    return "jetson-agent fleet db upgrade --db {}".format(shown_url(url))


def newer_message(url: str, revision: str) -> str:
    return ("expected the fleet database {} at revision {} or older, found revision {}, which "
            "this jetson-agent does not know (a newer jetson-agent upgraded it): upgrade "
            "jetson-agent; nothing was changed".format(shown_url(url), HEAD, revision))


def ensure(db: Db, url: str, mode: str = "create") -> str:
    """Open ``db`` (at ``url``) in ``mode``; returns the state it was found in. AgentError
    ``db_schema`` when the mode may not bring it to ``HEAD``; ``bad_argument`` for an empty
    database in ``read`` mode."""
    if mode not in MODES:
        raise ValueError("mode {!r}".format(mode))
    state, rev = probe(db)
    if state == "current":
        return state
    if state == "legacy" and BASELINE == HEAD and mode in ("create", "read"):
        return state  # today's schema already; stamped by `fleet serve` or `fleet db upgrade`
    if mode == "upgrade" or (mode == "create" and state == "empty"):
        from agent.fleet.database import migrate

        migrate.upgrade(url, db=db)
        return state
    if mode == "read" and state == "empty":
        raise AgentError("bad_argument", "--db {}: expected a fleet database (the tables `fleet "
                         "serve` creates), found none; `fleet serve` or `{}` creates them"
                         .format(shown_url(url), upgrade_command(url)))
    if state == "other" and rev is not None:
        from agent.fleet.database import migrate

        if not migrate.known(rev):
            raise AgentError("db_schema", newer_message(url, rev))
    found = {"legacy": "a database made before migrations (no version stamp)",
             "empty": "an empty database", "other": "revision {}".format(rev)}[state]
    raise AgentError("db_schema", "expected the fleet database {} at revision {}, found {}; "
                     "upgrade it with: {}{}".format(
                         shown_url(url), HEAD, found, upgrade_command(url),
                         " (or start `fleet serve` without --no-db-upgrade)"
                         if mode == "require" else ""))
