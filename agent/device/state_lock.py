"""One daemon per state directory: an exclusive ``flock`` on ``<state-dir>/daemon.lock``.

Two daemons on one state directory (or one device id) would share a journal and an MQTT
client id, and the broker would throw each off in turn every second. The daemon takes the lock
at start-up and holds it until it exits (the kernel drops it even on SIGKILL, so it is never
stale); the file names the holder's PID and device for the error message and for
``jetson-agent status``, which probes the lock without blocking the daemon.
"""

import fcntl
import json
import os
import time
from typing import Any, Dict, Optional

from agent.errors import AgentError
from agent.fsio import lock_fd, unlock_fd

LOCK_FILE = "daemon.lock"
# A probe by `status` holds a shared lock for microseconds; the daemon retries this long
# before calling the directory taken.
ACQUIRE_RETRY_S = 2.0


def check_state_dir(path: str, create: bool = True) -> str:
    """``path`` as an absolute directory (made when ``create``): a clear error, not a
    traceback, when it is a file or cannot be made."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise AgentError("bad_argument", "state directory {} is a file: expected a directory "
                         "(--state-dir, state_dir in the config or $JETSON_AGENT_STATE_DIR)"
                         .format(path))
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            raise AgentError("bad_argument", "cannot create the state directory {}: {} "
                             "(expected a writable directory)".format(path, exc.strerror))
    return path


def lock_path(state_dir: str) -> str:
    return os.path.join(state_dir, LOCK_FILE)


class StateLock(object):
    """The held lock; ``close`` releases it (process exit does too)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd: Optional[int] = fd

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def _read(path: str) -> Dict[str, Any]:
    try:
        with open(path) as f:
            data = json.loads(f.read() or "{}")
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def acquire(state_dir: str, device: str = "") -> StateLock:
    """Take the state directory's lock for this process, or raise ``state_dir_in_use``
    naming the daemon that holds it."""
    state_dir = check_state_dir(state_dir)
    path = lock_path(state_dir)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        taken = lock_fd(fd, fcntl.LOCK_EX, ACQUIRE_RETRY_S, poll_s=0.05)
    except OSError:
        os.close(fd)
        raise
    if not taken:
        os.close(fd)
        other = _read(path)
        raise AgentError(
            "state_dir_in_use",
            "state directory {} is in use by another jetson-agent daemon (PID {}{}): stop "
            "it first (sudo systemctl stop jetson-agent), or give this one its own "
            "--state-dir and --device-id".format(
                state_dir, other.get("pid", "unknown"),
                ", device {}".format(other["device"]) if other.get("device") else ""),
            details={"pid": other.get("pid"), "device": other.get("device")})
    body = json.dumps({"pid": os.getpid(), "device": device, "started": time.time()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, (body + "\n").encode("utf-8"), 0)
    return StateLock(path, fd)


def holder(state_dir: str) -> Optional[Dict[str, Any]]:
    """The running daemon's ``{"pid", "device", "started"}`` when one holds the lock, else
    None; ``{"unknown": reason}`` when the lock file cannot be read (another user's state
    directory: try sudo). Creates nothing."""
    path = lock_path(os.path.abspath(state_dir))
    try:
        fd = os.open(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return {"unknown": "cannot read {}: {}".format(path, exc.strerror)}
    try:
        try:
            taken = lock_fd(fd, fcntl.LOCK_SH, 0)
        except OSError:
            taken = False
        if not taken:
            return _read(path) or {"pid": None}
        unlock_fd(fd)
        return None
    finally:
        os.close(fd)
