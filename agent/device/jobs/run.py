"""The job the daemon is working on: its document, plan, artifacts, worker and progress."""

import subprocess
import time
from typing import Any, Dict, Optional, Tuple

PROGRESS_EVERY_S = 1.0  # at most one progress status per second (stage changes go at once)


class Run:
    """The job this daemon is working on (at most one at a time)."""

    def __init__(self, row: Dict[str, Any], timeout_s: float) -> None:
        self.job_id: str = row["job_id"]
        self.kind: str = row["kind"]
        self.doc: Dict[str, Any] = row["doc"] or {}
        self.details: Dict[str, str] = {str(k): str(v) for k, v in row["details"].items()}
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self.timeout_s = timeout_s
        self.needed: Dict[str, Tuple[str, int]] = {}  # role -> (sha256, size)
        self.paths: Dict[str, str] = {}
        self.plan: Dict[str, Any] = {}
        self.fallback_reason: Optional[str] = None
        self.backend = ""
        self.fingerprint: Dict[str, str] = {}
        self.proc: Optional[subprocess.Popen] = None  # type: ignore[type-arg]
        self.token = 0
        self.work_dir = ""
        self.stderr_path = ""
        self.kill_at: Optional[float] = None
        self.cancel_requested = False
        self.timed_out = False
        self.stopping_for_shutdown = False
        self.result: Optional[Dict[str, Any]] = None
        self.error: Optional[Dict[str, Any]] = None
        self.stage = ""
        self.last_progress = 0.0
        self.download_started: Optional[float] = None  # monotonic, when artifacts were asked for

    @property
    def downloading(self) -> bool:
        return self.proc is None and len(self.paths) < len(self.needed)
