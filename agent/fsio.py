"""Atomic file writes, the state-directory rule and file locks (worker side: Python >= 3.6).

Writes go to a temporary file in the target's directory, are fsync'd, then renamed over the
target, so a reader (or a crash) never sees half a file. ENOSPC becomes ``disk_full``.
"""

import contextlib
import errno
import fcntl
import hashlib
import os
import tempfile
import time
from typing import Iterator, Optional

from agent.errors import AgentError


def state_dir(override: Optional[str] = None) -> str:
    """Where state and caches live: an explicit override, $JETSON_AGENT_STATE_DIR, systemd's
    StateDirectory ($STATE_DIRECTORY), else ~/.cache/jetson-agent."""
    path = (
        override
        or os.environ.get("JETSON_AGENT_STATE_DIR")
        or (os.environ.get("STATE_DIRECTORY") or "").split(":")[0]
        or os.path.join(os.path.expanduser("~"), ".cache", "jetson-agent")
    )
    return os.path.abspath(path)


def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def current_umask() -> int:
    """The process's umask, read without changing it where /proc says it (Linux >= 4.7)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def atomic_write(path: str, data: bytes, mode: Optional[int] = None) -> None:
    """Write ``data`` to ``path`` atomically: temp file, fsync, rename, fsync of the directory.
    The file is 0600 (the temporary file's mode) unless ``mode`` is given: then ``mode``
    less the umask, as ``open`` would create it (0o644 under the service's UMask=0027: 0640,
    readable by its group)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        if mode is not None:
            os.fchmod(fd, mode & ~current_umask() & 0o7777)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if exc.errno == errno.ENOSPC:
            raise AgentError(
                "disk_full",
                "no space left writing {} ({} bytes expected to fit)".format(path, len(data)),
            )
        raise
    fsync_dir(directory)


def atomic_write_text(path: str, text: str) -> None:
    atomic_write(path, text.encode("utf-8"))


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks (memory stays bounded whatever its size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------- file locks
# The one flock helper (the engine cache, timing caches, the signer's sequence, the state
# directory's daemon lock). flock locks belong to an open file: a second open+flock of the
# same file in one process deadlocks, so re-entrant callers keep their fd
# (agent.engines.cache_lock).

def lock_fd(fd: int, mode: int = fcntl.LOCK_EX, timeout: Optional[float] = None,
            poll_s: float = 0.02) -> bool:
    """``flock(fd, mode)`` (LOCK_EX or LOCK_SH); wait at most ``timeout`` seconds (None:
    forever; 0: do not wait). False when it was not taken in time; other errors raise."""
    if timeout is None:
        fcntl.flock(fd, mode)
        return True
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)


def unlock_fd(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def file_lock(path: str, mode: int = fcntl.LOCK_EX) -> Iterator[int]:
    """Hold ``mode`` on ``path`` (created, with its directory, if needed) for the block,
    waiting as long as it takes; yields the fd."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        lock_fd(fd, mode)
        yield fd
    finally:
        os.close(fd)  # closing drops the flock
