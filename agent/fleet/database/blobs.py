"""The registry's blob store: every file a registry version carries (model, calibration set,
inputs, goldens, class labels, per-block hash lists), stored once by its SHA-256 under the
store's own directory, ``DIR/<first two hex digits>/<sha256>``.

- The directory is the one the database names (``meta.blob_store``): recorded by the first
  writer (``fleet serve``, a push, the upgrade to revision 0006) from ``--store``, else the
  default beside a SQLite file; PostgreSQL needs ``--store`` once. A later ``--store`` that
  differs is refused, so the CLI and the service never disagree on where bytes live.
- A blob is written atomically (a temporary file in the store, fsync, rename) and never
  rewritten: a second version sharing a file references the same blob.
- ``blobs`` holds each blob's size, when it was last hashed and the file's stat then, and its
  ``problem`` (missing, size or hash mismatch) once one was found; ``blob_refs`` which registry
  version references it in which role (the reference count).
- Served only verified: hashed when first served by a process and again whenever its stat
  changed; a blob that fails is marked and never served (``artifact_unavailable``).
"""

import hashlib
import os
import tempfile
import time
from typing import IO, Any, Dict, List, Mapping, Optional, Tuple

from agent import fsio
from agent.errors import AgentError

META_KEY = "blob_store"
DEFAULT_NAME = "fleet-artifacts"
MAX_BLOB_BYTES = 8 << 30  # a model with its calibration set; more is refused on upload
CHUNK = 1 << 20


# ---------------------------------------------------------------------------- the directory

def default_dir(url: str) -> Optional[str]:
    """Beside a SQLite database; None for PostgreSQL (its service's host is not this one)."""
    if url.startswith("sqlite:"):
        from agent.fleet.database.db import sqlite_path

        path = sqlite_path(url)
        if path != ":memory:":
            return os.path.join(os.path.dirname(os.path.abspath(path)), DEFAULT_NAME)
    return None


def recorded(store: Any) -> Optional[str]:
    rows = store.db.query("SELECT value FROM meta WHERE key = ?", (META_KEY,))
    return str(rows[0][0]) if rows and rows[0][0] else None


def directory(store: Any, configured: Optional[str] = None, record: bool = False) -> str:
    """The store's directory: the one the database names; else ``configured`` or the default
    (``record``: written into the database, so every later command agrees). AgentError
    ``bad_argument`` when ``configured`` differs from the recorded one, ``blob_store_unset``
    when there is none to use."""
    wanted = os.path.abspath(configured) if configured else None
    have = recorded(store)
    if have is not None:
        if wanted is not None and os.path.normpath(wanted) != os.path.normpath(have):
            raise AgentError("bad_argument", "--store {}: expected the blob store this "
                             "database names ({}), found another directory; leave --store out "
                             "(the database decides)".format(configured, have))
        return have
    chosen = wanted or default_dir(store.url)
    if chosen is None:
        raise AgentError("blob_store_unset", "expected the database to name its blob store, "
                         "found none: give --store DIR (a directory on the service's host; "
                         "`fleet serve --store DIR` records it), or push through the service "
                         "(fleet models push --server URL)")
    if record:
        store.db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO "
                         "NOTHING", (META_KEY, chosen))
        chosen = recorded(store) or chosen  # another writer may have been first
    return chosen


def path_of(root: str, sha256: str) -> str:
    return os.path.join(root, sha256[:2], sha256)


# ---------------------------------------------------------------------------- writing

def stat_key(path: str) -> str:
    st = os.stat(path)
    return "{}:{}:{}".format(st.st_size, st.st_mtime_ns, st.st_ino)


def receive(root: str, src: IO[bytes], length: int, sha256: str,
            limit: int = MAX_BLOB_BYTES) -> str:
    """Stream ``length`` bytes of ``src`` into the store as ``sha256`` (temporary file, hash
    checked, fsync, rename); an existing sound blob is kept as it is. Returns its path. AgentError
    ``blob_too_large``/``hash_mismatch``."""
    if length > limit:
        raise AgentError("blob_too_large", "a blob is at most {} bytes, found {}".format(limit,
                                                                                   length))
    final = path_of(root, sha256)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".upload-", dir=os.path.dirname(final))
    try:
        h = hashlib.sha256()
        left = length
        with os.fdopen(fd, "wb") as out:
            while left > 0:
                data = src.read(min(CHUNK, left))
                if not data:
                    raise AgentError("hash_mismatch", "blob {}: expected {} bytes, the upload "
                                     "ended after {}".format(sha256[:12], length,
                                                            length - left))
                h.update(data)
                out.write(data)
                left -= len(data)
            out.flush()
            os.fsync(out.fileno())
        if h.hexdigest() != sha256:
            raise AgentError("hash_mismatch", "blob: expected sha256 {}, the bytes received "
                             "hash to {}".format(sha256, h.hexdigest()))
        # Immutable: a blob once stored is never rewritten, only restored when its file was
        # lost or damaged (the same bytes again).
        if not os.path.isfile(final) or _hash(final) != sha256:
            os.replace(tmp, final)
            fsio.fsync_dir(os.path.dirname(final))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return final


def add_file(root: str, src: str, sha256: str) -> str:
    """Copy a local file into the store (``receive`` from it)."""
    with open(src, "rb") as f:
        return receive(root, f, os.fstat(f.fileno()).st_size, sha256)


def register(store: Any, root: str, sha256: str, size: int) -> None:
    """Record a blob now in the store (a known blob keeps its row: it is immutable; one marked
    with a problem whose bytes came again is good again)."""
    path = path_of(root, sha256)
    key = stat_key(path)
    store.db.execute("INSERT INTO blobs (sha256, size, added, checked, stat, problem) VALUES "
                     "(?, ?, ?, ?, ?, NULL) ON CONFLICT (sha256) DO NOTHING",
                     (sha256, int(size), time.time(), time.time(), key))
    store.db.execute("UPDATE blobs SET problem = NULL, stat = ?, checked = ? WHERE sha256 = ? "
                     "AND problem IS NOT NULL", (key, time.time(), sha256))


def refs_of(record: Mapping[str, Any]) -> Dict[str, Tuple[str, int]]:
    """role -> (sha256, size) of every file a registry record names (``ROLE.blocks``: a
    per-block hash list)."""
    out: Dict[str, Tuple[str, int]] = {}
    for role, ref in sorted((record.get("artifacts") or {}).items()):
        if not isinstance(ref, Mapping):
            continue
        out[str(role)] = (str(ref.get("sha256")), int(ref.get("size") or 0))
        blocks = ref.get("blocks")
        if isinstance(blocks, Mapping) and blocks.get("sha256"):
            # 32 bytes per block of the file (agent.wire.block_server.block_digests)
            bs = max(1, int(blocks.get("block_size") or 1))
            out[str(role) + ".blocks"] = (str(blocks["sha256"]),
                                          32 * -(-int(ref.get("size") or 0) // bs))
    return out


def reference(store: Any, name: str, version: str, record: Mapping[str, Any]) -> None:
    """The version's references to its blobs (its part of their reference counts)."""
    rows = [(name, version, role, sha) for role, (sha, _n) in refs_of(record).items()]
    store.db.executemany("INSERT INTO blob_refs (name, version, role, sha256) VALUES "
                         "(?, ?, ?, ?) ON CONFLICT (name, version, role) DO NOTHING", rows)


def unreference(store: Any, root: Optional[str], name: str, version: str) -> List[str]:
    """Drop a removed version's references; blobs nothing references any more are deleted
    (row and file). Returns their hashes."""
    shas = [r[0] for r in store.db.query("SELECT sha256 FROM blob_refs WHERE name = ? AND "
                                         "version = ?", (name, version))]
    store.db.execute("DELETE FROM blob_refs WHERE name = ? AND version = ?", (name, version))
    gone = []
    for sha in sorted(set(shas)):
        if store.db.query("SELECT 1 FROM blob_refs WHERE sha256 = ?", (sha,)):
            continue
        store.db.execute("DELETE FROM blobs WHERE sha256 = ?", (sha,))
        gone.append(sha)
        if root is not None:
            try:
                os.unlink(path_of(root, sha))
            except OSError:
                pass
    return gone


# ---------------------------------------------------------------------------- reading

def rows(store: Any, shas: Optional[List[str]] = None) -> Dict[str, Dict[str, Any]]:
    sql = "SELECT sha256, size, added, checked, stat, problem FROM blobs"
    found = store.db.query(sql) if shas is None else [
        r for i in range(0, len(shas), 500) for r in store.db.query(
            sql + " WHERE sha256 IN ({})".format(", ".join("?" for _ in shas[i:i + 500])),
            shas[i:i + 500])]
    return {r[0]: {"sha256": r[0], "size": r[1], "added": r[2], "checked": r[3],
                   "stat": r[4], "problem": r[5]} for r in found}


def users(store: Any, sha256: str) -> List[Dict[str, str]]:
    """The registry versions that reference a blob: [{name, version, role}] (its count)."""
    return [{"name": r[0], "version": r[1], "role": r[2]} for r in store.db.query(
        "SELECT name, version, role FROM blob_refs WHERE sha256 = ? ORDER BY name, version, "
        "role", (sha256,))]


def refcounts(store: Any) -> Dict[str, int]:
    return {r[0]: int(r[1]) for r in store.db.query(
        "SELECT sha256, COUNT(*) FROM blob_refs GROUP BY sha256")}


def _hash(path: str) -> str:
    return fsio.sha256_file(path)


def check(store: Any, root: str, row: Mapping[str, Any], full: bool = False
          ) -> Optional[str]:
    """The problem of one blob, or None. Hashed when ``full`` or its file's stat changed
    since it was last hashed; a problem found is recorded (the blob is then never served)."""
    sha = str(row["sha256"])
    path = path_of(root, sha)
    problem = None
    try:
        key = stat_key(path)
        size = os.path.getsize(path)
    except OSError:
        key, size = "", -1
    if size < 0:
        problem = "missing: no file {}".format(path)
    elif size != int(row["size"]):
        problem = "size mismatch: expected {} bytes, found {}".format(row["size"], size)
    elif full or key != row.get("stat") or row.get("problem"):
        found = _hash(path)
        if found != sha:
            problem = "hash mismatch: its bytes hash to {}".format(found)
    if problem != row.get("problem") or (problem is None and key != row.get("stat")):
        store.db.execute("UPDATE blobs SET problem = ?, stat = ?, checked = ? WHERE sha256 = ?",
                         (problem, key if problem is None else row.get("stat"), time.time(),
                          sha))
    return problem


def servable(store: Any, root: Optional[str], sha256: str, full: bool = False
             ) -> Optional[str]:
    """The verified path of a registry blob; None when the blob is not one (another kind of
    artifact, ``fleet rollout``'s files). AgentError ``artifact_unavailable`` when it fails."""
    row = rows(store, [sha256]).get(sha256)
    if row is None:
        return None
    if root is None:
        root = directory(store)
    problem = check(store, root, row, full=full)
    if problem is not None:
        raise AgentError("artifact_unavailable", unavailable_message(store, sha256, problem))
    return path_of(root, sha256)


def unavailable_message(store: Any, sha256: str, problem: str) -> str:
    named = ", ".join("{} of {}@{}".format(u["role"], u["name"], u["version"])
                      for u in users(store, sha256)[:5]) or "no registry version"
    return "blob {} ({}) cannot be served: {}; expected its bytes in the store (fleet models " \
           "verify; push the version again to restore them)".format(sha256[:16], named,
                                                                    problem)


def short_reason(store: Any, sha256: str, problem: str) -> str:
    """``blob SHA16 (model of NAME@VERSION) hash mismatch``: a device's reason (bounded: the
    details are in ``unavailable_message``)."""
    named = ", ".join("{} of {}@{}".format(u["role"], u["name"], u["version"])
                      for u in users(store, sha256)[:3]) or "no registry version"
    return "blob {} ({}) {}".format(sha256[:16], named, problem.split(":", 1)[0])


def problems_of(store: Any, root: Optional[str], spec: Mapping[str, Any]
                ) -> Optional[Tuple[str, str, str]]:
    """(sha256, short reason, message) of the first blob of a rollout spec that cannot be
    served, or None. Hashes that are no registry blob are not judged here (a CDN URL,
    ``fleet rollout``)."""
    shas = [sha for sha, _n in refs_of(spec).values()]
    known = rows(store, shas)
    for sha in shas:
        row = known.get(sha)
        if row is None:
            continue
        try:
            problem = check(store, root or directory(store), row)
        except AgentError as exc:
            problem = exc.message
        if problem is not None:
            return sha, short_reason(store, sha, problem), unavailable_message(store, sha,
                                                                               problem)
    return None


def verify(store: Any, root: str) -> List[Dict[str, Any]]:
    """Every blob hashed and every version's references checked: the problems found
    ([{kind, sha256, versions, message}]); an empty list when the store is sound."""
    out: List[Dict[str, Any]] = []
    known = rows(store)
    for sha, row in sorted(known.items()):
        problem = check(store, root, row, full=True)
        if problem is not None:
            out.append({"kind": "blob", "sha256": sha, "message": problem,
                        "versions": ["{}@{}".format(u["name"], u["version"])
                                     for u in users(store, sha)]})
    import json

    for name, version, record in store.db.query(
            "SELECT name, version, record FROM model_versions ORDER BY name, version"):
        try:
            refs = refs_of(json.loads(record))
        except ValueError:
            refs = {}
        have = {r[0]: r[1] for r in store.db.query(
            "SELECT role, sha256 FROM blob_refs WHERE name = ? AND version = ?",
            (name, version))}
        for role, (sha, _n) in sorted(refs.items()):
            if sha not in known:
                out.append({"kind": "reference", "sha256": sha, "versions": [
                    "{}@{}".format(name, version)], "message": "{}@{} {}: no blob {} in the "
                    "store".format(name, version, role, sha[:16])})
            elif have.get(role) != sha:
                out.append({"kind": "reference", "sha256": sha, "versions": [
                    "{}@{}".format(name, version)], "message": "{}@{} {}: its reference to "
                    "blob {} is not counted".format(name, version, role, sha[:16])})
    return out
