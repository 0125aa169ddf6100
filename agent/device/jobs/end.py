"""How a job ends, whatever stage it reached: its terminal state recorded and published (with the
error or result, cut to size), its unfinished downloads dropped, its work directory removed, and
the daemon freed for the next job. Intake (cancels), the scheduler, downloads and the worker
supervisor all end jobs through here."""

import logging
import shutil
from typing import Any, Callable, Dict, Optional

from agent.device.daemon_state import DaemonState
from agent.device.jobs.run import Run
from agent.device.status_publisher import StatusPublisher, fit_result
from agent.errors import AgentError
from agent.wire import message_caps

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

MAX_LOGGED_ERROR_BYTES = 16 * 1024  # a job error as the log line and the journal keep it
# Worker errors that mean "this job can never work here" (AWS IoT: REJECTED, not retryable).
REJECT_CODES = frozenset(("bad_argument", "bad_model", "unsupported_model", "dynamic_shape",
                          "unknown_layer", "bad_calibration_data", "empty_calibration_data",
                          "golden_mismatch", "bad_golden_file", "unsupported_precision",
                          "backend_unavailable", "unknown_job_kind", "bad_message",
                          "bad_model_name", "bad_model_version", "version_rejected"))
# A pin on the device, or a job that does not fit the open model set (model_notes, model_sets).
REJECT_CODES = REJECT_CODES | frozenset(("model_pinned", "bad_model_set"))


class JobEnding:
    """Ends the job in hand. ``cancel_download(sha256)`` stops fetching an artifact;
    ``show_activity()`` refreshes the status line systemd shows."""

    def __init__(self, shared: DaemonState, publisher: StatusPublisher,
                 cancel_download: Callable[[str], None],
                 show_activity: Callable[[], None]) -> None:
        self.shared = shared
        self.publisher = publisher
        self.cancel_download = cancel_download
        self.show_activity = show_activity

    def fail(self, run: Run, exc: AgentError) -> None:
        state = "REJECTED" if exc.code in REJECT_CODES else "FAILED"
        if exc.code == "cancelled":
            state = "CANCELED"
        self.end(run, state, error=exc.to_dict())

    def end(self, run: Run, state: str, error: Optional[Dict[str, Any]] = None,
            result: Optional[Dict[str, Any]] = None) -> None:
        # A worker's error may be megabytes (an output name, 30,000 output names): it is cut
        # here, before the log line and the journal, as it is in the status.
        if error is not None:
            error = message_caps.fit_error(error, MAX_LOGGED_ERROR_BYTES)
        for sha, _ in run.needed.values():
            if run.downloading:
                self.cancel_download(sha)
        run.details.pop("worker", None)
        run.details.pop("worker_pid", None)
        if error is not None:
            run.details["error_code"] = str(error.get("code"))
            if isinstance(error.get("details"), dict):
                error = dict(error, details=fit_result(error["details"]))
        try:
            # A finished job is in no stage (a failed one keeps where it failed).
            done: Dict[str, Any] = {"stage": None, "progress": None} if state == "SUCCEEDED" \
                else {}
            self.publisher.set_state(run, state, error=error, result=result, **done)
            log.log(logging.INFO if state == "SUCCEEDED" else logging.WARNING, "job %s %s%s",
                    run.job_id, state, "" if error is None else " [{}]: {}".format(
                        error.get("code"), error.get("message")))
        finally:  # whatever happens, the daemon moves on to the next job
            if run.work_dir:
                shutil.rmtree(run.work_dir, ignore_errors=True)
            if self.shared.run is run:
                self.shared.run = None
        self.show_activity()
