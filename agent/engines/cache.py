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

Protected entries (``cache_protect``: the versions of the daemon's models directory, passed in
as ``protected``, and engines hard-linked from outside) are never evicted, nor purged without
``force``; they count outside the budget. Published files are readable by the service's group.

Beside it: ``cache_key`` (the key), ``cache_entry`` (an entry's files and checks),
``cache_lock`` (flock), ``cache_files`` (fsync'd writes, ``disk_full``) and ``cache_upkeep``
(``verify``, stale staging, ``engine_loader``).

Worker side: Python >= 3.6.
"""

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import time
import uuid
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

from agent import fsio
from agent.engines import cache_lock, cache_protect, cache_upkeep
from agent.engines.cache_entry import (
    ENGINE,
    META,
    STAMP,
    CacheEntry,
    Staging,
    last_used,
    load_entry,
    read_meta,
)
from agent.engines.cache_files import (
    copy_file,
    dir_size,
    disk_full_errors,
    make_dirs,
    resolve_group,
    share,
    write_file,
)
from agent.engines.cache_key import FORMAT, sorted_json
from agent.errors import AgentError

log = logging.getLogger(__name__)

# key -> who uses it ("name@version (current)", ...): what eviction and purge must keep.
Protected = Callable[[], Mapping[str, Sequence[str]]]


class EngineCache(object):
    """Engine entries under ``root`` with an optional size budget (bytes, LRU eviction)."""

    def __init__(
        self,
        root: Optional[str] = None,
        budget_bytes: Optional[int] = None,
        clock: Optional[Callable[[], float]] = None,
        lock_timeout: Optional[float] = None,
        protected: Optional[Protected] = None,
        group: Union[None, int, str] = None,
    ) -> None:
        self.root = os.path.abspath(root or os.path.join(fsio.state_dir(), "engines"))
        if budget_bytes is not None and budget_bytes < 0:
            raise AgentError("bad_argument",
                             "cache budget must be >= 0 bytes, found {}".format(budget_bytes))
        self.budget_bytes = budget_bytes
        self.clock = clock or time.time
        self.lock_timeout = lock_timeout
        self.protected = protected
        self.gid = resolve_group(group)
        self.budget_report: Dict[str, Any] = {}  # the last eviction's (see ``evict``)
        self.counters = {"hits": 0, "misses": 0, "corrupt": 0, "evicted": 0, "published": 0}
        for sub in ("tmp", "locks"):
            make_dirs(os.path.join(self.root, sub), exist_ok=True)

    # paths
    def entry_dir(self, key: str) -> str:
        if len(key) < 3 or not all(c in "0123456789abcdef" for c in key):
            raise AgentError("bad_argument",
                             "a cache key is a lowercase hex sha256, found {!r}".format(key))
        return os.path.join(self.root, key[:2], key)

    def lock_path(self, key: str) -> str:
        return os.path.join(self.root, "locks", key + ".lock")

    # locking
    @contextlib.contextmanager
    def lock(self, key: str, timeout: Optional[float] = None) -> Iterator[None]:
        """Exclusive build lock for ``key`` across processes (waits for the holder)."""
        wait = self.lock_timeout if timeout is None else timeout
        path = self.lock_path(key)
        if not cache_lock.acquire(path, fcntl.LOCK_EX, wait):
            raise AgentError("cache_locked", "waited {:.0f} s for the build lock of {} ({}); "
                             "another build of the same engine still holds it".format(
                                 wait or 0, key[:16], path))
        try:
            yield
        finally:
            cache_lock.release(path)

    @contextlib.contextmanager
    def pin(self, key: str) -> Iterator[Optional[CacheEntry]]:
        """Hold an entry in use (shared lock): it is not evicted or purged meanwhile."""
        path = self.lock_path(key)
        if not cache_lock.acquire(path, fcntl.LOCK_SH, self.lock_timeout):
            raise AgentError("cache_locked", "entry {} is locked by a build".format(key[:16]))
        try:
            yield self.get(key)
        finally:
            cache_lock.release(path)

    # reading
    def inspect(self, key: str) -> Tuple[Optional[CacheEntry], Optional[str]]:
        """(entry, None) when present and intact; (None, reason) when corrupt; (None, None)
        when absent."""
        return load_entry(key, self.entry_dir(key))

    def get(self, key: str, touch: bool = True) -> Optional[CacheEntry]:
        """The verified entry for ``key``, or None (absent, or corrupt and dropped: rebuild)."""
        entry, problem = self.inspect(key)
        if problem:
            self.counters["corrupt"] += 1
            log.warning("engine cache entry %s is corrupt (%s); dropping it", key[:16], problem)
            self.drop_if_unlocked(key)
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
            make_dirs(path)
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
        with disk_full_errors(stage.path):
            return self._publish(stage, info, key or stage.key)

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
            files[name] = {"bytes": os.path.getsize(file_path),
                           "sha256": fsio.sha256_file(file_path)}
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
        write_file(os.path.join(stage.path, META), sorted_json(meta))
        write_file(os.path.join(stage.path, STAMP), b"")
        os.utime(os.path.join(stage.path, STAMP), (now, now))
        share(stage.path, self.gid)
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
        cache_upkeep.clean_staging(self)
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

    def drop_if_unlocked(self, key: str) -> bool:
        """Remove an entry unless another process is building or using it."""
        lock_path = self.lock_path(key)
        if not cache_lock.acquire(lock_path, fcntl.LOCK_EX, 0):
            return False
        removed = False
        try:
            removed = self._remove_dir(self.entry_dir(key))
        finally:
            cache_lock.release(lock_path, unlink=removed)
        return removed

    def scan(self) -> Iterator[Tuple[str, str]]:
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
        for key, path in self.scan():
            try:
                meta = read_meta(path)
            except (OSError, ValueError):
                meta = {"key": key, "bytes": dir_size(path), "created": 0.0}
            entries.append(CacheEntry(key, path, meta, last_used(path, meta)))
        entries.sort(key=lambda e: e.last_used, reverse=True)
        return entries

    def protected_users(self, entries: Optional[List[CacheEntry]] = None
                        ) -> Dict[str, List[str]]:
        """key -> who uses it, for the entries that must stay (``cache_protect``)."""
        return cache_protect.protected_users(self, self.ls() if entries is None else entries)

    def evict(self, keep: Optional[str] = None) -> List[str]:
        """Drop least-recently-used entries until the unprotected ones fit the budget. Never
        drops ``keep``, a protected entry or one whose lock someone holds. ``budget_report``
        then holds the sizes and the protected entries (``protected_over_budget`` when they
        alone exceed the budget)."""
        if self.budget_bytes is None:
            return []
        entries = self.ls()
        try:
            protected = self.protected_users(entries)
        except (OSError, ValueError, AgentError) as exc:  # unknown what is in use: keep all
            log.warning("not evicting: cannot tell which engines are in use (%s)", exc)
            self.budget_report = {"budget_bytes": self.budget_bytes, "error": str(exc)}
            return []
        total = sum(e.size for e in entries if e.key not in protected)
        evicted: List[str] = []
        for entry in reversed(entries):  # oldest first
            if total <= self.budget_bytes:
                break
            if entry.key == keep or entry.key in protected:
                continue
            if self.drop_if_unlocked(entry.key):
                total -= entry.size
                evicted.append(entry.key)
                self.counters["evicted"] += 1
                log.info("evicted engine %s (%d bytes) to fit the cache budget of %d bytes",
                         entry.key[:16], entry.size, self.budget_bytes)
        self.budget_report = cache_protect.budget_report(self, entries, protected, total, evicted)
        return evicted

    def verify(self, load: Optional[Callable[[CacheEntry], None]] = None
               ) -> Dict[str, Any]:
        """Check every entry (``cache_upkeep.verify``); drop the corrupt and stale ones."""
        return cache_upkeep.verify(self, load)

    def purge(
        self,
        everything: bool = False,
        key: Optional[str] = None,
        older_than_days: Optional[float] = None,
        force: bool = False,
    ) -> Dict[str, Any]:
        """Remove all entries, one key, or those unused for ``older_than_days``. Entries in
        use by a build are skipped (``skipped_in_use``); protected ones are kept
        (``kept_protected``: key, bytes, users) unless ``force`` (then removed with a warning
        and listed in ``forced_protected``)."""
        if not everything and key is None and older_than_days is None:
            raise AgentError("bad_argument", "purge needs --all, --key KEY or --older-than DAYS")
        cutoff = None if older_than_days is None else self.clock() - older_than_days * 86400.0
        removed: List[str] = []
        skipped: List[str] = []
        kept: List[Dict[str, Any]] = []
        forced: List[Dict[str, Any]] = []
        if key is not None and not os.path.isdir(self.entry_dir(key)):
            raise AgentError("bad_argument", "no cache entry has key {!r}".format(key))
        entries = self.ls()
        protected = self.protected_users(entries)
        for entry in entries:
            if key is not None and entry.key != key:
                continue
            if cutoff is not None and entry.last_used >= cutoff:
                continue
            users = protected.get(entry.key)
            held = {"key": entry.key, "bytes": entry.size, "users": users}
            if users and not force:
                kept.append(held)
                continue
            if self.drop_if_unlocked(entry.key):
                removed.append(entry.key)
                if users:
                    forced.append(held)
                    log.warning("removed engine %s although %s use%s it (--force)",
                                entry.key[:16], ", ".join(users), "s" if len(users) == 1
                                else "")
            else:
                skipped.append(entry.key)
        if everything:
            cache_upkeep.clean_staging(self)
        return {"removed": removed, "skipped_in_use": skipped, "kept_protected": kept,
                "forced_protected": forced}

    def stats(self) -> Dict[str, Any]:
        entries = self.ls()
        protected = self.protected_users(entries)
        held = sum(e.size for e in entries if e.key in protected)
        out: Dict[str, Any] = {
            "root": self.root,
            "entries": len(entries),
            "bytes": sum(e.size for e in entries),
            "budget_bytes": self.budget_bytes,
            "protected_entries": sum(1 for e in entries if e.key in protected),
            "protected_bytes": held,
            "protected_over_budget": self.budget_bytes is not None and held > self.budget_bytes,
        }
        out.update(self.counters)
        return out
