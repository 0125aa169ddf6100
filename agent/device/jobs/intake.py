"""Message in -> validated -> queued: decode, validate and verify incoming job documents
(signature, sequence, topic, rate limit), drop duplicates (idempotency by job id), reject bad
ones, queue the rest in the journal (the QUEUED status goes out through the outbox); run cancel
jobs and cancel commands. Picking the next queued job is ``job_scheduler``'s."""

import logging
import math
import time
from typing import Any, Callable, Dict, Tuple

from agent.device.config import Config
from agent.device.daemon_state import DaemonState
from agent.device.jobs.end import JobEnding
from agent.device.jobs.run import Run
from agent.device.status_publisher import StatusPublisher
from agent.errors import AgentError
from agent.wire import protocol, signing
from agent.wire.device import job_semantics
from agent.wire.device.limits import TokenBucket
from agent.wire.model_names import validate_name, validate_version

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

REPUBLISH_EVERY_S = 10.0  # a known job's status, sent again for a document naming it
REJECTIONS_PER_MINUTE = 60  # REJECTED jobs recorded (a burst of 20), beyond: counted only
LOG_EVERY_S = 10.0
# Signed, but not for this device: the job id it names on this device's topic is not proven.
NOT_ADDRESSED = ("wrong_target",)
# Raised by signing.check_job after the signature and the target device verified.
SIGNED_FOR_THIS_DEVICE = ("job_not_yet_valid", "job_expired", "job_replayed")


class JobIntake:
    """Job documents and cancels. ``stop_worker(run)`` asks a running worker to stop."""

    def __init__(self, cfg: Config, device: str, journal: Any, shared: DaemonState,
                 publisher: StatusPublisher, stop_worker: Callable[[Run], None],
                 ending: JobEnding) -> None:
        self.cfg, self.device, self.journal = cfg, device, journal
        self.shared, self.publisher = shared, publisher
        self.stop_worker, self.ending = stop_worker, ending  # what a cancel needs
        self.trust = signing.TrustStore.from_entries(cfg.security.trusted_keys)
        self.job_bucket = TokenBucket(cfg.limits.jobs_per_minute / 60.0, cfg.limits.job_burst)
        # REJECTED jobs recorded per minute (60, bursts of 20), when a known job's status was
        # last sent again, rate-limited log lines (key -> (last, not logged)).
        self.reject_bucket = TokenBucket(1.0, 20)
        self.republished: Dict[str, float] = {}
        self.log_limits: Dict[str, Tuple[float, int]] = {}

    def on_job_doc(self, job_id: str, payload: bytes) -> None:
        if not payload:
            return  # the controller cleared a finished job's retained document
        existing = self.journal.job(job_id)
        if existing is not None:
            # A known id never runs again: whatever came, answer with its status (at most
            # every REPUBLISH_EVERY_S per job: a replay flood costs no disk write).
            self._answer_known(existing)
            return
        limit = min(protocol.MAX_BYTES["job"], self.cfg.limits.max_message_bytes)
        authenticated = self.cfg.security.allow_unsigned  # unsigned jobs are allowed: no proof
        try:
            doc = protocol.decode("job", payload, max_bytes=limit)
            try:
                accepted = signing.check_job(
                    doc, self.device, self.trust,
                    allow_unsigned=self.cfg.security.allow_unsigned,
                    last_seq=self.journal.last_sequence,
                    max_skew_s=self.cfg.security.max_clock_skew_s)
            except AgentError as exc:
                if exc.code in SIGNED_FOR_THIS_DEVICE:  # verified: refused for its time or seq
                    job_semantics.check_job_topic(doc, self.device, job_id)
                    authenticated = True
                raise
            job_semantics.check_job_topic(doc, self.device, job_id)
            authenticated = True  # a trusted key signed it for this device and job id
            if doc.get("model_name") is not None:  # path components: checked where they enter
                validate_name(doc["model_name"])
            if doc.get("model_version") is not None:
                validate_version(doc["model_version"])
            if not self.job_bucket.take():
                raise AgentError("rate_limited", "more than {:g} new jobs per minute (bursts of "
                                 "{}); retry in {:.0f} s under a new job id".format(
                                     self.cfg.limits.jobs_per_minute, self.cfg.limits.job_burst,
                                     math.ceil(self.job_bucket.retry_after())))
        except AgentError as exc:
            self._refuse(job_id, payload, exc, authenticated)
            return
        if not self.journal.add_job(doc, emit=self.publisher.emit):
            row = self.journal.job(job_id)
            log.info("job %s: duplicate document ignored (state %s)", job_id,
                     row["state"] if row else "?")
            return
        if accepted is not None:
            self.journal.record_sequence(accepted.key_id, accepted.seq)
        self.publisher.outbox_changed()
        self.shared.counters["jobs"] += 1
        log.info("job %s (%s) QUEUED", job_id, doc["kind"])
        if doc["kind"] == "cancel":
            self.run_cancel_job(doc)

    def _refuse(self, job_id: str, payload: bytes, exc: AgentError,
                authenticated: bool) -> None:
        """A document that will not run. Only one a trusted key signed for this device and
        this job id (or any, where unsigned jobs are allowed) becomes a REJECTED job, and at
        most REJECTIONS_PER_MINUTE of those: anything else never claims the job id (the
        genuine document may still come), costs no disk write, and is counted and logged
        (at most every LOG_EVERY_S)."""
        self.shared.counters["rejected_messages"] += 1
        if not authenticated or exc.code in NOT_ADDRESSED:
            self.shared.counters["unauthenticated_jobs"] += 1
            self._log_limited("unauthenticated", "job %s: ignored a document that proves "
                              "no trusted origin for this device and job id: %s", job_id, exc)
            return
        if not self.reject_bucket.take():
            self.shared.counters["rejections_dropped"] += 1
            self._log_limited("rejections", "job %s: not recorded (more than %d rejections a "
                              "minute): %s", job_id, REJECTIONS_PER_MINUTE, exc)
            return
        log.warning("job %s REJECTED: %s", job_id, exc)
        self.journal.add_job({"job_id": job_id, "kind": kind_of(payload)}, "REJECTED",
                             error=exc.to_dict(), emit=self.publisher.emit)
        self.publisher.outbox_changed()

    def _answer_known(self, row: Dict[str, Any]) -> None:
        now = time.monotonic()
        last = self.republished.get(row["job_id"])
        if last is not None and now - last < REPUBLISH_EVERY_S:
            return
        self.republished[row["job_id"]] = now
        if len(self.republished) > 1024:  # forget the oldest: the map stays small
            del self.republished[next(iter(self.republished))]
        log.info("job %s: document for a known job ignored (state %s)", row["job_id"],
                 row["state"])
        self.publisher.republish(row)

    def _log_limited(self, key: str, fmt: str, *args: Any) -> None:
        """Log at most once every LOG_EVERY_S per ``key``, saying how many were not logged."""
        now = time.monotonic()
        last, skipped = self.log_limits.get(key, (0.0, 0))
        if now - last < LOG_EVERY_S:
            self.log_limits[key] = (last, skipped + 1)
            return
        self.log_limits[key] = (now, 0)
        log.warning(fmt + ("" if not skipped else " (and {} more like it)".format(skipped)),
                    *args)

    def run_cancel_job(self, doc: Dict[str, Any]) -> None:
        job_id = doc["job_id"]
        target = doc["cancel"]["job_id"]
        try:
            if target == job_id:
                raise AgentError("bad_message", "cancel job {!r} names itself".format(job_id))
            state = self.cancel(target)
        except AgentError as exc:
            self.publisher.set_state(job_id, "REJECTED", error=exc.to_dict())
            return
        self.publisher.set_state(job_id, "IN_PROGRESS")
        self.publisher.set_state(job_id, "SUCCEEDED", result={"job_id": target, "state": state})

    def cancel(self, job_id: str) -> str:
        """Cancel a job; returns the state it ends in. AgentError unknown_job or
        bad_state_transition."""
        row = self.journal.job(job_id)
        if row is None:
            raise AgentError("unknown_job", "no job {!r} on device {}".format(job_id, self.device))
        if protocol.is_terminal(row["state"]):
            raise AgentError("bad_state_transition", "job {!r} has already ended {}".format(
                job_id, row["state"]))
        run = self.shared.run
        error = AgentError("cancelled", "cancelled by the controller").to_dict()
        if run is not None and run.job_id == job_id:
            if run.proc is not None:
                run.cancel_requested = True
                self.stop_worker(run)
                log.info("job %s: cancelling, stopping its worker", job_id)
                return "CANCELED"
            self.ending.end(run, "CANCELED", error=error)
            return "CANCELED"
        self.publisher.set_state(job_id, "CANCELED", error=error)
        log.info("job %s CANCELED while %s", job_id, row["state"])
        return "CANCELED"


def kind_of(payload: bytes) -> str:
    """The ``kind`` of a document that failed validation, when it has a plausible one
    (``protocol.peek_kind`` reads at most a job document's size limit)."""
    kind = protocol.peek_kind(payload)
    return kind if kind in protocol.JOB_KINDS else ""
