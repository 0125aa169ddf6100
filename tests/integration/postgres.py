"""A real PostgreSQL (Debian's package): one server per test process (``initdb`` into a
temporary directory, started on a free loopback port, fsync off) and a fresh database per test,
dropped after it (``WITH (FORCE)``: connections a test left open go too). ``initdb`` took
seconds a test on a loaded host; a database takes a fraction of one. A test sees only its
database: nothing in the fleet's schema lives outside one (no roles, no tablespaces; advisory
locks and notifications are per database). As root, the server runs as the ``postgres`` user
(PostgreSQL refuses to run as root)."""

import atexit
import glob
import itertools
import os
import pwd
import shutil
import subprocess
import time

import pytest

from tests.integration.conftest import free_port, wait_accepting


def pg_bin(name):
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/" + name))
    return candidates[-1] if candidates else None


class Postgres:
    host = "127.0.0.1"

    def __init__(self, workdir):
        self.workdir = str(workdir)
        self.data = os.path.join(self.workdir, "data")
        self.port = free_port()
        self.proc = None
        self.prefix = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chmod(self.workdir, 0o755)
            os.chown(self.workdir, user.pw_uid, user.pw_gid)
            self.prefix = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self):
        return "postgresql://postgres@{}:{}/postgres".format(self.host, self.port)

    def start(self):
        if not os.path.exists(self.data):
            subprocess.run(self.prefix + [pg_bin("initdb"), "-D", self.data, "-U", "postgres",
                                          "-A", "trust", "--no-sync", "-E", "UTF8"],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        log = open(os.path.join(self.workdir, "postgres.log"), "ab")
        self.proc = subprocess.Popen(
            self.prefix + [pg_bin("postgres"), "-D", self.data, "-p", str(self.port),
                           "-h", self.host, "-k", self.workdir, "-c", "fsync=off",
                           "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        wait_accepting(self.host, self.port, timeout=30, proc=self.proc)
        deadline = time.monotonic() + 30
        while True:  # accepting TCP is not yet accepting queries
            import psycopg

            try:
                psycopg.connect(self.url, connect_timeout=5).close()
                return self
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Database:
    """One test's database on the shared server (``url`` as ``Postgres.url``)."""

    def __init__(self, server, name):
        self.server, self.name = server, name
        self.host, self.port = server.host, server.port

    @property
    def url(self):
        return "postgresql://postgres@{}:{}/{}".format(self.host, self.port, self.name)


_SERVER = []  # this process's server, started by the first test that asks
_NAMES = itertools.count(1)


def _server():
    import tempfile

    if not _SERVER:
        # Not under pytest's tmp_path: as root, the postgres user must be able to reach it.
        workdir = tempfile.mkdtemp(prefix="jetson-agent-pg-")
        server = Postgres(workdir)
        atexit.register(shutil.rmtree, workdir, True)
        atexit.register(server.stop)
        _SERVER.append(server.start())
    server = _SERVER[0]
    if server.proc.poll() is not None:  # gone (killed from outside): a new one, same data
        server.start()
    return server


def _admin(server, sql):
    import psycopg

    with psycopg.connect(server.url, autocommit=True, connect_timeout=10) as con:
        con.execute(sql)


@pytest.fixture
def postgres():
    if pg_bin("initdb") is None:
        pytest.fail("PostgreSQL is not installed (scripts/test installs Debian's postgresql)")
    server = _server()
    name = "test_{}_{}".format(os.getpid(), next(_NAMES))
    _admin(server, "CREATE DATABASE " + name)
    try:
        yield Database(server, name)
    finally:
        _admin(server, "DROP DATABASE IF EXISTS {} WITH (FORCE)".format(name))
