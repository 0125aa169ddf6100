"""Watching a TensorRT build: ``IProgressMonitor`` (TensorRT >= 10.0) on the builder config
turns the builder's phases and steps into ``progress("building", done, total)`` calls (the
CLI's bar, the job's status over MQTT, the dashboard) and stops the build when the progress
callback returns False (a cancelled job) or the user interrupts it: ``step_complete``
returning False is TensorRT's way to end a build early. Before 10.0 a build reports its
phases only (calibrating, building 0/1 then 1/1).

The monitor runs on TensorRT's threads (NvInfer.h: it must be thread-safe): it only counts,
calls the callback and keeps the first reason to stop; an exception never crosses into
TensorRT. Worker side: Python >= 3.6.
"""

import threading
from typing import Any, Optional

from agent.engines.backends.base import Progress


def make_monitor(trt: Any, progress: Progress) -> Any:
    """An ``IProgressMonitor`` that reports the top-level phase's steps through ``progress``.
    ``monitor.stopped``: None while the build may go on, else "cancelled" or "interrupted"."""

    class Monitor(trt.IProgressMonitor):  # type: ignore[misc,name-defined]
        def __init__(self) -> None:
            trt.IProgressMonitor.__init__(self)
            self.lock = threading.Lock()
            self.top: Optional[str] = None  # the phase without a parent being counted
            self.done = 0
            self.total = 0
            self.stopped: Optional[str] = None

        def phase_start(self, phase_name: str, parent_phase: Optional[str],
                        num_steps: int) -> None:
            with self.lock:
                if parent_phase is None or self.top is None:
                    self.top, self.done, self.total = phase_name, 0, int(num_steps)
            self._report()

        def step_complete(self, phase_name: str, step: int) -> bool:
            with self.lock:
                if phase_name == self.top:
                    self.done = min(int(step) + 1, self.total)
            return self._report()

        def phase_finish(self, phase_name: str) -> None:
            with self.lock:
                if phase_name == self.top:
                    self.done, self.top = self.total, None

        def _report(self) -> bool:
            """Every step asks the callback (the worker's is rate-limited and checks whether
            the job was cancelled): False stops the build."""
            if self.stopped:
                return False
            try:
                if progress("building", self.done, self.total) is False:
                    self.stopped = "cancelled"
            except KeyboardInterrupt:  # Ctrl-C lands in the first Python frame: this one
                self.stopped = "interrupted"
            except Exception:  # noqa: BLE001 - a progress display never fails a build
                pass
            return not self.stopped

    return Monitor()
