"""What more than one of the daemon's parts reads or writes: the job in hand, the counters ``diag``
reports, the stop flag; and the one-line status systemd shows (``ServiceStatus``). Everything
else a part needs is handed to it in its constructor (agent/device/daemon.py wires them)."""

import time
from typing import Dict, Optional

from agent.device.jobs.run import Run
from agent.device.sdnotify import Notifier


class DaemonState:
    """The job in hand (the scheduler sets it, the job's end clears it; downloads, the worker
    supervisor, cancels and diag read it), the counters, and whether the daemon is stopping."""

    def __init__(self) -> None:
        self.run: Optional[Run] = None
        self.stop_requested = False
        self.started = time.monotonic()
        self.counters: Dict[str, int] = {
            "messages": 0, "rejected_messages": 0, "jobs": 0, "blocks": 0,
            "unauthenticated_jobs": 0, "rejections_dropped": 0, "session_taken_over": 0}

    def activity(self) -> str:
        run = self.run
        if run is None:
            return "idle"
        return "job {} {}".format(run.job_id, run.stage or "starting")


class ServiceStatus:
    """The status line systemd shows (sent only when it changes), and whether READY was sent."""

    def __init__(self, notifier: Optional[Notifier] = None) -> None:
        self.notifier = notifier or Notifier()
        self.text = ""
        self.ready = False

    def show(self, text: str) -> None:
        if text != self.text:
            self.text = text
            self.notifier.status(text)
