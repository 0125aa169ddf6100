"""Files written into the engine cache: fsync'd, streamed a block at a time, a full disk
reported as ``disk_full`` (the stable code a controller can act on) instead of an OSError, and
readable by the service's group (``share``: 0640 files / 0750 directories of a configured
group, else 0644 less the umask, whatever mode the backend wrote them with).

Worker side: Python >= 3.6.
"""

import contextlib
import errno
import os
import stat
from typing import Iterable, Iterator, Optional, Union

from agent.errors import AgentError
from agent.fsio import current_umask

_CHUNK = 1 << 20
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def disk_full_errors(path: str) -> Iterator[None]:
    """ENOSPC/EDQUOT inside the block becomes ``disk_full`` naming ``path``."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise AgentError("disk_full", "no space left writing {} into the engine cache "
                             "({})".format(path, os.strerror(exc.errno or errno.ENOSPC)))
        raise


def make_dirs(path: str, exist_ok: bool = False) -> None:
    with disk_full_errors(path):
        os.makedirs(path, exist_ok=exist_ok)


def _write_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _write_new(path: str, chunks: Iterable[bytes]) -> None:
    """Create ``path`` from ``chunks`` and fsync it (inside a staging directory: the rename of
    the directory is what makes it atomic)."""
    with disk_full_errors(path):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for chunk in chunks:
                _write_fd(fd, chunk)
            os.fsync(fd)
        finally:
            os.close(fd)


def write_file(path: str, data: bytes) -> None:
    _write_new(path, [data])


def copy_file(src: str, dst: str) -> None:
    """Stream ``src`` into a new file ``dst``, a block at a time."""
    with open(src, "rb") as f:
        _write_new(dst, iter(lambda: f.read(_CHUNK), b""))


def dir_size(path: str) -> int:
    """Bytes of the files directly in ``path`` (those that can be read)."""
    total = 0
    for name in os.listdir(path):
        try:
            total += os.path.getsize(os.path.join(path, name))
        except OSError:
            pass
    return total


def resolve_group(group: Union[None, int, str]) -> Optional[int]:
    """A group id from a gid or a group name (None: no group configured)."""
    if group is None or group == "":
        return None
    if isinstance(group, int) or str(group).isdigit():
        return int(group)
    import grp

    try:
        return grp.getgrnam(str(group)).gr_gid
    except KeyError:
        raise AgentError("bad_argument", "expected the name or id of an existing group for the "
                         "engine files, found {!r}".format(group))


def share(path: str, gid: Optional[int] = None) -> None:
    """Make the files directly in ``path`` (and ``path``) readable by the group: with ``gid``
    files 0640 and the directory 0750 of that group, else files 0644 less the umask (the
    backends write through temporary files, which are 0600)."""
    mask = current_umask()
    with os.scandir(path) as it:
        for item in it:
            if item.is_symlink() or not item.is_file():
                continue
            _set(item.path, 0o640 if gid is not None else 0o644 & ~mask, gid)
    if gid is not None:
        _set(path, 0o750, gid)


def _set(path: str, mode: int, gid: Optional[int]) -> None:
    st = os.lstat(path)
    if gid is not None and st.st_gid != gid:
        try:
            os.chown(path, -1, gid)
        except OSError:
            pass  # not a member of the group: the mode still applies to the current group
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
