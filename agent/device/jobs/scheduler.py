"""Queued -> checked: when the daemon is free, take the oldest unfinished job (the journal's
queue), run it again if the agent stopped while its worker ran (at most MAX_ATTEMPTS), decide
its precision and backend for this platform (agent.platform) and check its artifacts against the
limits, before any download; then hand it to the downloads. A cancel job interrupted by a restart
is finished here."""

import logging
import os
from typing import Any, Callable, Dict, List, Optional

from agent.device.config import Config
from agent.device.daemon_state import DaemonState
from agent.device.jobs.run import Run
from agent.device.status_publisher import StatusPublisher
from agent.device.worker_process import kill_orphan
from agent.errors import AgentError
from agent.wire.device import job_semantics

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

MAX_ATTEMPTS = 2  # a job interrupted in its worker by an agent restart runs once more


class JobScheduler:
    """Starts the next job. ``start_downloads(run)`` fetches its artifacts (then the worker
    runs), ``fail(run, error)`` ends it, ``run_cancel_job(doc)`` runs a cancel job (intake),
    ``show_activity()`` refreshes the status line systemd shows."""

    def __init__(self, cfg: Config, journal: Any, platform: Any, backend: str,
                 backend_problem: Optional[str], shared: DaemonState,
                 publisher: StatusPublisher, start_downloads: Callable[[Run], None],
                 fail: Callable[[Run, AgentError], None],
                 run_cancel_job: Callable[[Dict[str, Any]], None],
                 show_activity: Callable[[], None],
                 check_model: Callable[[Dict[str, Any], str], None] = lambda doc, sha: None,
                 resume_commit: Optional[Callable[[Run], None]] = None) -> None:
        self.cfg = cfg
        self.journal = journal
        self.platform = platform
        self.backend = backend
        self.backend_problem = backend_problem  # why the configured backend cannot run
        self.shared = shared
        self.publisher = publisher
        self.start_downloads = start_downloads
        self.fail = fail
        self.run_cancel_job = run_cancel_job
        self.show_activity = show_activity
        self.check_model = check_model  # names valid, version not rejected (model_switch)
        self.resume_commit = resume_commit  # a job whose version was pending at a restart

    def schedule(self) -> None:
        if self.shared.run is not None or self.shared.stop_requested:
            return
        for row in self.journal.unfinished_jobs():
            if row["kind"] == "cancel":
                # A cancel job interrupted before it finished: do it now.
                self._run_cancel_job_row(row)
                continue
            self._begin(row)
            return

    def _run_cancel_job_row(self, row: Dict[str, Any]) -> None:
        if row["state"] == "IN_PROGRESS":
            self.publisher.set_state(row["job_id"], "FAILED", error=AgentError(
                "internal_error", "the agent restarted during the cancel").to_dict())
        else:
            self.run_cancel_job(row["doc"])

    def _timeout_for(self, doc: Dict[str, Any]) -> float:
        value = doc.get("timeout_s")
        return float(value) if isinstance(value, (int, float)) else self.cfg.limits.job_timeout_s

    def _begin(self, row: Dict[str, Any]) -> None:
        run = Run(row, self._timeout_for(row["doc"] or {}))
        self.shared.run = run
        try:
            if row["state"] == "IN_PROGRESS" and run.details.get("commit") == "pending" and \
                    self.resume_commit is not None:
                self.resume_commit(run)  # the worker had finished: only the commit is left
                self.show_activity()
                return
            if row["state"] == "IN_PROGRESS" and run.details.get("worker") == "started":
                kill_orphan(run.details.get("worker_pid"), run.job_id)
                if row["attempts"] >= MAX_ATTEMPTS:
                    raise AgentError("worker_crashed", "the agent stopped while this job's worker "
                                     "ran, {} times; not retrying".format(row["attempts"]))
                attempt = self.journal.bump_attempts(run.job_id)
                log.warning("job %s was running when the agent stopped: running it again "
                            "(attempt %d)", run.job_id, attempt)
                run.details["attempt"] = str(attempt)
                run.details.pop("worker", None)
                run.details.pop("worker_pid", None)
            else:
                run.details["attempt"] = str(max(1, row["attempts"] + (row["state"] == "QUEUED")))
            run.stage = "checking"
            self.publisher.set_state(run, "IN_PROGRESS", stage="checking", progress=None)
            self._check(run)
            self.start_downloads(run)
        except AgentError as exc:
            self.fail(run, exc)
        except Exception as exc:  # noqa: BLE001 - the job ends with the reason, we carry on
            log.exception("job %s: unexpected error", run.job_id)
            self.fail(run, AgentError("internal_error", "{}: {}".format(
                type(exc).__name__, exc)))
        self.show_activity()

    def _plugins(self, wanted: List[Dict[str, str]]) -> List[Dict[str, str]]:
        """A job's plugin libraries: files of ``<models dir>/plugins/`` (nowhere else) whose
        content is the SHA-256 the signed job pins (``plugin_digest_mismatch`` otherwise)."""
        from agent.engines import plugins

        root = self.cfg.models_dir
        out = []
        for item in wanted:
            entry = plugins.check_library(os.path.join(root, "plugins", item["file"]), root)
            if entry["sha256"] != item["sha256"]:
                raise AgentError("plugin_digest_mismatch", "plugin library {}: expected sha256 "
                                 "{} (the job's), found {}".format(entry["path"], item["sha256"],
                                                                   entry["sha256"]))
            out.append(entry)
        return out

    def _check(self, run: Run) -> None:
        """Platform decision (before any download) and limits."""
        from agent import platform
        from agent.engines.backends.base import BUILDABLE

        doc = run.doc
        run.plan = job_semantics.plan_dict(doc)
        if run.plan.get("plugins"):
            run.plan["plugins"] = self._plugins(run.plan["plugins"])
        request = [run.plan["precision"]] + list(doc.get("fallback") or [])
        decision = platform.decide(request, self.platform, "reject", backend=self.backend,
                                   buildable=BUILDABLE)
        decision.raise_if_rejected()
        run.plan["precision"] = decision.plan_precision
        run.details["precision"] = str(decision.precision)
        run.details["backend"] = self.backend
        if decision.emulated:
            run.details["emulated"] = "true"
        if decision.status == "fell_back":
            run.fallback_reason = decision.reason
            run.details["fallback"] = decision.reason[:200]
            log.info("job %s: %s", run.job_id, decision.reason)
        run.backend = self.backend
        run.fingerprint = self.platform.fingerprint(self.backend)
        limit = self.cfg.limits.max_artifact_bytes
        for role, ref in sorted((doc.get("artifacts") or {}).items()):
            if ref["size"] > limit:
                raise AgentError("bad_argument", "artifact {} is {} bytes; this device accepts "
                                 "at most {} (limits.max_artifact_bytes)".format(
                                     role, ref["size"], limit))
            run.needed[role] = (ref["sha256"], ref["size"])
        if doc["kind"] == "deploy" and "model" in run.needed:
            self.check_model(doc, run.needed["model"][0])
        if self.backend_problem:  # found at start-up; the other checks said their piece first
            raise AgentError("backend_unavailable", self.backend_problem)
