"""Upkeep of the engine cache: verifying every entry (bytes, and optionally that each engine
loads) and removing staging directories that crashed builds left behind. Apart from
``cache`` because it walks the whole cache and, for ``engine_loader``, reaches the backends,
while building and looking up one engine need neither.

Worker side: Python >= 3.6.
"""

import fcntl
import os
import shutil
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional

from agent.engines import cache_lock
from agent.engines.cache_entry import CacheEntry
from agent.errors import AgentError

if TYPE_CHECKING:
    from agent.engines.cache import EngineCache


def verify(cache: "EngineCache", load: Optional[Callable[[CacheEntry], None]] = None
           ) -> Dict[str, Any]:
    """Check every entry's bytes, and with ``load`` (``engine_loader()``) that its engine
    loads; drop the corrupt ones and stale staging directories."""
    report: Dict[str, Any] = {"checked": 0, "ok": 0, "corrupt": [], "dropped": 0,
                              "stale_staging_removed": 0}
    for key, _path in list(cache.scan()):
        report["checked"] += 1
        entry, problem = cache.inspect(key)
        if entry is not None and load is not None:
            try:
                load(entry)
            except AgentError as exc:
                entry, problem = None, "the engine does not load: {}".format(exc.message)
        if problem:
            cache.counters["corrupt"] += 1
            dropped = cache.drop_if_unlocked(key)
            report["corrupt"].append({"key": key, "problem": problem, "dropped": dropped})
            report["dropped"] += int(dropped)
        elif entry is not None:
            report["ok"] += 1
    report["stale_staging_removed"] = clean_staging(cache)
    return report


def clean_staging(cache: "EngineCache") -> int:
    """Remove staging directories left by crashed builds (their key lock is free)."""
    removed = 0
    tmp = os.path.join(cache.root, "tmp")
    for name in os.listdir(tmp):
        path = os.path.join(tmp, name)
        key = name.split(".")[0]
        if name.startswith("trash-"):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
            continue
        if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
            continue
        lock_path = cache.lock_path(key)
        if cache_lock.acquire(lock_path, fcntl.LOCK_EX, 0):
            stale = cache_lock.holds(lock_path) == 1  # not a build of our own in progress
            try:
                if stale:
                    shutil.rmtree(path, ignore_errors=True)
                    removed += 1
            finally:
                cache_lock.release(lock_path, unlink=stale)
    return removed


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
