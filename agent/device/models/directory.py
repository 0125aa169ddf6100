"""The models directory (config ``models.dir``, default ``$JETSON_AGENT_MODELS_DIR`` (the unit
sets /var/lib/jetson-agent-models), else ``<state_dir>/models``): the stable place
where applications find the deployed engines (docs/daemon.md). The I/O edge of the named
models: the journal says which version is active, this module makes the disk say the same.

    <models_dir>/<name>/<version>/model.engine   hard link to the engine cache's file
                                  model.onnx     hard link to the artifact store's model
                                  meta.json      agent.device.models.meta
                                  model.engine.dla-core / .platform.json / .plugins.json
                                                 the engine's sidecars, when it has them
    <models_dir>/<name>/current -> <version>     relative symlink

A version directory is written under a temporary name (``.tmp-<version>``), every file and the
directory fsync'd, then renamed into place: a version directory that exists is complete.
``current`` is switched by a new link under a temporary name and ``os.replace`` (atomic), and is
only ever pointed at a complete directory; a version directory is removed only when ``current``
does not point at it. Files are hard links where the file system allows (no second copy on a
small eMMC), copies otherwise; files 0640 and directories 0750, in the group ``models.group``
(the app's), so an app of that group reads them and nothing else does.
"""

import grp
import json
import os
import shutil
import stat
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set

from agent.engines.share import SIDECARS
from agent.errors import AgentError
from agent.fsio import atomic_write, fsync_dir, sha256_file

ENGINE, ONNX, META, CURRENT = "model.engine", "model.onnx", "meta.json", "current"
CALIBRATION = "calibration.cache"  # INT8: TensorRT calibration cache (int8-calib-file)
TMP_PREFIX = ".tmp-"
REMOVED_PREFIX = ".removed-"  # a removed name moved aside (agent.device.models.removal)
FILE_MODE, DIR_MODE = 0o640, 0o750


def _no_step(step: str) -> None:
    pass


class ModelsDir(object):
    """One models directory. ``on_step(step)`` is called after each durable step of a write
    or switch ("version_written", "link_switched"): a hook for fault tests and timings."""

    def __init__(self, root: str, group: Optional[str] = None,
                 on_step: Callable[[str], None] = _no_step) -> None:
        self.root = os.path.abspath(root)
        self.gid = _gid(group)
        self.on_step = on_step
        if self.gid is not None and os.geteuid() != 0 and self.gid != os.getegid() and \
                self.gid not in os.getgroups():
            # Giving a file to a group needs membership: say so at start, not at the first
            # activation.
            raise AgentError("bad_config", "models.group {}: expected the service user to be a "
                             "member (the unit's SupplementaryGroups=, docs/using-models.md), "
                             "found uid {} in groups {}".format(
                                 group, os.geteuid(), sorted(set(os.getgroups()))))

    def name_dir(self, name: str) -> str:
        return os.path.join(self.root, name)

    def version_dir(self, name: str, version: str) -> str:
        return os.path.join(self.root, name, version)

    def _make_dir(self, path: str) -> None:
        if not os.path.isdir(path):
            os.makedirs(path, exist_ok=True)
        self._own(path, DIR_MODE)

    def _own(self, path: str, mode: int) -> None:
        try:
            st = os.stat(path)
            if self.gid is not None and st.st_gid != self.gid:
                os.chown(path, -1, self.gid)
            # Keep a directory's setgid bit (the installed models directory is 2750): what is
            # made in it starts in the models group.
            os.chmod(path, mode | (st.st_mode & stat.S_ISGID if stat.S_ISDIR(st.st_mode) else 0))
        except OSError as exc:
            raise AgentError("internal_error", "cannot give {} to the models group (mode {:o}): "
                             "{}".format(path, mode, exc.strerror or exc))

    def write_version(self, name: str, version: str, engine: str, onnx: Optional[str],
                      meta_for: Callable[[str, int], Mapping[str, Any]],
                      calibration: Optional[str] = None) -> str:
        """Write ``<name>/<version>/`` (engine, model and the INT8 calibration cache linked or
        copied, meta.json from ``meta_for(engine_sha256, engine_size)``) and return its path.
        A complete directory already there (its engine matches its meta.json) is kept."""
        self._make_dir(self.root)
        self._make_dir(self.name_dir(name))
        final = self.version_dir(name, version)
        if os.path.isdir(final) and version_problem(final) is None:
            return final
        tmp = os.path.join(self.name_dir(name), TMP_PREFIX + version)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        try:
            _link_or_copy(engine, os.path.join(tmp, ENGINE))
            for suffix in SIDECARS:  # the DLA core, platform record, plugin list: the app's too
                if os.path.isfile(engine + suffix):
                    _link_or_copy(engine + suffix, os.path.join(tmp, ENGINE + suffix))
            if onnx:
                _link_or_copy(onnx, os.path.join(tmp, ONNX))
            if calibration and os.path.isfile(calibration):
                _link_or_copy(calibration, os.path.join(tmp, CALIBRATION))
            engine_sha, engine_size = sha256_file(os.path.join(tmp, ENGINE)), os.path.getsize(
                os.path.join(tmp, ENGINE))
            meta = dict(meta_for(engine_sha, engine_size))
            with open(os.path.join(tmp, META), "wb") as f:
                f.write(json.dumps(meta, indent=1, sort_keys=True).encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            for item in os.listdir(tmp):
                path = os.path.join(tmp, item)
                self._own(path, FILE_MODE)
                _fsync_file(path)
            self._own(tmp, DIR_MODE)
            fsync_dir(tmp)
            if os.path.lexists(final):  # an incomplete leftover: never the current one
                if self.current(name) == version:
                    raise AgentError("internal_error", "{} is current but incomplete ({})".format(
                        final, version_problem(final)))
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(self.name_dir(name))
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if exc.errno == 28:
                raise AgentError("disk_full", "no room for model version {}: {}".format(
                    final, exc.strerror))
            raise AgentError("internal_error", "cannot write model version {}: {}".format(
                final, exc.strerror or exc))
        self.on_step("version_written")
        return final

    def update_meta(self, name: str, version: str, keys: Mapping[str, Any]) -> None:
        """Add ``keys`` to a version's meta.json (atomically: an app reads the old or the new
        one whole); the engine's facts stay as they are."""
        path = self.version_dir(name, version)
        meta = read_meta(path)
        meta.update(keys)
        atomic_write(os.path.join(path, META), json.dumps(meta, indent=1, sort_keys=True)
                     .encode("utf-8"), mode=FILE_MODE)
        self._own(os.path.join(path, META), FILE_MODE)

    def current(self, name: str) -> Optional[str]:
        """The version ``current`` points at, or None."""
        try:
            target = os.readlink(os.path.join(self.name_dir(name), CURRENT))
        except OSError:
            return None
        return os.path.basename(target.rstrip("/"))

    def set_current(self, name: str, version: str) -> None:
        """Point ``current`` at a complete version directory, atomically."""
        final = self.version_dir(name, version)
        if not os.path.isdir(final):
            raise AgentError("internal_error", "cannot switch {} to {}: no such version "
                             "directory".format(name, final))
        if self.current(name) == version:
            return
        link = os.path.join(self.name_dir(name), CURRENT)
        tmp = os.path.join(self.name_dir(name), TMP_PREFIX + CURRENT)
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(version, tmp)
        os.replace(tmp, link)
        fsync_dir(self.name_dir(name))
        self.on_step("link_switched")

    def remove_version(self, name: str, version: str) -> bool:
        """Remove a version directory that is no longer kept (never the current one)."""
        if self.current(name) == version:
            return False
        path = self.version_dir(name, version)
        if not os.path.isdir(path):
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True

    def names(self) -> List[str]:
        try:
            return sorted(n for n in os.listdir(self.root) if not n.startswith(".")
                          and os.path.isdir(os.path.join(self.root, n)))
        except OSError:
            return []

    def versions(self, name: str) -> List[str]:
        try:
            return sorted(v for v in os.listdir(self.name_dir(name))
                          if not v.startswith(".") and v != CURRENT
                          and os.path.isdir(self.version_dir(name, v)))
        except OSError:
            return []

    def reconcile(self, active: Mapping[str, str], kept: Mapping[str, Iterable[str]]) -> None:
        """At start-up: temporary leftovers removed, ``current`` of each name pointed at the
        journal's active version (when its directory is there), version directories the
        journal no longer keeps removed. A name the journal does not know keeps its current
        directory (never left dangling), and loses the rest. Names a removal moved aside and
        did not get to delete (a crash) go."""
        try:
            aside = [n for n in os.listdir(self.root) if n.startswith(REMOVED_PREFIX)]
        except OSError:
            aside = []
        for item in aside:
            shutil.rmtree(os.path.join(self.root, item), ignore_errors=True)
        for name in self.names():
            base = self.name_dir(name)
            for item in os.listdir(base):
                if item.startswith(TMP_PREFIX):
                    path = os.path.join(base, item)
                    if os.path.isdir(path) and not os.path.islink(path):
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        os.unlink(path)
            want = active.get(name)
            if want is not None and os.path.isdir(self.version_dir(name, want)):
                self.set_current(name, want)
            keep: Set[str] = set(kept.get(name) or ())
            for version in self.versions(name):
                if version not in keep:
                    self.remove_version(name, version)


def version_problem(path: str) -> Optional[str]:
    """None when a version directory is complete: meta.json readable, the engine's size and
    sha256 as it says."""
    try:
        with open(os.path.join(path, META), "rb") as f:
            meta = json.loads(f.read().decode("utf-8"))
        engine = os.path.join(path, ENGINE)
        if os.path.getsize(engine) != meta.get("engine_size"):
            return "engine size differs from meta.json"
        if sha256_file(engine) != meta.get("engine_sha256"):
            return "engine sha256 differs from meta.json"
    except (OSError, ValueError, AttributeError) as exc:
        return "unreadable: {}".format(exc)
    return None


def read_meta(path: str) -> Dict[str, Any]:
    with open(os.path.join(path, META), "rb") as f:
        meta = json.loads(f.read().decode("utf-8"))
    return meta if isinstance(meta, dict) else {}


def _gid(group: Optional[str]) -> Optional[int]:
    if not group:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        if group.isdigit():
            return int(group)
        raise AgentError("bad_config", "models.group: expected a group of this system, found "
                         "{!r}".format(group))


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _fsync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
