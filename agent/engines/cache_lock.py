"""Cross-process locks for the engine cache: ``flock`` on a lock file, re-entrant within a
process. Apart from the cache because flock has traps of its own (a second open+flock in one
process deadlocks; a lock file unlinked between open and flock locks a dead inode) that are
easier to get right, and to read, in one place.

Worker side: Python >= 3.6.
"""

import fcntl
import os
import time
from typing import Dict, List, Optional

from agent.fsio import lock_fd

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


def acquire(path: str, mode: int, timeout: Optional[float]) -> bool:
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
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not lock_fd(fd, mode, remaining):
                os.close(fd)
                return False
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


def holds(path: str) -> int:
    """How many holds this process has on ``path`` (0: none)."""
    held = _HELD.get(path)
    return held[1] if held is not None else 0


def release(path: str, unlink: bool = False) -> None:
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
