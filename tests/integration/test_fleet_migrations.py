"""The fleet database's migrations on SQLite and on a real PostgreSQL, from a database made by
the release before migrations (tests/fixtures/fleet_db: rows in every table, no Alembic version
table): recognised by its tables, stamped at the baseline and upgraded in place with every row
kept; the schema migrations give is exactly the declared one (agent.fleet.database.tables); ``fleet
serve`` upgrades such a database on start and runs a rollout on it, or, ``--no-db-upgrade``,
refuses with the exact command, which works; read-only commands never migrate; a database of a
newer jetson-agent is refused untouched; two upgrades at once end in one."""

import os
import shlex
import sqlite3
import subprocess
import sys
import threading
import time

import pytest

from agent.errors import AgentError
from agent.fleet.database import migrate, store_schema, tables
from agent.fleet.database.db import Db
from agent.fleet.database.store import Store
from tests.integration.postgres import postgres  # noqa: F401 - fixture
from tests.integration.test_fleet_rollout import wait_status
from tests.integration.test_fleet_service import (
    ROOT,
    Service,
    fleet_cli,
    fp16_args,
    wait_registered,
)

FIXTURES = os.path.join(ROOT, "tests", "fixtures", "fleet_db")
LEGACY_TABLES = set(store_schema.BASELINE_TABLES)


def load_legacy(kind, tmp_path, pg=None):
    """A database of the release before migrations, loaded from its dump: its URL."""
    with open(os.path.join(FIXTURES, "fleet_v1.{}.sql".format(kind))) as f:
        dump = f.read()
    if kind == "sqlite":
        path = str(tmp_path / "fleet.db")
        con = sqlite3.connect(path)
        con.executescript(dump)
        con.close()
        return "sqlite:///" + path
    import psycopg

    with psycopg.connect(pg.url, autocommit=True) as con:
        con.execute(dump)
    return pg.url


@pytest.fixture(params=["sqlite", "postgresql"])
def legacy(request, tmp_path):
    pg = request.getfixturevalue("postgres") if request.param == "postgresql" else None
    return load_legacy(request.param, tmp_path, pg)


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        return "sqlite:///" + str(tmp_path / "fresh.db")
    return request.getfixturevalue("postgres").url


# Columns revision 0004 (agent.fleet.database.leases) adds to the baseline's tables.
ADDED_COLUMNS = {("rollouts", "lease_epoch"), ("rollouts", "lease_holder"), ("outbox", "epoch"),
                 ("services", "boot_id")}


def every_row(url, added_null=True):
    """table -> its rows, sorted: what must survive an upgrade (the baseline's columns; those
    later revisions add to its tables start empty, NULL: checked with ``added_null``)."""
    db = Db(url)
    try:
        out = {}
        for t in sorted(LEGACY_TABLES):
            cur = db.execute("SELECT * FROM " + t)
            names = [d[0] for d in cur.description]
            rows = [tuple(r) for r in cur.fetchall()]
            if db.dialect == "postgresql":
                db.conn.commit()
            added = [i for i, n in enumerate(names) if (t, n) in ADDED_COLUMNS]
            assert not added_null or all(r[i] is None for r in rows for i in added), (t, rows)
            out[t] = sorted([tuple(v for i, v in enumerate(r) if i not in added) for r in rows],
                            key=repr)
        return out
    finally:
        db.close()


def probe(url):
    db = Db(url)
    try:
        return store_schema.probe(db)
    finally:
        db.close()


def schema_diff(url):
    """What Alembic's comparison finds between the database and agent.fleet.database.tables. On
    SQLite a database made before migrations keeps its nullable primary keys (``TEXT PRIMARY KEY``
    accepts NULL there; the store never writes one): not a difference."""
    import sqlalchemy as sa
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    eng = migrate.engine(url)
    try:
        with eng.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": migrate.compare_type})
            diffs = compare_metadata(ctx, tables.metadata)
            pks = {(t.name, c.name) for t in tables.metadata.tables.values()
                   for c in t.primary_key.columns}
            sqlite = conn.dialect.name == "sqlite"
            names = set(sa.inspect(conn).get_table_names())
    finally:
        eng.dispose()
    out = []
    for d in diffs:
        item = d[0] if isinstance(d, list) else d
        if sqlite and item[0] == "modify_nullable" and (item[2], item[3]) in pks:
            continue
        out.append(item)
    assert "alembic_version" in names
    return out


def test_a_database_of_today_is_upgraded_in_place_with_nothing_lost(legacy):
    before = every_row(legacy)
    assert all(before[t] for t in LEGACY_TABLES), "the fixture has rows in every table"
    assert probe(legacy) == ("legacy", store_schema.BASELINE)
    # Read-only and "no upgrade" openings refuse with the command to run, and stamp nothing
    # (the head has tables the baseline lacks).
    for mode in ("read", "require"):
        with pytest.raises(AgentError) as err:
            Store(legacy, schema=mode)
        assert err.value.code == "db_schema"
        assert store_schema.upgrade_command(legacy) in err.value.message
        assert probe(legacy)[0] == "legacy"

    Store(legacy, schema="upgrade").close()
    assert probe(legacy) == ("current", store_schema.HEAD)
    assert every_row(legacy) == before
    assert schema_diff(legacy) == []
    assert migrate.upgrade(legacy) == (store_schema.HEAD, store_schema.HEAD)  # idempotent
    store = Store(legacy, schema="require")
    try:  # the store's own reads of what today's code wrote
        assert store.device("legacy-b")["board"] == "orin-nano"
        assert store.rollout("legacy-ro")["counts"] == {"SUCCEEDED": 1, "FAILED": 1}
        assert [h["version"] for h in store.job_history("legacy-ro")] == [2, 3]
        assert store.outbox()[0][2] == b"\x00\x01binary\xff"
        assert store.reserve_sequence("key-1", 1) == (101, 101)
        ids = store.save_rollout("legacy-ro", {}, {}, outbox=[("t", b"x", False)])
        assert ids == [2]  # the id sequence goes on after the old rows
    finally:
        store.close()


def test_a_fresh_database_is_made_at_exactly_the_declared_schema(empty_url):
    assert probe(empty_url) == ("empty", None)
    with pytest.raises(AgentError) as err:
        Store(empty_url, schema="read")  # read-only commands create nothing either
    assert err.value.code == "bad_argument" and probe(empty_url)[0] == "empty"
    Store(empty_url).close()
    assert probe(empty_url) == ("current", store_schema.HEAD)
    assert schema_diff(empty_url) == []
    db = Db(empty_url)
    try:
        assert db.query("SELECT value FROM meta WHERE key = 'schema'") == [("1",)]
        assert store_schema.table_names(db) == set(tables.metadata.tables) | {
            "alembic_version"}
    finally:
        db.close()


def test_two_upgrades_at_once_end_in_one(legacy):
    results, errors = [], []

    def run():
        try:
            results.append(migrate.upgrade(legacy))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert sorted(results) == sorted([("legacy", store_schema.HEAD),
                                      (store_schema.HEAD, store_schema.HEAD)])
    db = Db(legacy)
    try:
        assert db.query("SELECT version_num FROM alembic_version") == [(store_schema.HEAD,)]
    finally:
        db.close()


def _cli_of(command):
    """``jetson-agent fleet db upgrade --db URL`` as this checkout runs it."""
    words = shlex.split(command)
    assert words[:2] == ["jetson-agent", "fleet"], command
    return words[2:]


@pytest.mark.slow
def test_serve_upgrades_a_database_of_today_and_runs_a_rollout_on_it(
        legacy, mosquitto, agent_factory, tmp_path):
    before = every_row(legacy)
    agent = agent_factory("mig-a").start()
    wait_status(mosquitto, ["mig-a"], agents=[agent])
    refused = Service(mosquitto, legacy, tmp_path)
    refused.args.append("--no-db-upgrade")
    refused.start()
    assert refused.proc.wait(60) == 2, refused.tail()
    assert "error [db_schema]" in refused.tail() and \
        store_schema.upgrade_command(legacy) in refused.tail()
    assert probe(legacy)[0] == "legacy"

    service = Service(mosquitto, legacy, tmp_path).start()  # upgrades on start
    try:
        deadline = time.monotonic() + 60
        while probe(legacy)[0] != "current":
            assert time.monotonic() < deadline and service.proc.poll() is None, service.tail()
            time.sleep(0.1)
        wait_registered(legacy, ["mig-a"], service)
        out = fleet_cli(["rollout"] + fp16_args() + ["--devices", "mig-a", "--rollout-id",
                                                     "after-upgrade", "--db", legacy,
                                                     "--submit", "--timeout", "120"],
                        timeout=150)
        assert out.returncode == 0, out.stderr + service.tail()
    finally:
        service.stop()
    assert probe(legacy) == ("current", store_schema.HEAD)
    after = every_row(legacy, added_null=False)
    store = Store(legacy, schema="read")
    try:
        assert store.rollout("after-upgrade")["counts"] == {"SUCCEEDED": 1}
        assert store.rollout("legacy-ro")["counts"] == {"SUCCEEDED": 1, "FAILED": 1}
    finally:
        store.close()
    for table, rows in before.items():
        if table in ("outbox", "services", "devices", "telemetry_history"):
            continue  # the service sends a finished rollout's outbox, beats, registers, and
            # prunes samples past retention (the fixture's are from 2023)
        assert set(rows) <= set(after[table]), table
    assert {r[0] for r in after["devices"]} >= {"legacy-a", "legacy-b", "mig-a"}


@pytest.mark.slow
def test_the_commands_a_refusal_names_and_read_only_commands_that_never_migrate(tmp_path):
    url = load_legacy("sqlite", tmp_path)
    for args in (["rollouts", "ls"], ["rollouts", "show", "legacy-ro"], ["devices"],
                 ["jobs"]):  # read-only: refused with the command to run, nothing migrated
        out = fleet_cli(args + ["--db", url])
        assert out.returncode == 2 and "error [db_schema]" in out.stderr, (args, out.stderr)
        assert store_schema.upgrade_command(url) in out.stderr, args
        assert probe(url)[0] == "legacy", args
    current = fleet_cli(["db", "current", "--db", url])
    command = store_schema.upgrade_command(url)
    assert command in current.stdout
    up = fleet_cli(_cli_of(command))
    assert up.returncode == 0 and "revision {}".format(store_schema.HEAD) in up.stdout, up.stderr
    assert probe(url) == ("current", store_schema.HEAD)
    assert fleet_cli(["db", "current", "--db", url]).stdout.strip() == "{} (the newest)".format(
        store_schema.HEAD)
    history = fleet_cli(["db", "history"])
    assert history.returncode == 0 and "0001: Baseline" in history.stdout
    assert "{} (head)".format(store_schema.HEAD) in history.stdout

    # A database a newer jetson-agent upgraded: refused by every command, left as it is.
    con = sqlite3.connect(url[len("sqlite:///"):])
    con.execute("UPDATE alembic_version SET version_num = '9999_future'")
    con.commit()
    con.close()
    for args in (["rollouts", "ls"], ["db", "upgrade"]):
        out = fleet_cli(args + ["--db", url])
        assert out.returncode == 2 and "error [db_schema]" in out.stderr, out.stderr
        assert "9999_future" in out.stderr and "upgrade jetson-agent" in out.stderr
    current = fleet_cli(["db", "current", "--db", url])  # says so, not "upgrade with"
    assert current.returncode == 0 and "newer than this jetson-agent" in current.stdout
    assert "upgrade jetson-agent, not the database" in current.stdout
    assert "upgrade with" not in current.stdout
    assert probe(url) == ("other", "9999_future")


def test_db_upgrade_of_a_file_that_is_not_a_database_is_an_error(tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("not a database\n")
    out = fleet_cli(["db", "upgrade", "--db", "sqlite:///" + str(path)])
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "error [bad_argument]" in out.stderr and "file is not a database" in out.stderr
    assert path.read_text() == "not a database\n"


def test_a_database_that_is_not_the_fleets_is_refused_untouched(tmp_path):
    path = str(tmp_path / "other.db")
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE devices (id INTEGER PRIMARY KEY, name TEXT)")
    con.commit()
    con.close()
    with pytest.raises(AgentError) as err:
        migrate.upgrade("sqlite:///" + path)
    assert err.value.code == "db_schema" and "devices" in err.value.message
    con = sqlite3.connect(path)
    names = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    con.close()
    assert names == {"devices"}


def test_fleet_devices_without_db_imports_no_sqlalchemy(mosquitto, agent_factory, tmp_path):
    agent = agent_factory("imp-a").start()
    wait_status(mosquitto, ["imp-a"], agents=[agent])
    code = ("import sys, atexit\n"
            "atexit.register(lambda: sys.stderr.write('SQLALCHEMY=%s\\n' % "
            "any(m.split('.')[0] in ('sqlalchemy', 'alembic') for m in sys.modules)))\n"
            "from agent.cli import main\n"
            "sys.exit(main(['fleet', 'devices', '--broker', {!r}, '--wait', '1']))\n"
            .format(mosquitto.url))
    env = dict(os.environ, PYTHONPATH=ROOT, XDG_STATE_HOME=str(tmp_path / "state"))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "imp-a" in out.stdout, out.stderr
    assert "SQLALCHEMY=False" in out.stderr, out.stderr
