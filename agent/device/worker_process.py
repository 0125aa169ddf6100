"""The worker as an operating-system process: the events its reader thread queues, signals to its
process group, its memory ceiling, the cgroup's OOM kill count, its exit and stderr in words, and
a worker orphaned by a killed daemon. No daemon state here."""

import logging
import os
import resource
import signal
import subprocess
from typing import NamedTuple, Optional

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

STDERR_TAIL = 2000


class WorkerEvent(NamedTuple):
    kind: str  # "line" | "exit"
    token: int
    line: bytes = b""
    returncode: int = 0


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "signal {}".format(-returncode)
        return "killed by {} ({})".format(name, -returncode)
    return "exited with status {}".format(returncode)


def stderr_tail(path: str, limit: int = STDERR_TAIL) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def limit_memory(pid: int, limit: int) -> None:
    """Set the worker's RLIMIT_DATA from here (no preexec_fn: unsafe with the daemon's threads);
    the worker is still importing when it applies."""
    if limit <= 0:
        return
    try:
        resource.prlimit(pid, resource.RLIMIT_DATA, (limit, limit))
    except (OSError, ValueError) as exc:
        log.warning("cannot limit worker %d to %d bytes: %s", pid, limit, exc)


def oom_kills() -> int:
    """The kernel's OOM kills in this service's cgroup (v2 memory.events; 0 when unknown)."""
    try:
        with open("/proc/self/cgroup") as f:
            path = [line.split(":", 2)[2].strip() for line in f if line.startswith("0::")][0]
        with open("/sys/fs/cgroup{}/memory.events".format(path.rstrip("/"))) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, IndexError, ValueError):
        pass
    return 0


def signal_group(proc: "subprocess.Popen[bytes]", sig: int) -> None:
    """Signal the worker and anything it started (it leads its own session)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def kill_orphan(pid_text: Optional[str], job_id: str) -> None:
    """A worker left running by a daemon that was killed: stop it before running the job again
    (it leads its own process group; only a process that is our worker for this job)."""
    try:
        pid = int(pid_text or "")
        with open("/proc/{}/cmdline".format(pid), "rb") as f:
            cmdline = f.read()
    except (ValueError, OSError):
        return
    if b"agent.worker" in cmdline and os.path.join("work", job_id).encode() in cmdline:
        log.warning("job %s: killing worker %d left by the previous agent", job_id, pid)
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
