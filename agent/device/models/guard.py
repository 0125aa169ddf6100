"""What the models directory protects, and whether what it holds is whole.

The models directory (``models.dir``, default ``<state_dir>/models``) holds
``<name>/<version>/{model.engine, model.onnx, meta.json}`` and ``<name>/current -> <version>``
(written by the daemon's activation). This module only reads it:

- ``protected_engines`` / ``protected_engine_keys``: the engine-cache keys (meta.json's
  ``engine_key``) of every version directory present, with who uses each (``name@version``,
  marked ``current`` or ``kept``). The engine cache's eviction and purge take them as a
  callable (``protection(models_dir)``), since the engines package never imports this one.
- ``check_models``: the problems an operator must fix, each with a stable ``code`` and a
  ``fix``: ``current`` missing, not a link or dangling, ``meta.json`` unreadable, the engine
  missing or of another size than meta.json's ``engine_size`` (cheap: one ``stat`` per version,
  fit for every status) or, with ``verify``, of another sha256 than ``engine_sha256``.
  ``health`` turns them into the per-version ``"ok"`` / problem text of the status.

Bounded: at most ``MAX_VERSION_DIRS`` version directories are read, a ``meta.json`` larger than
``MAX_META_BYTES`` is not parsed (a problem instead), and parsed meta files and verified
digests are remembered per file identity (inode, size, mtime), so repeating a check costs a
``stat`` per file. Daemon and CLI side (Python >= 3.8); standard library only.
"""

import json
import os
import stat
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

from agent.fsio import sha256_file

ENGINE_FILE = "model.engine"
META_FILE = "meta.json"
CURRENT = "current"
MAX_META_BYTES = 4 << 20  # layer_precisions of a big model stay far below this
MAX_VERSION_DIRS = 4096  # 256 names (the models topic's limit) x keep_versions, with room
MAX_REMEMBERED = 8192

Problem = Dict[str, Any]

# code -> how to fix it ({name} and {version} are filled in). Codes are stable: status, diag
# and the dashboard show them; never rename one.
FIXES = {
    "models_dir_unreadable": "give the daemon's user read and search access to {path} "
                             "(expected a directory, mode 0750 with the service's group)",
    "models_too_many": "remove version directories nobody uses any more (the daemon keeps "
                       "keep_versions per name); only the first {limit} were checked",
    "current_missing": "activate a version of {name}: `jetson-agent models rollback {name}` "
                       "or deploy it again (`fleet rollout --name {name} --version V`)",
    "current_not_link": "{path} must be the symlink the daemon switches: remove it, then "
                        "`jetson-agent models rollback {name}` or deploy {name} again",
    "current_dangling": "the version `current` names is gone: `jetson-agent models rollback "
                        "{name}` to a kept version, or deploy {name} again",
    "meta_unreadable": "deploy {name}@{version} again (meta.json is the daemon's record of "
                       "the version; it must not be edited)",
    "engine_missing": "deploy {name}@{version} again (`fleet rollout --name {name} --version "
                      "{version}`) or roll back (`jetson-agent models rollback {name}`); "
                      "never `cache purge --force` an engine a version uses",
    "engine_unreadable": "give the daemon's user (and the app's group) read access to the "
                         "engine: files 0640, directories 0750, group of the service",
    "engine_size_mismatch": "the engine is truncated or was replaced: deploy {name}@{version} "
                            "again or roll back (`jetson-agent models rollback {name}`)",
    "engine_sha256_mismatch": "the engine's bytes changed on disk: deploy {name}@{version} "
                              "again or roll back (`jetson-agent models rollback {name}`)",
}

_lock = threading.Lock()
_metas: Dict[str, Tuple[Tuple[int, int, int, int], Any]] = {}  # path -> (identity, meta|error)
_digests: Dict[Tuple[int, int, int, int], str] = {}  # file identity -> sha256


def problem(code: str, text: str, name: str = "", version: str = "", path: str = "",
            current: bool = False, **fill: Any) -> Problem:
    """One problem: stable ``code``, ``problem`` (what was found), ``fix``; ``name`` and
    ``version`` when it concerns one, ``current`` when it is the version the app runs."""
    return {"code": code, "problem": text,
            "fix": FIXES[code].format(name=name or "NAME", version=version or "VERSION",
                                      path=path, **fill),
            "name": name, "version": version, "path": path, "current": current}


def _identity(st: os.stat_result) -> Tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _remember(table: Dict[Any, Any], key: Any, value: Any) -> None:
    with _lock:
        if len(table) >= MAX_REMEMBERED:
            table.clear()
        table[key] = value


def read_meta(version_dir: str) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """(meta.json's object, None) or (None, why it cannot be read); bounded and remembered."""
    path = os.path.join(version_dir, META_FILE)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None, "{} does not exist".format(path)
    except OSError as exc:
        return None, "cannot stat {}: {}".format(path, exc.strerror)
    if not stat.S_ISREG(st.st_mode):
        return None, "{} is not a file".format(path)
    if st.st_size > MAX_META_BYTES:
        return None, "{} has {} bytes, expected at most {}".format(path, st.st_size,
                                                                   MAX_META_BYTES)
    ident = _identity(st)
    with _lock:
        known = _metas.get(path)
    if known is not None and known[0] == ident:
        value = known[1]
        return (value, None) if isinstance(value, dict) else (None, value)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_META_BYTES + 1)
        meta = json.loads(data.decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("expected a JSON object, found {}".format(type(meta).__name__))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        why = "{} is unreadable: {}".format(path, getattr(exc, "strerror", None) or exc)
        _remember(_metas, path, (ident, why))
        return None, why
    _remember(_metas, path, (ident, meta))
    return meta, None


def _listdir(path: str) -> List[str]:
    return sorted(os.listdir(path))


def _version_dirs(models_dir: str, problems: List[Problem], hidden: bool
                  ) -> Iterator[Tuple[str, str, str]]:
    """(name, version, path) of every version directory, at most MAX_VERSION_DIRS.
    ``hidden``: also the dot-named ones (a version the daemon is still assembling)."""
    try:
        names = _listdir(models_dir)
    except FileNotFoundError:
        return
    except OSError as exc:
        problems.append(problem("models_dir_unreadable", "cannot list {}: {}".format(
            models_dir, exc.strerror), path=models_dir))
        return
    seen = 0
    for name in names:
        name_dir = os.path.join(models_dir, name)
        if name.startswith(".") or os.path.islink(name_dir) or not os.path.isdir(name_dir):
            continue
        try:
            versions = _listdir(name_dir)
        except OSError as exc:
            problems.append(problem("models_dir_unreadable", "cannot list {}: {}".format(
                name_dir, exc.strerror), name=name, path=name_dir))
            continue
        for version in versions:
            path = os.path.join(name_dir, version)
            if version == CURRENT or (version.startswith(".") and not hidden) or \
                    os.path.islink(path) or not os.path.isdir(path):
                continue
            if seen >= MAX_VERSION_DIRS:
                problems.append(problem("models_too_many", "{} holds more than {} version "
                                        "directories".format(models_dir, MAX_VERSION_DIRS),
                                        path=models_dir, limit=MAX_VERSION_DIRS))
                return
            seen += 1
            yield name, version, path


def current_version(models_dir: str, name: str) -> Optional[str]:
    """The version ``<name>/current`` names (None: no link, or not one)."""
    try:
        target = os.readlink(os.path.join(models_dir, name, CURRENT))
    except OSError:
        return None
    return os.path.basename(os.path.normpath(target))


def protected_engines(models_dir: str, problems: Optional[List[Problem]] = None
                      ) -> Dict[str, List[str]]:
    """engine_key -> the versions using it (``name@version (current)`` / ``(kept)``), for
    every version directory under ``models_dir`` (also one being assembled). Unreadable
    meta files are skipped and added to ``problems`` when given."""
    sink: List[Problem] = [] if problems is None else problems
    out: Dict[str, List[str]] = {}
    currents: Dict[str, Optional[str]] = {}
    for name, version, path in _version_dirs(models_dir, sink, hidden=True):
        meta, why = read_meta(path)
        if meta is None:
            if not version.startswith("."):
                sink.append(problem("meta_unreadable", str(why), name, version, path))
            continue
        key = meta.get("engine_key")
        if not isinstance(key, str) or not key:
            continue
        if name not in currents:
            currents[name] = current_version(models_dir, name)
        role = "current" if currents[name] == version else "kept"
        out.setdefault(key, []).append("{}@{} ({})".format(name, version, role))
    return out


def protected_engine_keys(models_dir: str) -> Set[str]:
    """The engine-cache keys no eviction or purge may remove (see ``protected_engines``)."""
    return set(protected_engines(models_dir))


def protection(models_dir: Optional[str]) -> Callable[[], Dict[str, List[str]]]:
    """For ``EngineCache(protected=...)``: re-reads ``models_dir`` at each eviction or purge."""
    def protected() -> Dict[str, List[str]]:
        return protected_engines(models_dir) if models_dir else {}
    return protected


def worker_spec_fields(models_dir: Optional[str], group: Optional[str] = None
                       ) -> Dict[str, Any]:
    """What the daemon adds to a worker's job spec so that the job's builds never evict an
    engine a version uses (``agent.worker.context.protected_from_spec``) and publish files the
    app's group can read: ``protected_engines`` (key -> users) and ``engine_group``."""
    out: Dict[str, Any] = {"protected_engines": protected_engines(models_dir)
                           if models_dir else {}}
    if group:
        out["engine_group"] = group
    return out


def _digest(path: str, st: os.stat_result) -> str:
    ident = _identity(st)
    with _lock:
        known = _digests.get(ident)
    if known is None:
        known = sha256_file(path)
        _remember(_digests, ident, known)
    return known


def _check_engine(name: str, version: str, path: str, meta: Dict[str, Any], verify: bool,
                  current: bool) -> Optional[Problem]:
    engine = os.path.join(path, ENGINE_FILE)
    label = "{}@{}".format(name, version)
    try:
        st = os.stat(engine)
    except FileNotFoundError:
        return problem("engine_missing", "the engine of {} ({}) does not exist".format(
            label, engine), name, version, engine, current)
    except OSError as exc:
        return problem("engine_unreadable", "cannot stat the engine of {} ({}): {}".format(
            label, engine, exc.strerror), name, version, engine, current)
    want = meta.get("engine_size")
    if isinstance(want, int) and st.st_size != want:
        return problem("engine_size_mismatch", "the engine of {} has {} bytes, expected {} "
                       "(meta.json's engine_size)".format(label, st.st_size, want),
                       name, version, engine, current)
    want_sha = meta.get("engine_sha256")
    if verify and isinstance(want_sha, str) and want_sha:
        try:
            digest = _digest(engine, st)
        except OSError as exc:
            return problem("engine_unreadable", "cannot read the engine of {} ({}): {}".format(
                label, engine, exc.strerror), name, version, engine, current)
        if digest != want_sha.lower():
            return problem("engine_sha256_mismatch", "the engine of {} has sha256 {}, "
                           "expected {} (meta.json's engine_sha256)".format(
                               label, digest[:16], want_sha[:16]),
                           name, version, engine, current)
    return None


def _check_current(models_dir: str, name: str, versions: List[str]) -> Optional[Problem]:
    link = os.path.join(models_dir, name, CURRENT)
    try:
        st = os.lstat(link)
    except FileNotFoundError:
        if not versions:
            return None
        return problem("current_missing", "{} has versions ({}) but no `current` link".format(
            name, ", ".join(versions[:3])), name, path=link, current=True)
    except OSError as exc:
        return problem("models_dir_unreadable", "cannot read {}: {}".format(
            link, exc.strerror), name, path=link, current=True)
    if not stat.S_ISLNK(st.st_mode):
        return problem("current_not_link", "{} is not a symlink".format(link), name,
                       path=link, current=True)
    target = os.readlink(link)
    version = os.path.basename(os.path.normpath(target))
    if os.path.normpath(target) != version or version in (".", "..", CURRENT) or \
            not os.path.isdir(os.path.join(models_dir, name, version)):
        return problem("current_dangling", "{} points to {!r}, expected a version directory "
                       "of {} (found {})".format(link, target, name,
                                                 ", ".join(versions[:3]) or "none"),
                       name, version, link, True)
    return None


def check_models(models_dir: str, verify: bool = False) -> List[Problem]:
    """Every problem of ``models_dir`` (empty: all whole, or no models yet). Cheap by default
    (``stat`` calls); ``verify`` also compares each engine's sha256 with meta.json's (a digest
    is computed once per file identity in this process)."""
    problems: List[Problem] = []
    by_name: Dict[str, List[Tuple[str, str]]] = {}
    for name, version, path in _version_dirs(models_dir, problems, hidden=False):
        by_name.setdefault(name, []).append((version, path))
    try:
        names = [n for n in _listdir(models_dir) if not n.startswith(".")
                 and os.path.isdir(os.path.join(models_dir, n))]
    except OSError:
        names = []
    for name in sorted(set(names) | set(by_name)):
        versions = by_name.get(name, [])
        found = _check_current(models_dir, name, [v for v, _ in versions])
        if found:
            problems.append(found)
        current = current_version(models_dir, name)
        for version, path in versions:
            meta, why = read_meta(path)
            if meta is None:
                problems.append(problem("meta_unreadable", str(why), name, version, path,
                                        version == current))
                continue
            found = _check_engine(name, version, path, meta, verify, version == current)
            if found:
                problems.append(found)
    return problems


def health(problems: List[Problem], name: str, version: str) -> str:
    """``"ok"``, or the first problem of ``name@version`` (or of its ``current`` link when
    ``version`` is the one it should name): the per-model ``health`` of the status."""
    for p in problems:
        if p["name"] == name and (p["version"] == version or (
                p["current"] and p["code"].startswith("current_") and
                p["version"] in ("", version))):
            return "{} [{}]".format(p["problem"], p["code"])
    return "ok"
