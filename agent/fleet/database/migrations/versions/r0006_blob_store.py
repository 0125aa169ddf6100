"""The registry owns its bytes (agent.fleet.database.blobs): ``blobs`` (each file by its
SHA-256, with its size, last hash check and problem) and ``blob_refs`` (which version uses
which blob in which role: the reference counts). The versions already in the registry are
imported: each file recorded at a push (the ``artifacts`` table's path, or the old store's
``DIR/aa/SHA``) that still exists and still hashes right is copied into the store the
database now names (``meta.blob_store``); one that does not is recorded with its problem, which
``fleet models verify`` and the deployments using it report.

Revision ID: 0006
Revises: 0004
Create Date: 2026-12-06
"""

import json
import logging
import os
import time

import sqlalchemy as sa
from alembic import context, op

revision = "0006"
down_revision = "0004"
branch_labels = None
depends_on = None

log = logging.getLogger("agent.fleet")


def _tables() -> sa.MetaData:
    T, D = sa.Text, sa.DOUBLE_PRECISION
    m = sa.MetaData()
    sa.Table("blobs", m, sa.Column("sha256", T, primary_key=True),
             sa.Column("size", sa.BigInteger, nullable=False), sa.Column("added", D),
             sa.Column("checked", D), sa.Column("stat", T), sa.Column("problem", T))
    sa.Table("blob_refs", m, sa.Column("name", T, primary_key=True),
             sa.Column("version", T, primary_key=True), sa.Column("role", T, primary_key=True),
             sa.Column("sha256", T, nullable=False), sa.Index("blob_refs_sha256", "sha256"))
    return m


def _root(conn: sa.engine.Connection) -> str:
    """The store's directory: the one recorded, else the one the upgrade was given
    (``--store``), else the default (beside a SQLite file; the state directory of the host
    upgrading a PostgreSQL database, where its service ran before)."""
    from agent.fleet.database import blobs
    from agent.fleet.database.store import default_db_url

    row = conn.execute(sa.text("SELECT value FROM meta WHERE key = :k"),
                       {"k": blobs.META_KEY}).fetchone()
    if row is not None and row[0]:
        return str(row[0])
    given = context.config.attributes.get("blob_store") or os.environ.get(
        "JETSON_AGENT_FLEET_STORE")
    root = os.path.abspath(given) if given else None
    if root is None and conn.dialect.name == "sqlite":
        db = conn.engine.url.database
        if db and db != ":memory:":
            root = os.path.join(os.path.dirname(os.path.abspath(db)), blobs.DEFAULT_NAME)
    if root is None:
        root = os.path.join(os.path.dirname(default_db_url().split("sqlite:///", 1)[-1]),
                            blobs.DEFAULT_NAME)
    conn.execute(sa.text("INSERT INTO meta (key, value) VALUES (:k, :v)"),
                 {"k": blobs.META_KEY, "v": root})
    return root


def _import(conn: sa.engine.Connection) -> None:
    from agent.fleet.database import blobs
    from agent.fsio import sha256_file

    versions = conn.execute(sa.text("SELECT name, version, record FROM model_versions")
                            ).fetchall()
    if not versions:
        return
    root = _root(conn)
    paths = {r[0]: r[1] for r in conn.execute(sa.text("SELECT sha256, path FROM artifacts"))}
    sizes = {}
    for name, version, record in versions:
        try:
            refs = blobs.refs_of(json.loads(record))
        except ValueError:
            continue
        for role, (sha, size) in refs.items():
            sizes[sha] = size
            conn.execute(sa.text("INSERT INTO blob_refs (name, version, role, sha256) VALUES "
                                 "(:n, :v, :r, :s)"), {"n": name, "v": version, "r": role,
                                                       "s": sha})
    for sha, size in sorted(sizes.items()):
        problem = None
        sources = [blobs.path_of(root, sha)] + ([paths[sha]] if paths.get(sha) else [])
        found = next((p for p in sources if os.path.isfile(p)), None)
        if found is None:
            problem = "missing: its file at push ({}) is gone".format(
                " or ".join(sources))
        elif sha256_file(found) != sha:
            problem = "hash mismatch: its file at push ({}) changed".format(found)
        else:
            try:
                if found != blobs.path_of(root, sha):
                    blobs.add_file(root, found, sha)
            except OSError as exc:
                problem = "not copied into the store {}: {}".format(root, exc)
        key = blobs.stat_key(blobs.path_of(root, sha)) if problem is None else None
        if problem is not None:
            log.warning("blob %s: %s", sha[:16], problem)
        conn.execute(sa.text("INSERT INTO blobs (sha256, size, added, checked, stat, problem) "
                             "VALUES (:s, :n, :t, :t, :k, :p)"),
                     {"s": sha, "n": size,
                      "t": time.time(), "k": key, "p": problem})


def upgrade() -> None:
    conn = op.get_bind()
    _tables().create_all(conn, checkfirst=True)
    _import(conn)


def downgrade() -> None:
    op.drop_table("blob_refs")
    op.drop_table("blobs")
