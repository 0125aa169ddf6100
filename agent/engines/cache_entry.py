"""One engine-cache entry on disk: its files, its meta.json, and whether it can be trusted.

An entry directory holds the engine (plus any files beside it), ``meta.json`` (key, sizes and
sha256 of every file, plan, build result, ...) and ``last_used`` (empty; its mtime is the
entry's last use). Reading and checking an entry lives here, apart from the cache's locking and
publishing, so that ``get`` and ``verify`` judge an entry by the same rules.

Worker side: Python >= 3.6.
"""

import json
import os
from typing import Any, Dict, Optional, Tuple

from agent.fsio import sha256_file

META = "meta.json"
ENGINE = "engine"
STAMP = "last_used"


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
            # "model_name" in entries written before the rename
            "model_label": self.meta.get("model_label") or self.meta.get("model_name"),
        }


class Staging(object):
    """A private directory inside the cache where one entry is being built."""

    def __init__(self, key: str, path: str) -> None:
        self.key = key
        self.path = path

    @property
    def engine_path(self) -> str:
        return os.path.join(self.path, ENGINE)


def read_meta(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, META), "rb") as f:
        meta = json.loads(f.read().decode("utf-8"))
    if not isinstance(meta, dict):
        raise ValueError("meta.json is not an object")
    return meta


def last_used(path: str, meta: Dict[str, Any]) -> float:
    try:
        return os.stat(os.path.join(path, STAMP)).st_mtime
    except OSError:
        return float(meta.get("created", 0.0))


def _problem(key: str, path: str, meta: Dict[str, Any]) -> Optional[str]:
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


def load_entry(key: str, path: str) -> Tuple[Optional[CacheEntry], Optional[str]]:
    """The entry of ``key`` in directory ``path``: (entry, None) when present and intact;
    (None, reason) when corrupt; (None, None) when absent."""
    if not os.path.isdir(path):
        return None, None
    try:
        meta = read_meta(path)
    except (OSError, ValueError) as exc:
        return None, "meta.json unreadable: {}".format(exc)
    problem = _problem(key, path, meta)
    if problem:
        return None, problem
    return CacheEntry(key, path, meta, last_used(path, meta)), None
