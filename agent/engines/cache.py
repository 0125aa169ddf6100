"""The engine cache: one directory per key, published atomically, verified on load.

Layout under the root (default ``<state_dir>/engines``)::

    <key[:2]>/<key>/engine      the engine file the backend wrote (plus any files beside it)
    <key[:2]>/<key>/meta.json   key, sizes and sha256 of every file, plan, build result, ...
    <key[:2]>/<key>/last_used   empty; its mtime is the entry's last use (cheap LRU stamp)
    tmp/                        staging directories (same file system, so rename is atomic)
    locks/<key>.lock            flock: exclusive while building (or dropping), shared while in use

An entry is built in a staging directory, fsync'd, then renamed into place, so a reader never
sees a partial entry and a crash leaves at most a stale staging directory. ``get`` checks the
size and sha256 of every file against meta.json; a corrupt entry is dropped so the caller
rebuilds it. After each publish, least-recently-used entries are evicted down to the budget,
skipping the entry just published and any entry whose lock is held.

Worker side: Python >= 3.6.
"""

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

from agent import fsio
from agent.errors import AgentError

log = logging.getLogger(__name__)

META = "meta.json"
ENGINE = "engine"
STAMP = "last_used"
FORMAT = 1
_CHUNK = 1 << 20
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# Plan fields that name files: the key holds digests of their content instead.
_CALIBRATION_PATH_FIELDS = ("data", "cache")


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8")


sha256_file = fsio.sha256_file  # one definition, in fsio


def cache_key(
    model_digest: str,
    plan: Any,
    calibration_digest: Optional[str],
    backend_fingerprint: Dict[str, str],
    platform_fingerprint: Dict[str, str],
) -> str:
    """The engine-cache key: sha256 over canonical JSON of everything a build depends on.

    ``plan`` is a BuildPlan or its ``to_dict()``. Calibration file paths are left out (moving
    a dataset must not change the key); ``calibration_digest`` stands for their content.
    """
    plan_dict = plan if isinstance(plan, dict) else plan.to_dict()
    plan_dict = json.loads(canonical_json(plan_dict).decode("utf-8"))  # a deep copy
    calibration = plan_dict.get("calibration")
    if calibration:
        for field in _CALIBRATION_PATH_FIELDS:
            calibration.pop(field, None)
    doc = {
        "format": FORMAT,
        "model": model_digest,
        "plan": plan_dict,
        "calibration": calibration_digest,
        "backend": dict(backend_fingerprint),
        "platform": dict(platform_fingerprint),
    }
    return hashlib.sha256(canonical_json(doc)).hexdigest()


def _disk_full(path: str, exc: OSError) -> AgentError:
    return AgentError("disk_full", "no space left writing {} into the engine cache ({})".format(
        path, os.strerror(exc.errno or errno.ENOSPC)))


def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _write_new(path: str, chunks: Iterable[bytes]) -> None:
    """Create ``path`` from ``chunks`` and fsync it (inside a staging directory: the rename of
    the directory is what makes it atomic). ENOSPC becomes ``disk_full``."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for chunk in chunks:
                _write_fd(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise _disk_full(path, exc)
        raise


def write_file(path: str, data: bytes) -> None:
    _write_new(path, [data])


def copy_file(src: str, dst: str) -> None:
    """Stream ``src`` into a new file ``dst``, a block at a time."""
    with open(src, "rb") as f:
        _write_new(dst, iter(lambda: f.read(_CHUNK), b""))


# --- locks ---------------------------------------------------------------------------------

# Locks this process holds: path -> [fd, count, mode, pid]. flock locks belong to an open file,
# so a second open+flock of the same file in one process would deadlock; re-entry reuses the
# fd. Per process (a forked child starts afresh), not per thread.
_HELD: Dict[str, List[int]] = {}


def _held(path: str) -> Optional[List[int]]:
    held = _HELD.get(path)
    if held is not None and held[3] != os.getpid():
        del _HELD[path]  # inherited across fork: the parent's, not ours
        os.close(held[0])
        return None
    return held


def _acquire(path: str, mode: int, timeout: Optional[float]) -> bool:
    """Take ``mode`` (LOCK_EX/LOCK_SH) on ``path``; wait at most ``timeout`` seconds (None:
    forever; 0: do not wait). Returns False when it could not be taken in time."""
    held = _held(path)
    if held is not None:
        if held[2] == fcntl.LOCK_EX or mode == fcntl.LOCK_SH:
            held[1] += 1
            return True
        return False  # cannot upgrade a shared lock we hold ourselves
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if deadline is None:
                fcntl.flock(fd, mode)
            else:
                while True:
                    try:
                        fcntl.flock(fd, mode | fcntl.LOCK_NB)
                        break
                    except (BlockingIOError, PermissionError):
                        if time.monotonic() >= deadline:
                            os.close(fd)
                            return False
                        time.sleep(0.02)
            # The lock file may have been unlinked (entry dropped) between open and flock:
            # then we locked a dead inode and must retry on the new file.
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            _HELD[path] = [fd, 1, mode, os.getpid()]
            return True
        os.close(fd)


def _release(path: str, unlink: bool = False) -> None:
    """Release one hold; ``unlink`` removes the lock file first when this is the last hold
    (waiters notice the dead inode and retry), so lock files do not pile up."""
    held = _HELD[path]
    held[1] -= 1
    if held[1] == 0:
        if unlink:
            try:
                os.unlink(path)
            except OSError:
                pass
        del _HELD[path]
        os.close(held[0])  # closing drops the flock


# --- entries -------------------------------------------------------------------------------


class CacheEntry(object):
    """One published entry: its directory, parsed meta.json and last-use time."""

    def __init__(self, key: str, path: str, meta: Dict[str, Any], last_used: float) -> None:
        self.key = key
        self.path = path
        self.meta = meta
        self.last_used = last_used

    @property
    def engine_path(self) -> str:
        return os.path.join(self.path, self.meta.get("engine", ENGINE))

    @property
    def size(self) -> int:
        return int(self.meta.get("bytes", 0))

    @property
    def created(self) -> float:
        return float(self.meta.get("created", 0.0))

    def to_dict(self) -> Dict[str, Any]:
        result = self.meta.get("result") or {}
        plan = self.meta.get("plan") or {}
        return {
            "key": self.key,
            "engine": self.engine_path,
            "bytes": self.size,
            "created": self.created,
            "last_used": self.last_used,
            "precision": result.get("precision") or plan.get("precision"),
            "backend": (self.meta.get("fingerprints") or {}).get("backend", {}).get("backend"),
            "model": self.meta.get("model"),
            "model_name": self.meta.get("model_name"),
        }


class Staging(object):
    """A private directory inside the cache where one entry is being built."""

    def __init__(self, key: str, path: str) -> None:
        self.key = key
        self.path = path

    @property
    def engine_path(self) -> str:
        return os.path.join(self.path, ENGINE)


class EngineCache(object):
    """Engine entries under ``root`` with an optional size budget (bytes, LRU eviction)."""

    def __init__(
        self,
        root: Optional[str] = None,
        budget_bytes: Optional[int] = None,
        clock: Optional[Callable[[], float]] = None,
        lock_timeout: Optional[float] = None,
    ) -> None:
        self.root = os.path.abspath(root or os.path.join(fsio.state_dir(), "engines"))
        if budget_bytes is not None and budget_bytes < 0:
            raise AgentError("bad_argument",
                             "cache budget must be >= 0 bytes, found {}".format(budget_bytes))
        self.budget_bytes = budget_bytes
        self.clock = clock or time.time
        self.lock_timeout = lock_timeout
        self.counters = {"hits": 0, "misses": 0, "corrupt": 0, "evicted": 0, "published": 0}
        for sub in ("tmp", "locks"):
            path = os.path.join(self.root, sub)
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                if exc.errno in _DISK_FULL:
                    raise _disk_full(path, exc)
                raise

    # paths
    def entry_dir(self, key: str) -> str:
        if len(key) < 3 or not all(c in "0123456789abcdef" for c in key):
            raise AgentError("bad_argument",
                             "a cache key is a lowercase hex sha256, found {!r}".format(key))
        return os.path.join(self.root, key[:2], key)

    def _lock_path(self, key: str) -> str:
        return os.path.join(self.root, "locks", key + ".lock")

    # locking
    @contextlib.contextmanager
    def lock(self, key: str, timeout: Optional[float] = None) -> Iterator[None]:
        """Exclusive build lock for ``key`` across processes (waits for the holder)."""
        wait = self.lock_timeout if timeout is None else timeout
        path = self._lock_path(key)
        if not _acquire(path, fcntl.LOCK_EX, wait):
            raise AgentError("cache_locked", "waited {:.0f} s for the build lock of {} ({}); "
                             "another build of the same engine still holds it".format(
                                 wait or 0, key[:16], path))
        try:
            yield
        finally:
            _release(path)

    @contextlib.contextmanager
    def pin(self, key: str) -> Iterator[Optional[CacheEntry]]:
        """Hold an entry in use (shared lock): it is not evicted or purged meanwhile."""
        path = self._lock_path(key)
        if not _acquire(path, fcntl.LOCK_SH, self.lock_timeout):
            raise AgentError("cache_locked", "entry {} is locked by a build".format(key[:16]))
        try:
            yield self.get(key)
        finally:
            _release(path)

    # reading
    def _read_meta(self, path: str) -> Dict[str, Any]:
        with open(os.path.join(path, META), "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("meta.json is not an object")
        return meta

    def _last_used(self, path: str, meta: Dict[str, Any]) -> float:
        try:
            return os.stat(os.path.join(path, STAMP)).st_mtime
        except OSError:
            return float(meta.get("created", 0.0))

    def _problem(self, key: str, path: str, meta: Dict[str, Any]) -> Optional[str]:
        """Why the entry at ``path`` cannot be trusted, or None."""
        if meta.get("key") != key:
            return "meta.json names key {!r}".format(meta.get("key"))
        files = meta.get("files")
        if not isinstance(files, dict) or meta.get("engine", ENGINE) not in files:
            return "meta.json lists no engine file"
        for name, want in sorted(files.items()):
            file_path = os.path.join(path, name)
            try:
                size = os.path.getsize(file_path)
            except OSError:
                return "{} is missing".format(name)
            if size != want.get("bytes"):
                return "{} has {} bytes, meta.json says {}".format(name, size, want.get("bytes"))
            digest = sha256_file(file_path)
            if digest != want.get("sha256"):
                return "{} has sha256 {}, meta.json says {}".format(
                    name, digest[:16], str(want.get("sha256"))[:16])
        return None

    def _load(self, key: str) -> Tuple[Optional[CacheEntry], Optional[str]]:
        """(entry, None) when present and intact; (None, reason) when corrupt; (None, None)
        when absent."""
        path = self.entry_dir(key)
        if not os.path.isdir(path):
            return None, None
        try:
            meta = self._read_meta(path)
        except (OSError, ValueError) as exc:
            return None, "meta.json unreadable: {}".format(exc)
        problem = self._problem(key, path, meta)
        if problem:
            return None, problem
        return CacheEntry(key, path, meta, self._last_used(path, meta)), None

    def get(self, key: str, touch: bool = True) -> Optional[CacheEntry]:
        """The verified entry for ``key``, or None (absent, or corrupt and dropped: rebuild)."""
        entry, problem = self._load(key)
        if problem:
            self.counters["corrupt"] += 1
            log.warning("engine cache entry %s is corrupt (%s); dropping it", key[:16], problem)
            self._drop_if_unlocked(key)
            return None
        if entry is None:
            return None
        if touch:
            entry.last_used = self._touch(entry.path)
        return entry

    def _touch(self, path: str) -> float:
        now = self.clock()
        stamp = os.path.join(path, STAMP)
        try:
            os.utime(stamp, (now, now))
        except FileNotFoundError:
            try:
                open(stamp, "ab").close()
                os.utime(stamp, (now, now))
            except OSError:
                pass
        except OSError:
            pass  # a read-only cache still serves hits
        return now

    # writing
    @contextlib.contextmanager
    def staging(self, key: str) -> Iterator[Staging]:
        """A fresh staging directory for ``key``, under the key's build lock (so the clean-up
        of stale staging directories never takes a live one); removed on exit unless
        published."""
        self.entry_dir(key)  # validates the key
        path = os.path.join(self.root, "tmp", "{}.{}".format(key, uuid.uuid4().hex[:12]))
        with self.lock(key):
            try:
                os.makedirs(path)
            except OSError as exc:
                if exc.errno in _DISK_FULL:
                    raise _disk_full(path, exc)
                raise
            try:
                yield Staging(key, path)
            finally:
                if os.path.exists(path):
                    shutil.rmtree(path, ignore_errors=True)

    def publish(
        self,
        stage: Staging,
        info: Optional[Dict[str, Any]] = None,
        key: Optional[str] = None,
    ) -> CacheEntry:
        """Describe the staged files in meta.json, fsync, rename the directory into place,
        then evict down to the budget. ``info`` (plan, result, fingerprints, ...) is stored in
        meta.json; ``key`` overrides the staging key (when the key is only known after the
        build). If an intact entry for the key already exists it wins (ours is discarded)."""
        try:
            return self._publish(stage, info, key or stage.key)
        except OSError as exc:
            if exc.errno in _DISK_FULL:
                raise _disk_full(stage.path, exc)
            raise

    def _publish(self, stage: Staging, info: Optional[Dict[str, Any]], key: str
                 ) -> CacheEntry:
        self.entry_dir(key)
        if not os.path.isfile(stage.engine_path):
            raise AgentError("build_failed",
                             "the build wrote no engine file ({})".format(stage.engine_path))
        files: Dict[str, Dict[str, Any]] = {}
        for name in sorted(os.listdir(stage.path)):
            file_path = os.path.join(stage.path, name)
            if name in (META, STAMP) or not os.path.isfile(file_path):
                continue
            files[name] = {"bytes": os.path.getsize(file_path), "sha256": sha256_file(file_path)}
        now = self.clock()
        meta: Dict[str, Any] = dict(info or {})
        meta.update({
            "format": FORMAT,
            "key": key,
            "engine": ENGINE,
            "files": files,
            "bytes": sum(f["bytes"] for f in files.values()),
            "created": now,
        })
        write_file(os.path.join(stage.path, META), canonical_json(meta))
        write_file(os.path.join(stage.path, STAMP), b"")
        os.utime(os.path.join(stage.path, STAMP), (now, now))
        fsio.fsync_dir(stage.path)
        final = self.entry_dir(key)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        existing = self.get(key, touch=False)
        if existing is not None:
            log.info("engine cache entry %s was published meanwhile; keeping it", key[:16])
            return existing
        if os.path.exists(final):  # corrupt and still there: replace it
            self._remove_dir(final)
        try:
            os.rename(stage.path, final)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                winner = self.get(key, touch=False)
                if winner is not None:
                    return winner
            raise
        fsio.fsync_dir(os.path.dirname(final))
        self.counters["published"] += 1
        entry = CacheEntry(key, final, meta, now)
        self.evict(keep=key)
        self._clean_staging()
        return entry

    def put(self, key: str, engine_file: str, info: Optional[Dict[str, Any]] = None
            ) -> CacheEntry:
        """Copy an engine made elsewhere into a new entry."""
        with self.staging(key) as stage:
            copy_file(engine_file, stage.engine_path)
            return self.publish(stage, info)

    # removal
    def _remove_dir(self, path: str) -> bool:
        """Rename away first (atomic: no half-deleted entry is ever visible), then delete."""
        trash = os.path.join(self.root, "tmp", "trash-" + uuid.uuid4().hex[:12])
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return False
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def _drop_if_unlocked(self, key: str) -> bool:
        """Remove an entry unless another process is building or using it."""
        lock_path = self._lock_path(key)
        if not _acquire(lock_path, fcntl.LOCK_EX, 0):
            return False
        removed = False
        try:
            removed = self._remove_dir(self.entry_dir(key))
        finally:
            _release(lock_path, unlink=removed)
        return removed

    def _scan(self) -> Iterator[Tuple[str, str]]:
        """(key, entry directory) for every entry directory on disk."""
        try:
            shards = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return
        for shard in shards:
            shard_path = os.path.join(self.root, shard)
            if len(shard) != 2 or not os.path.isdir(shard_path):
                continue
            for key in sorted(os.listdir(shard_path)):
                if key.startswith(shard):
                    yield key, os.path.join(shard_path, key)

    def ls(self) -> List[CacheEntry]:
        """Entries by last use, newest first (meta only; ``verify`` checks the bytes)."""
        entries = []
        for key, path in self._scan():
            try:
                meta = self._read_meta(path)
            except (OSError, ValueError):
                meta = {"key": key, "bytes": _dir_size(path), "created": 0.0}
            entries.append(CacheEntry(key, path, meta, self._last_used(path, meta)))
        entries.sort(key=lambda e: e.last_used, reverse=True)
        return entries

    def evict(self, keep: Optional[str] = None) -> List[str]:
        """Drop least-recently-used entries until the total fits the budget. Never drops
        ``keep`` or an entry whose lock someone holds."""
        if self.budget_bytes is None:
            return []
        entries = self.ls()
        total = sum(e.size for e in entries)
        evicted = []
        for entry in reversed(entries):  # oldest first
            if total <= self.budget_bytes:
                break
            if entry.key == keep:
                continue
            if self._drop_if_unlocked(entry.key):
                total -= entry.size
                evicted.append(entry.key)
                self.counters["evicted"] += 1
                log.info("evicted engine %s (%d bytes) to fit the cache budget of %d bytes",
                         entry.key[:16], entry.size, self.budget_bytes)
        return evicted

    def verify(self, load: Optional[Callable[["CacheEntry"], None]] = None
               ) -> Dict[str, Any]:
        """Check every entry's bytes, and with ``load`` (``engine_loader()``) that its engine
        loads; drop the corrupt ones and stale staging directories."""
        report: Dict[str, Any] = {"checked": 0, "ok": 0, "corrupt": [], "dropped": 0,
                                  "stale_staging_removed": 0}
        for key, _path in list(self._scan()):
            report["checked"] += 1
            entry, problem = self._load(key)
            if entry is not None and load is not None:
                try:
                    load(entry)
                except AgentError as exc:
                    entry, problem = None, "the engine does not load: {}".format(exc.message)
            if problem:
                self.counters["corrupt"] += 1
                dropped = self._drop_if_unlocked(key)
                report["corrupt"].append({"key": key, "problem": problem, "dropped": dropped})
                report["dropped"] += int(dropped)
            elif entry is not None:
                report["ok"] += 1
        report["stale_staging_removed"] = self._clean_staging()
        return report

    def _clean_staging(self) -> int:
        """Remove staging directories left by crashed builds (their key lock is free)."""
        removed = 0
        tmp = os.path.join(self.root, "tmp")
        for name in os.listdir(tmp):
            path = os.path.join(tmp, name)
            key = name.split(".")[0]
            if name.startswith("trash-"):
                shutil.rmtree(path, ignore_errors=True)
                removed += 1
                continue
            if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
                continue
            lock_path = self._lock_path(key)
            if _acquire(lock_path, fcntl.LOCK_EX, 0):
                stale = _HELD[lock_path][1] == 1  # not a build of our own in progress
                try:
                    if stale:
                        shutil.rmtree(path, ignore_errors=True)
                        removed += 1
                finally:
                    _release(lock_path, unlink=stale)
        return removed

    def purge(
        self,
        everything: bool = False,
        key: Optional[str] = None,
        older_than_days: Optional[float] = None,
    ) -> Dict[str, List[str]]:
        """Remove all entries, one key, or those unused for ``older_than_days``. Entries in
        use are skipped and reported."""
        if not everything and key is None and older_than_days is None:
            raise AgentError("bad_argument", "purge needs --all, --key KEY or --older-than DAYS")
        cutoff = None if older_than_days is None else self.clock() - older_than_days * 86400.0
        removed: List[str] = []
        skipped: List[str] = []
        if key is not None and not os.path.isdir(self.entry_dir(key)):
            raise AgentError("bad_argument", "no cache entry has key {!r}".format(key))
        for entry in self.ls():
            if key is not None and entry.key != key:
                continue
            if cutoff is not None and entry.last_used >= cutoff:
                continue
            if self._drop_if_unlocked(entry.key):
                removed.append(entry.key)
            else:
                skipped.append(entry.key)
        if everything:
            self._clean_staging()
        return {"removed": removed, "skipped_in_use": skipped}

    def stats(self) -> Dict[str, Any]:
        entries = self.ls()
        out: Dict[str, Any] = {
            "root": self.root,
            "entries": len(entries),
            "bytes": sum(e.size for e in entries),
            "budget_bytes": self.budget_bytes,
        }
        out.update(self.counters)
        return out


def engine_loader() -> Callable[[CacheEntry], None]:
    """For ``verify``: open each engine with the backend that built it, where that backend is
    importable here (an engine of another backend is only checked by its digests)."""
    from agent.engines.backends.base import get_backend

    backends: Dict[str, Any] = {}

    def load(entry: CacheEntry) -> None:
        try:
            name = str(entry.meta["fingerprints"]["backend"]["backend"])
        except (KeyError, TypeError):
            return
        if name not in backends:
            try:
                backends[name] = get_backend(name)
            except AgentError:
                backends[name] = None
        backend = backends[name]
        if backend is None:
            return
        try:
            backend.open(entry.engine_path).close()
        except AgentError as exc:
            if exc.code != "backend_unavailable":
                raise

    return load


def _dir_size(path: str) -> int:
    total = 0
    for name in os.listdir(path):
        try:
            total += os.path.getsize(os.path.join(path, name))
        except OSError:
            pass
    return total
