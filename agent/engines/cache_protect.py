"""Which engine-cache entries must stay, and what the budget report says about them.

An entry is protected when the cache's ``protected`` callable names its key (the daemon and the
CLI pass the versions of the models directory; the engines package never reads that directory
itself) or when its engine file has hard links outside the cache (a models directory on the
same file system links instead of copying, so removing the entry would free nothing anyway).
Protected entries count outside the budget; ``budget_report`` says when they alone exceed it.

Worker side: Python >= 3.6.
"""

import logging
import os
from typing import TYPE_CHECKING, Any, Dict, List

from agent.engines.cache_entry import CacheEntry

if TYPE_CHECKING:
    from agent.engines.cache import EngineCache

log = logging.getLogger(__name__)


def protected_users(cache: "EngineCache", entries: List[CacheEntry]) -> Dict[str, List[str]]:
    """key -> who uses it ("name@version (current)", "1 hard link outside the cache")."""
    out = {}  # type: Dict[str, List[str]]
    if cache.protected is not None:
        for key, users in cache.protected().items():
            out[str(key)] = [str(u) for u in users] or ["the models directory"]
    for entry in entries:
        try:
            links = os.stat(entry.engine_path).st_nlink
        except OSError:
            continue
        if links > 1 and entry.key not in out:
            out[entry.key] = ["{} hard link{} outside the cache".format(
                links - 1, "s" if links > 2 else "")]
    return out


def budget_report(cache: "EngineCache", entries: List[CacheEntry],
                  protected: Dict[str, List[str]], unprotected_bytes: int, evicted: List[str]
                  ) -> Dict[str, Any]:
    """The sizes after an eviction: ``bytes`` (the entries the budget bounds),
    ``protected_bytes`` and ``protected`` (key, bytes, users), ``protected_over_budget``
    (logged as a warning: the protected entries alone exceed the budget; they stay)."""
    kept = [e for e in entries if e.key in protected]
    held = [{"key": e.key, "bytes": e.size, "users": protected[e.key]}
            for e in kept]  # type: List[Dict[str, Any]]
    held_bytes = sum(e.size for e in kept)
    over = cache.budget_bytes is not None and held_bytes > cache.budget_bytes
    if over:
        log.warning("the engines in use (%s) alone take %d bytes, more than the cache budget "
                    "of %d bytes; they stay", ", ".join(u for e in kept
                                                        for u in protected[e.key]),
                    held_bytes, cache.budget_bytes)
    return {"budget_bytes": cache.budget_bytes, "bytes": unprotected_bytes,
            "protected_bytes": held_bytes, "protected": held, "evicted": evicted,
            "protected_over_budget": over}
