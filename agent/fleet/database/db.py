"""The fleet database connection: one adapter over SQLite (``sqlite:///PATH``) and PostgreSQL
(``postgresql://...``, psycopg 3). ``execute``/``query`` take ``?`` parameters on both;
``transaction()`` makes one atomic unit (nested blocks join the outer one)."""

import os
import threading
from typing import Any, List, Sequence, Tuple

from agent.errors import AgentError


def default_db_url() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                            "state")
    return "sqlite:///" + os.path.join(base, "jetson-agent", "fleet.db")


def sqlite_path(url: str) -> str:
    """The file of a ``sqlite:///PATH`` (or ``sqlite:PATH``) URL."""
    return url[len("sqlite:///"):] if url.startswith("sqlite:///") else (
        url[len("sqlite:"):] if url.startswith("sqlite:") else url)


class Db(object):
    """One connection, one dialect. ``execute`` takes ``?`` parameters on both databases."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.lock = threading.RLock()  # one connection shared by a service's threads
        if url.startswith(("postgresql://", "postgres://")):
            try:
                import psycopg
            except ImportError:
                raise AgentError("bad_argument", "--db {}: PostgreSQL needs psycopg (pip "
                                 "install 'psycopg[binary]')".format(redact(url)))
            try:
                self.conn: Any = psycopg.connect(url, autocommit=False, connect_timeout=10)
            except psycopg.Error as exc:
                raise AgentError("bad_argument", "cannot connect to the database {}: {}".format(
                    redact(url), str(exc).strip()[:300]))
            self.dialect = "postgresql"
            self.errors: Tuple[type, ...] = (psycopg.Error,)
        else:
            import sqlite3

            path = sqlite_path(url)
            if path != ":memory:":
                os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
            try:
                self.conn = sqlite3.connect(path, timeout=30.0, isolation_level=None,
                                            check_same_thread=False)
                self.conn.execute("PRAGMA journal_mode=WAL")
                self.conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.Error as exc:
                raise AgentError("bad_argument", "cannot open the database {}: {}".format(
                    path, exc))
            self.dialect = "sqlite"
            self.errors = (sqlite3.Error,)
        self._in_tx = 0

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.dialect == "postgresql" else sql

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        with self.lock:
            if self.dialect == "sqlite" and not self._in_tx:
                return self.conn.execute(sql, tuple(params))
            cur = self.conn.cursor()
            cur.execute(self._sql(sql), tuple(params))
            if not self._in_tx:
                self.conn.commit()
            return cur

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> None:
        if not rows:
            return
        with self.transaction():
            self.conn.cursor().executemany(self._sql(sql), [tuple(r) for r in rows])

    def query(self, sql: str, params: Sequence[Any] = ()) -> List[Tuple[Any, ...]]:
        with self.lock:
            cur = self.execute(sql, params)
            rows = [tuple(r) for r in cur.fetchall()]
            if self.dialect == "postgresql" and not self._in_tx:
                self.conn.commit()
            return rows

    def transaction(self) -> "Tx":
        return Tx(self)

    def close(self) -> None:
        with self.lock:
            self.conn.close()


class Tx(object):
    """``with db.transaction():`` - one atomic unit (nested blocks join the outer one)."""

    def __init__(self, db: Db) -> None:
        self.db = db

    def __enter__(self) -> "Tx":
        self.db.lock.acquire()
        if not self.db._in_tx and self.db.dialect == "sqlite":
            self.db.conn.execute("BEGIN IMMEDIATE")
        self.db._in_tx += 1
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        try:
            self.db._in_tx -= 1
            if not self.db._in_tx:
                if kind is None:
                    self.db.conn.commit()
                else:
                    self.db.conn.rollback()
        finally:
            self.db.lock.release()


def redact(url: str) -> str:
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        return "{}://***@{}".format(scheme, rest.rsplit("@", 1)[1])
    return url
