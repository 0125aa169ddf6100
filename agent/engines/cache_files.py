"""Files written into the engine cache: fsync'd, streamed a block at a time, and a full disk
reported as ``disk_full`` (the stable code a controller can act on) instead of an OSError.

Worker side: Python >= 3.6.
"""

import contextlib
import errno
import os
from typing import Iterable, Iterator

from agent.errors import AgentError

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
