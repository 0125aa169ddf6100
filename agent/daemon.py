"""The on-device daemon: MQTT in, one worker subprocess at a time, job states out.

One thread does the work: it drains a queue fed by paho's network thread (``agent.mqtt``) and by
one reader thread per worker (the worker's JSON lines), and ticks twice a second (block
re-requests, timeouts, telemetry, the systemd watchdog). Nothing heavy is imported here: the
idle daemon stays small, and numpy/onnxruntime live in the worker.

A job goes QUEUED -> IN_PROGRESS (checking: platform decision; downloading: artifact blocks;
then the worker's stages) -> SUCCEEDED | FAILED | REJECTED | CANCELED | TIMED_OUT. Every state
change is written to the journal together with its status message (the outbox) and published
from there; an outbox entry is deleted only on the broker's PUBACK, so no status is lost on a
disconnect or a crash. On restart, unfinished jobs resume: downloads from their block bitmaps;
a job whose worker was running is run once more, and fails on the next interruption.
"""

import json
import logging
import math
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Dict, NamedTuple, Optional, Tuple

from agent import __version__, jobs, protocol, signing
from agent.artifacts import ArtifactStore
from agent.config import Config
from agent.errors import CODES, AgentError
from agent.fsio import atomic_write
from agent.journal import Journal
from agent.limits import TokenBucket
from agent.mqtt import (
    CONNECT_FAILED,
    CONNECTED,
    DISCONNECTED,
    MESSAGE,
    PUBLISHED,
    SUBSCRIBED,
    Event,
    MqttClient,
    TlsOptions,
    Will,
)
from agent.sdnotify import Notifier
from agent.transfer import BlockFetcher

log = logging.getLogger("agent.daemon")

JOURNAL_FILE = "journal.sqlite3"
TICK_S = 0.5
KILL_GRACE_S = 5.0  # SIGTERM to SIGKILL for a worker being stopped
PROGRESS_EVERY_S = 1.0  # at most one progress status per second (stage changes go at once)
READY_WITHOUT_BROKER_S = 20.0  # tell systemd we run even if the broker is down at boot
MAX_ATTEMPTS = 2  # a job interrupted in its worker by an agent restart runs once more
OUTBOX_BATCH = 200
MAX_PUBLISH_REFUSALS = 3
STDERR_TAIL = 2000
MAX_RESULT_BYTES = 48 * 1024  # job status <= 64 KiB (protocol.MAX_BYTES) with room to spare
WORKER_STAGES = ("calibrating", "building", "verifying", "searching", "benchmarking",
                 "activating")
# Worker errors that mean "this job can never work here" (AWS IoT: REJECTED, not retryable).
REJECT_CODES = frozenset(("bad_argument", "bad_model", "unsupported_model", "dynamic_shape",
                          "unknown_layer", "bad_calibration_data", "empty_calibration_data",
                          "golden_mismatch", "bad_golden_file", "unsupported_precision",
                          "backend_unavailable", "unknown_job_kind", "bad_message"))
AGENT_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER_PACKAGES = ("agent", "calib")  # what the worker imports from this installation


def journal_path(state_dir: str) -> str:
    return os.path.join(state_dir, JOURNAL_FILE)


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


def _tail(path: str, limit: int = STDERR_TAIL) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


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

    @property
    def downloading(self) -> bool:
        return self.proc is None and len(self.paths) < len(self.needed)


class Daemon:
    def __init__(self, cfg: Config, notifier: Optional[Notifier] = None) -> None:
        self.cfg = cfg
        self.device: str = cfg.device_id or ""
        self.state_dir: str = cfg.state_dir or ""
        self.notifier = notifier or Notifier()
        self.topics = protocol.Topics(cfg.topic_prefix)
        self.events: "queue.Queue[Any]" = queue.Queue(4000)
        self.stop_requested = False
        self.run_: Optional[Run] = None
        self.inflight: Dict[int, Any] = {}
        self.refusals: Dict[int, int] = {}
        self.outbox_dirty = True
        self.ready = False
        self.counters = {"messages": 0, "rejected_messages": 0, "jobs": 0, "blocks": 0}
        self.started = time.monotonic()
        self.token = 0
        self.telemetry: Any = None
        self.last_telemetry: Dict[str, Any] = {}
        self.next_telemetry = 0.0
        self.last_watchdog = 0.0
        self.last_outbox_scan = 0.0
        self.last_connect_log = 0.0
        self.status_text = ""

    # ------------------------------------------------------------------------- set-up

    def setup(self) -> None:
        os.makedirs(self.state_dir, exist_ok=True)
        self.journal = Journal(journal_path(self.state_dir))
        self.boot = self.journal.next_boot()
        self.journal.prune()
        self.store = ArtifactStore(self.state_dir, self.journal,
                                   max_bytes=self.cfg.limits.max_store_bytes)
        from agent import platform

        self.platform = platform.detect(self.cfg.platform_root)
        self.backend = (self.platform.backend if self.cfg.backend == "auto"
                        else self.cfg.backend)
        t = self.cfg.transfer
        self.fetcher = BlockFetcher(self.store, self._publish_request, self.topics, self.device,
                                    block_size=t.block_size, window=t.window,
                                    timeout_s=t.timeout_s, max_timeout_s=max(60.0, t.timeout_s))
        b = self.cfg.broker
        tls = None
        if b.tls.enabled:
            tls = TlsOptions(b.tls.ca_file, b.tls.cert_file, b.tls.key_file, b.tls.insecure)
        will = Will(self.topics.status(self.device),
                    protocol.encode(protocol.will_message(self.device, self.boot)))
        self.mqtt = MqttClient(
            self.device, b.host, b.port, protocol=b.protocol, keepalive=b.keepalive,
            username=b.username, password=b.password, tls=tls, will=will,
            session_expiry=b.session_expiry,
            max_packet_bytes=max(self.cfg.limits.max_message_bytes, t.block_size + 4096),
            reconnect_min=b.reconnect_min, reconnect_max=b.reconnect_max, events=self.events)
        for topic, qos in self.topics.device_subscriptions(self.device):
            self.mqtt.subscribe(topic, qos)
        self._clean_work_dirs()
        self._open_telemetry()
        sec = self.cfg.security
        self.trust = signing.TrustStore.from_entries(sec.trusted_keys)
        self.job_bucket = TokenBucket(self.cfg.limits.jobs_per_minute / 60.0,
                                      self.cfg.limits.job_burst)
        log.info("jetson-agent %s: device %s, boot %d, backend %s, platform %s, state %s",
                 __version__, self.device, self.boot, self.backend, self.platform.describe(),
                 self.state_dir)
        for problem in signing.posture(self.cfg)["problems"]:
            log.warning("security: %s (%s)", problem["problem"], problem["fix"])

    def _open_telemetry(self) -> None:
        try:
            from agent.telemetry import open_source

            self.telemetry = open_source(self.cfg.platform_root)
        except Exception as exc:  # noqa: BLE001 - telemetry is optional, jobs are not
            log.warning("telemetry disabled: %s", exc)
            self.telemetry = None

    def _clean_work_dirs(self) -> None:
        work = os.path.join(self.state_dir, "work")
        if not os.path.isdir(work):
            return
        keep = {j["job_id"] for j in self.journal.unfinished_jobs()}
        for name in os.listdir(work):
            if name not in keep:
                shutil.rmtree(os.path.join(work, name), ignore_errors=True)

    # ------------------------------------------------------------------------- main loop

    def request_stop(self, *_: Any) -> None:
        self.stop_requested = True

    def run(self) -> int:
        self.setup()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        self.mqtt.start()
        self._notify_status("connecting to {}".format(self.mqtt.address))
        try:
            while not self.stop_requested:
                self._drain(TICK_S)
                self._tick()
        finally:
            self.shutdown()
        return 0

    def _drain(self, timeout: float) -> None:
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        handled = 0
        while True:
            self._handle(event)
            handled += 1
            if handled >= 500 or self.stop_requested:
                break
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
        self._flush_outbox()

    def _handle(self, event: Any) -> None:
        """Any exception here is logged and the daemon carries on (bad input never kills it)."""
        try:
            if isinstance(event, WorkerEvent):
                self._on_worker_event(event)
            elif isinstance(event, Event):
                self._on_mqtt_event(event)
        except AgentError as exc:
            log.warning("%s", exc)
        except Exception:  # noqa: BLE001 - last line of defence, logged with a traceback
            log.exception("unexpected error handling %r", event)

    def _tick(self) -> None:
        now = time.monotonic()
        for step in (self._schedule, self._check_run, self._fetcher_tick, self._telemetry_tick,
                     self._flush_outbox):
            try:
                step()
            except Exception:  # noqa: BLE001
                log.exception("error in %s", step.__name__)
        if not self.ready and now - self.started > READY_WITHOUT_BROKER_S:
            self.ready = True
            self.notifier.ready("broker {} unreachable ({}); retrying".format(
                self.mqtt.address, self.mqtt.last_error or "no answer"))
        interval = self.notifier.watchdog_interval
        if interval is not None and now - self.last_watchdog >= min(1.0, interval / 2):
            self.notifier.watchdog()
            self.last_watchdog = now

    def _fetcher_tick(self) -> None:
        if self.mqtt.connected:
            self.fetcher.tick()

    def _notify_status(self, text: str) -> None:
        if text != self.status_text:
            self.status_text = text
            self.notifier.status(text)

    # ------------------------------------------------------------------------- MQTT events

    def _on_mqtt_event(self, ev: Event) -> None:
        if ev.kind == MESSAGE:
            self.counters["messages"] += 1
            self._on_message(ev)
        elif ev.kind == PUBLISHED:
            self._on_published(ev)
        elif ev.kind == CONNECTED:
            log.info("connected to %s (session %s)", self.mqtt.address,
                     "resumed" if ev.session_present else "new")
            self._publish_birth()
            self.fetcher.on_reconnect()
            self.outbox_dirty = True
        elif ev.kind == SUBSCRIBED:
            text = "connected to {}; {}".format(self.mqtt.address, self._activity())
            if not self.ready:
                self.ready = True
                self.notifier.ready(text)
                self.status_text = text
            else:
                self._notify_status(text)
        elif ev.kind == DISCONNECTED:
            log.warning("disconnected from %s: %s", self.mqtt.address, ev.reason)
            self._notify_status("disconnected from {}: {}; reconnecting".format(
                self.mqtt.address, ev.reason))
        elif ev.kind == CONNECT_FAILED:
            now = time.monotonic()
            if now - self.last_connect_log > 30:
                self.last_connect_log = now
                log.warning("broker_unreachable: %s: %s (retrying)", self.mqtt.address,
                            ev.reason)
            self._notify_status("broker {} unreachable: {}; retrying".format(
                self.mqtt.address, ev.reason))

    def _activity(self) -> str:
        run = self.run_
        if run is None:
            return "idle"
        return "job {} {}".format(run.job_id, run.stage or "starting")

    def _on_message(self, ev: Event) -> None:
        try:
            info = self.topics.parse(ev.topic)
        except AgentError as exc:
            log.debug("dropped message on %s: %s", ev.topic, exc)
            return
        if info.device != self.device:
            return
        if info.kind == "job":
            self._on_job_doc(str(info.job_id), ev.payload)
        elif info.kind == "block":
            self._on_block(ev.topic, ev.payload)
        elif info.kind == "command":
            self._on_command(ev)

    def _publish_request(self, topic: str, payload: bytes, qos: int = 1,
                         retain: bool = False) -> None:
        self.mqtt.publish(topic, payload, qos=qos, retain=retain)

    def _status_platform(self) -> Dict[str, Any]:
        p = self.platform
        return {"board": p.board, "jetpack": p.jetpack, "tensorrt": p.tensorrt,
                "backend": self.backend, "precisions": p.supported_precisions, "kind": p.kind,
                "l4t": p.l4t, "soc": p.soc}

    def _birth(self) -> Dict[str, Any]:
        return protocol.status_message(
            self.device, True, self.boot, agent_version=__version__,
            platform=self._status_platform(),
            active_engines=list(self.journal.active_engines()),  # type: ignore[arg-type]
            ts=time.time())

    def _publish_birth(self) -> None:
        self.mqtt.publish(self.topics.status(self.device), protocol.encode(self._birth()),
                          qos=1, retain=True)

    # ------------------------------------------------------------------------- outbox

    def _emit(self, row: Dict[str, Any]) -> protocol.Publication:
        return protocol.job_status_publication(self.topics, self.device, row)

    def _set_state(self, run_or_id: Any, state: str, **kwargs: Any) -> None:
        job_id = run_or_id.job_id if isinstance(run_or_id, Run) else run_or_id
        if isinstance(run_or_id, Run) and "details" not in kwargs:
            kwargs["details"] = run_or_id.details
        self.journal.set_state(job_id, state, emit=self._emit, **kwargs)
        self.outbox_dirty = True

    def _republish(self, row: Dict[str, Any]) -> None:
        pub = self._emit(row)
        self.journal.outbox_put(pub.topic, pub.payload, pub.qos, pub.retain, coalesce=True)
        self.outbox_dirty = True

    def _flush_outbox(self) -> None:
        now = time.monotonic()
        if not self.mqtt.connected:
            return
        if not self.outbox_dirty and now - self.last_outbox_scan < 5.0:
            return
        self.outbox_dirty = False
        self.last_outbox_scan = now
        for item in self.journal.outbox_pending(limit=OUTBOX_BATCH + len(self.inflight)):
            if item.seq in self.inflight:
                continue
            if len(self.inflight) >= OUTBOX_BATCH:
                self.outbox_dirty = True
                break
            self.inflight[item.seq] = self.mqtt.publish(item.topic, item.payload, qos=item.qos,
                                                        retain=item.retain,
                                                        token=("outbox", item.seq))

    def _on_published(self, ev: Event) -> None:
        token = ev.token
        if not (isinstance(token, tuple) and token[0] == "outbox"):
            return
        seq = int(token[1])
        self.inflight.pop(seq, None)
        if ev.ok:
            self.journal.outbox_ack(seq)
            self.refusals.pop(seq, None)
            return
        count = self.refusals.get(seq, 0) + 1
        self.refusals[seq] = count
        if count >= MAX_PUBLISH_REFUSALS:
            log.error("broker refused outbox message %d %d times (%s); dropping it", seq, count,
                      ev.reason)
            self.journal.outbox_ack(seq)
            self.refusals.pop(seq, None)
        else:
            self.outbox_dirty = True

    # ------------------------------------------------------------------------- jobs in

    def _on_job_doc(self, job_id: str, payload: bytes) -> None:
        if not payload:
            return  # the controller cleared a finished job's retained document
        existing = self.journal.job(job_id)
        limit = min(protocol.MAX_BYTES["job"], self.cfg.limits.max_message_bytes)
        accepted = None
        try:
            doc = protocol.decode("job", payload, max_bytes=limit)
            if existing is None:  # a known id never runs again: no need to verify it
                accepted = signing.check_job(
                    doc, self.device, self.trust, allow_unsigned=self.cfg.security.allow_unsigned,
                    last_seq=self.journal.last_sequence,
                    max_skew_s=self.cfg.security.max_clock_skew_s)
            protocol.check_job_topic(doc, self.device, job_id)
            if existing is None and not self.job_bucket.take():
                raise AgentError("rate_limited", "more than {:g} new jobs per minute (bursts of "
                                 "{}); retry in {:.0f} s under a new job id".format(
                                     self.cfg.limits.jobs_per_minute, self.cfg.limits.job_burst,
                                     math.ceil(self.job_bucket.retry_after())))
        except AgentError as exc:
            self.counters["rejected_messages"] += 1
            if existing is not None:
                log.warning("job %s: ignored a bad document for a known job: %s", job_id, exc)
                self._republish(existing)
                return
            log.warning("job %s REJECTED: %s", job_id, exc)
            self.journal.add_job({"job_id": job_id, "kind": _kind_of(payload)}, "REJECTED",
                                 error=exc.to_dict(), emit=self._emit)
            self.outbox_dirty = True
            return
        if not self.journal.add_job(doc, emit=self._emit):
            row = existing or self.journal.job(job_id)
            log.info("job %s: duplicate document ignored (state %s)", job_id,
                     row["state"] if row else "?")
            if row is not None:
                self._republish(row)
            return
        if accepted is not None:
            self.journal.record_sequence(accepted.key_id, accepted.seq)
        self.outbox_dirty = True
        self.counters["jobs"] += 1
        log.info("job %s (%s) QUEUED", job_id, doc["kind"])
        if doc["kind"] == "cancel":
            self._run_cancel_job(doc)

    def _run_cancel_job(self, doc: Dict[str, Any]) -> None:
        job_id = doc["job_id"]
        target = doc["cancel"]["job_id"]
        try:
            if target == job_id:
                raise AgentError("bad_message", "cancel job {!r} names itself".format(job_id))
            state = self._cancel(target)
        except AgentError as exc:
            self._set_state(job_id, "REJECTED", error=exc.to_dict())
            return
        self._set_state(job_id, "IN_PROGRESS")
        self._set_state(job_id, "SUCCEEDED", result={"job_id": target, "state": state})

    def _cancel(self, job_id: str) -> str:
        """Cancel a job; returns the state it ends in. AgentError unknown_job or
        bad_state_transition."""
        row = self.journal.job(job_id)
        if row is None:
            raise AgentError("unknown_job", "no job {!r} on device {}".format(job_id, self.device))
        if protocol.is_terminal(row["state"]):
            raise AgentError("bad_state_transition", "job {!r} has already ended {}".format(
                job_id, row["state"]))
        run = self.run_
        error = AgentError("cancelled", "cancelled by the controller").to_dict()
        if run is not None and run.job_id == job_id:
            if run.proc is not None:
                run.cancel_requested = True
                self._stop_worker(run)
                log.info("job %s: cancelling, stopping its worker", job_id)
                return "CANCELED"
            self._end(run, "CANCELED", error=error)
            return "CANCELED"
        self._set_state(job_id, "CANCELED", error=error)
        log.info("job %s CANCELED while %s", job_id, row["state"])
        return "CANCELED"

    # ------------------------------------------------------------------------- scheduling

    def _schedule(self) -> None:
        if self.run_ is not None or self.stop_requested:
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
            self._set_state(row["job_id"], "FAILED", error=AgentError(
                "internal_error", "the agent restarted during the cancel").to_dict())
        else:
            self._run_cancel_job(row["doc"])

    def _timeout_for(self, doc: Dict[str, Any]) -> float:
        value = doc.get("timeout_s")
        return float(value) if isinstance(value, (int, float)) else self.cfg.limits.job_timeout_s

    def _begin(self, row: Dict[str, Any]) -> None:
        run = Run(row, self._timeout_for(row["doc"] or {}))
        self.run_ = run
        try:
            if row["state"] == "IN_PROGRESS" and run.details.get("worker") == "started":
                _kill_orphan(run.details.get("worker_pid"), run.job_id)
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
            self._set_state(run, "IN_PROGRESS", stage="checking", progress=None)
            self._check(run)
            self._start_downloads(run)
        except AgentError as exc:
            self._fail(run, exc)
        except Exception as exc:  # noqa: BLE001 - the job ends with the reason, we carry on
            log.exception("job %s: unexpected error", run.job_id)
            self._fail(run, AgentError("internal_error", "{}: {}".format(
                type(exc).__name__, exc)))
        self._notify_status("connected to {}; {}".format(self.mqtt.address, self._activity()))

    def _check(self, run: Run) -> None:
        """Platform decision (before any download) and limits."""
        from agent import platform

        doc = run.doc
        run.plan = protocol.plan_dict(doc)
        request = [run.plan["precision"]] + list(doc.get("fallback") or [])
        decision = platform.decide(request, self.platform, "reject", backend=self.backend)
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

    def _start_downloads(self, run: Run) -> None:
        for role, (sha, size) in sorted(run.needed.items()):
            path = self.fetcher.want(sha, size, run.job_id)
            if path is not None:
                run.paths[role] = path
        if run.downloading:
            run.stage = "downloading"
            self._report_download(run, force=True)
        else:
            self._launch(run)

    def _download_progress(self, run: Run) -> Tuple[int, int]:
        done = total = 0
        for role, (sha, size) in run.needed.items():
            got = None if role in run.paths else self.fetcher.progress(sha)
            if got is None:
                blocks = protocol.block_count(size, self.fetcher.block_size)
                got = (blocks, blocks) if role in run.paths else (0, blocks)
            done += got[0]
            total += got[1]
        return done, total

    def _report_download(self, run: Run, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - run.last_progress < PROGRESS_EVERY_S:
            return
        run.last_progress = now
        done, total = self._download_progress(run)
        self._set_state(run, "IN_PROGRESS", stage="downloading",
                        progress={"done": done, "of": total})

    def _on_block(self, topic: str, payload: bytes) -> None:
        self.counters["blocks"] += 1
        try:
            completed = self.fetcher.handle_block(topic, payload)
        except AgentError as exc:
            if exc.code == "hash_mismatch":
                self._on_bad_artifact(topic, exc)
            else:
                log.debug("dropped block %s: %s", topic, exc)
            return
        run = self.run_
        if run is None or run.proc is not None:
            return
        if completed is not None:
            sha, path = completed
            for role, (need_sha, _) in run.needed.items():
                if need_sha == sha:
                    run.paths[role] = path
            if not run.downloading:
                self._report_download(run, force=True)
                try:
                    self._launch(run)
                except AgentError as exc:
                    self._fail(run, exc)
                return
        if run.downloading:
            self._report_download(run)

    def _on_bad_artifact(self, topic: str, exc: AgentError) -> None:
        run = self.run_
        try:
            sha = self.topics.parse(topic).sha256
        except AgentError:
            sha = None
        log.error("%s", exc)
        if run is not None and run.proc is None and any(
                s == sha for s, _ in run.needed.values()):
            self._fail(run, exc)

    # ------------------------------------------------------------------------- the worker

    def _launch(self, run: Run) -> None:
        for sha, _ in run.needed.values():
            self.store.touch(sha)
        run.work_dir = os.path.join(self.state_dir, "work", run.job_id)
        os.makedirs(run.work_dir, exist_ok=True)
        spec = jobs.make_spec(
            run.job_id, run.kind, run.plan, run.paths, run.backend, run.work_dir,
            os.path.join(self.cfg.cache_dir, "engines"),
            os.path.join(self.cfg.cache_dir, "calibration"),
            run.fingerprint, self.cfg.cache.engine_budget_bytes, gate=run.doc.get("gate"),
            bench=run.doc.get("bench"), search=run.doc.get("search"),
            fallback_reason=run.fallback_reason)
        spec_path = os.path.join(run.work_dir, "job.json")
        atomic_write(spec_path, json.dumps(spec, sort_keys=True).encode("utf-8"))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [self._worker_path()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                     if p])
        env["JETSON_AGENT_STATE_DIR"] = self.state_dir
        env["PYTHONUNBUFFERED"] = "1"
        run.stderr_path = os.path.join(run.work_dir, "worker.log")
        self.token += 1
        run.token = self.token
        python = self.cfg.worker_python or sys.executable
        try:
            with open(run.stderr_path, "ab") as stderr:
                run.proc = subprocess.Popen(
                    [python, "-m", "agent.worker", "--job", spec_path, "--state-dir",
                     self.state_dir],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=env,
                    cwd=run.work_dir, start_new_session=True)
        except OSError as exc:
            raise AgentError("worker_crashed", "cannot start the worker with {} (worker_python):"
                             " {}".format(python, exc.strerror or exc))
        # Recorded with the stage change: a restarted agent knows the worker ran (and its pid).
        run.details["worker"] = "started"
        run.details["worker_pid"] = str(run.proc.pid)
        run.stage = "checking"  # the worker reads and checks the artifacts first
        self._set_state(run, "IN_PROGRESS", stage=run.stage, progress=None)
        threading.Thread(target=self._read_worker, args=(run.proc, run.token),
                         name="worker-reader", daemon=True).start()
        log.info("job %s: worker %d started (%s, %s)", run.job_id, run.proc.pid, run.kind,
                 run.plan.get("precision"))

    def _worker_path(self) -> str:
        """A directory holding only our packages (symlinks), for the worker's PYTHONPATH: the
        worker may be another interpreter (JetPack 4.6's Python 3.6), which must not pick up
        the daemon's site-packages (numpy built for another Python)."""
        path = os.path.join(self.state_dir, "pythonpath")
        os.makedirs(path, exist_ok=True)
        for package in WORKER_PACKAGES:
            src = os.path.join(AGENT_PARENT, package)
            link = os.path.join(path, package)
            if not os.path.isdir(src):
                continue
            if os.path.islink(link) and os.readlink(link) == src:
                continue
            tmp = link + ".tmp"
            if os.path.lexists(tmp):
                os.unlink(tmp)
            os.symlink(src, tmp)
            os.replace(tmp, link)
        return path

    def _read_worker(self, proc: "subprocess.Popen[bytes]", token: int) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.events.put(WorkerEvent("line", token, line))
        proc.stdout.close()
        self.events.put(WorkerEvent("exit", token, returncode=proc.wait()))

    def _on_worker_event(self, ev: WorkerEvent) -> None:
        run = self.run_
        if run is None or ev.token != run.token:
            return
        if ev.kind == "exit":
            self._on_worker_exit(run, ev.returncode)
            return
        try:
            msg = json.loads(ev.line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            log.warning("job %s: worker wrote a non-JSON line: %r", run.job_id, ev.line[:200])
            return
        if not isinstance(msg, dict):
            return
        kind = msg.get("type")
        if kind == "progress":
            self._on_worker_progress(run, msg)
        elif kind == "result" and isinstance(msg.get("result"), dict):
            run.result = msg["result"]
        elif kind == "error" and isinstance(msg.get("error"), dict):
            run.error = msg["error"]

    def _on_worker_progress(self, run: Run, msg: Dict[str, Any]) -> None:
        if run.cancel_requested or run.timed_out or run.stopping_for_shutdown:
            return
        stage = msg.get("stage")
        if stage not in protocol.STAGES:
            return
        done, of = msg.get("done"), msg.get("of")
        progress = ({"done": done, "of": of} if isinstance(done, int) and isinstance(of, int)
                    and done >= 0 and of >= 0 else None)
        now = time.monotonic()
        if stage == run.stage and now - run.last_progress < PROGRESS_EVERY_S and not (
                progress and progress["of"] and progress["done"] >= progress["of"]):
            return
        run.last_progress = now
        if stage != run.stage:
            run.stage = stage
            self._notify_status("connected to {}; {}".format(self.mqtt.address,
                                                            self._activity()))
        self._set_state(run, "IN_PROGRESS", stage=stage, progress=progress)

    def _on_worker_exit(self, run: Run, returncode: int) -> None:
        run.proc = None
        if run.stopping_for_shutdown:
            return  # the job stays IN_PROGRESS and runs again after the restart
        log.info("job %s: worker %s", run.job_id, describe_exit(returncode))
        if run.cancel_requested:
            details = {"partial_result": run.result} if run.result else None
            self._end(run, "CANCELED", error=AgentError(
                "cancelled", "cancelled by the controller", details).to_dict())
        elif run.timed_out:
            self._end(run, "TIMED_OUT", error=AgentError(
                "job_timed_out", "the job ran longer than its timeout of {:g} s".format(
                    run.timeout_s)).to_dict())
        elif returncode == 0 and run.result is not None:
            try:
                self._succeed(run, run.result)
            except Exception as exc:  # noqa: BLE001 - the job fails with the reason, we go on
                log.exception("job %s: cannot record its result", run.job_id)
                if self.run_ is run:
                    self._end(run, "FAILED", error=AgentError("internal_error", "{}: {}".format(
                        type(exc).__name__, exc)).to_dict())
        elif run.error is not None and returncode in (2, 3):
            code = run.error.get("code")
            if not isinstance(code, str) or code not in CODES:
                run.error = {"code": "internal_error", "message": str(run.error)[:500]}
                code = "internal_error"
            state = "REJECTED" if code in REJECT_CODES else "FAILED"
            self._end(run, state, error=run.error)
        else:
            tail = _tail(run.stderr_path)
            self._end(run, "FAILED", error=AgentError(
                "worker_crashed", "the worker {} while running the job".format(
                    describe_exit(returncode)),
                {"returncode": returncode, "stderr_tail": tail}).to_dict())

    def _succeed(self, run: Run, result: Dict[str, Any]) -> None:
        result = dict(result)
        activate = result.pop("activate", False)
        engine_path = result.pop("engine", None)
        if activate and result.get("engine_key"):
            run.stage = "activating"
            self._set_state(run, "IN_PROGRESS", stage="activating", progress=None)
            model_sha = run.needed["model"][0]
            previous = self.journal.activate(
                model_sha, result["engine_key"], result.get("precision"), run.job_id,
                info={"engine": engine_path, "backend": run.backend,
                      "accuracy_passed": (result.get("accuracy") or {}).get("passed"),
                      "throughput_qps": result.get("throughput_qps")})
            result["activated"] = True
            result["previous_engine"] = previous["engine_key"] if previous else None
        self._end(run, "SUCCEEDED", result=fit_result(result))
        if activate:
            self._publish_birth()  # the retained status lists the active engines

    # ------------------------------------------------------------------------- ending

    def _fail(self, run: Run, exc: AgentError) -> None:
        state = "REJECTED" if exc.code in REJECT_CODES else "FAILED"
        if exc.code == "cancelled":
            state = "CANCELED"
        self._end(run, state, error=exc.to_dict())

    def _end(self, run: Run, state: str, error: Optional[Dict[str, Any]] = None,
             result: Optional[Dict[str, Any]] = None) -> None:
        for sha, _ in run.needed.values():
            if run.downloading:
                self.fetcher.cancel(sha)
        run.details.pop("worker", None)
        run.details.pop("worker_pid", None)
        if error is not None:
            run.details["error_code"] = str(error.get("code"))
            if isinstance(error.get("details"), dict):
                error = dict(error, details=fit_result(error["details"]))
        try:
            self._set_state(run, state, error=error, result=result)
            log.log(logging.INFO if state == "SUCCEEDED" else logging.WARNING, "job %s %s%s",
                    run.job_id, state, "" if error is None else " [{}]: {}".format(
                        error.get("code"), error.get("message")))
        finally:  # whatever happens, the daemon moves on to the next job
            if run.work_dir:
                shutil.rmtree(run.work_dir, ignore_errors=True)
            if self.run_ is run:
                self.run_ = None
        self._notify_status("connected to {}; {}".format(self.mqtt.address, self._activity()))

    def _stop_worker(self, run: Run) -> None:
        proc = run.proc
        if proc is None or run.kill_at is not None:
            return
        run.kill_at = time.monotonic() + KILL_GRACE_S
        _signal_group(proc, signal.SIGTERM)

    def _check_run(self) -> None:
        run = self.run_
        if run is None:
            return
        now = time.monotonic()
        if not run.timed_out and not run.cancel_requested and now > run.deadline:
            run.timed_out = True
            log.warning("job %s: timed out after %g s", run.job_id, run.timeout_s)
            if run.proc is not None:
                self._stop_worker(run)
            else:
                self._end(run, "TIMED_OUT", error=AgentError(
                    "job_timed_out", "the job did not finish within its timeout of {:g} s "
                    "(stage {})".format(run.timeout_s, run.stage)).to_dict())
                return
        if run.proc is not None and run.kill_at is not None and now > run.kill_at:
            log.warning("job %s: worker ignored SIGTERM for %g s; killing it", run.job_id,
                        KILL_GRACE_S)
            _signal_group(run.proc, signal.SIGKILL)
            run.kill_at = now + 3600  # one SIGKILL is enough

    # ------------------------------------------------------------------------- commands

    def _on_command(self, ev: Event) -> None:
        limit = min(protocol.MAX_BYTES["command"], self.cfg.limits.max_message_bytes)
        try:
            cmd = protocol.decode("command", ev.payload, max_bytes=limit)
        except AgentError as exc:
            self.counters["rejected_messages"] += 1
            log.warning("bad command: %s", exc)
            self._reply(ev, {}, False, error=exc.to_dict())
            return
        try:
            if cmd["command"] == "cancel":
                state = self._cancel(cmd["job_id"])
                result: Dict[str, Any] = {"job_id": cmd["job_id"], "state": state}
            else:
                result = self.diag()
        except AgentError as exc:
            self._reply(ev, cmd, False, error=exc.to_dict())
            return
        self._reply(ev, cmd, True, result=result)

    def _reply(self, ev: Event, cmd: Dict[str, Any], ok: bool,
               result: Optional[Dict[str, Any]] = None,
               error: Optional[Dict[str, Any]] = None) -> None:
        try:
            topic = protocol.reply_topic(self.topics, self.device, cmd, ev.response_topic)
        except AgentError as exc:
            log.warning("command reply goes to the default topic: %s", exc)
            topic = self.topics.command_reply(self.device)
        msg = protocol.command_reply(self.device, cmd, ok, result=result, error=error)
        self.mqtt.publish(topic, protocol.encode(msg), qos=1, correlation=ev.correlation)

    def diag(self) -> Dict[str, Any]:
        counts: Dict[str, int] = {}
        for row in self.journal.jobs():
            counts[row["state"]] = counts.get(row["state"], 0) + 1
        return {
            "agent_version": __version__,
            "boot": self.boot,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "rss_mb": _rss_mb(),
            "platform": self._status_platform(),
            "problems": [dict(p) for p in self.platform.problems],
            "jobs": counts,
            "current_job": self.run_.job_id if self.run_ else None,
            "outbox": self.journal.outbox_count(),
            "transfers": [{"sha256": t["sha256"], "size": t["size"]}
                          for t in self.journal.transfers()],
            "active_engines": self.journal.active_engines(),
            "telemetry": self.last_telemetry,
            "counters": dict(self.counters),
            "security": signing.posture(self.cfg),
        }

    # ------------------------------------------------------------------------- telemetry

    def _telemetry_tick(self) -> None:
        now = time.monotonic()
        if self.telemetry is None or now < self.next_telemetry:
            return
        self.next_telemetry = now + self.cfg.telemetry_interval
        sample = dict(self.telemetry.sample())
        source = sample.pop("source", getattr(self.telemetry, "kind", "host"))
        self.last_telemetry = sample
        if not self.mqtt.connected:
            return
        msg = {"protocol": protocol.PROTOCOL_VERSION, "device": self.device, "boot": self.boot,
               "ts": time.time(), "source": source, "metrics": sample}
        self.mqtt.publish(self.topics.telemetry(self.device), protocol.encode(msg), qos=0)

    # ------------------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        self.notifier.stopping("stopping")
        log.info("stopping")
        run = self.run_
        if run is not None and run.proc is not None:
            run.stopping_for_shutdown = True
            proc = run.proc
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(5)
        fetcher = getattr(self, "fetcher", None)
        if fetcher is not None:
            fetcher.close()
        mqtt = getattr(self, "mqtt", None)
        if mqtt is not None:
            if mqtt.connected:
                self._flush_outbox()
                offline = protocol.status_message(self.device, False, self.boot,
                                                  agent_version=__version__, reason="shutdown",
                                                  ts=time.time())
                handle = mqtt.publish(self.topics.status(self.device), protocol.encode(offline),
                                      qos=1, retain=True)
                deadline = time.monotonic() + 3.0
                while time.monotonic() < deadline and (self.inflight or not handle.acked):
                    try:
                        ev = self.events.get(timeout=0.1)
                    except queue.Empty:
                        continue
                    if isinstance(ev, Event) and ev.kind == PUBLISHED:
                        self._handle(ev)
            mqtt.stop()
        if self.telemetry is not None:
            try:
                self.telemetry.close()
            except Exception:  # noqa: BLE001
                pass
        journal = getattr(self, "journal", None)
        if journal is not None:
            journal.close()
        self.notifier.close()


def fit_result(result: Dict[str, Any], limit: int = MAX_RESULT_BYTES) -> Dict[str, Any]:
    """Drop the largest entries of a result until its JSON fits ``limit`` bytes; the names of
    the dropped entries are listed under ``truncated`` (the worker's log has everything)."""
    result = dict(result)
    dropped = []
    while len(protocol.encode(result)) > limit and result:
        sizes = {k: len(protocol.encode({k: v})) for k, v in result.items() if k != "truncated"}
        if not sizes:
            break
        biggest = max(sizes, key=lambda k: sizes[k])
        del result[biggest]
        dropped.append(biggest)
        result["truncated"] = sorted(dropped)
    return result


def _kind_of(payload: bytes) -> str:
    """The ``kind`` of a document that failed validation, when it has a plausible one."""
    try:
        doc = json.loads(payload.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return ""
    kind = doc.get("kind") if isinstance(doc, dict) else None
    return kind if isinstance(kind, str) and kind in protocol.JOB_KINDS else ""


def _signal_group(proc: "subprocess.Popen[bytes]", sig: int) -> None:
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


def _kill_orphan(pid_text: Optional[str], job_id: str) -> None:
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


def _rss_mb() -> Optional[float]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024.0, 1)
    except OSError:
        pass
    return None


def run_daemon(cfg: Config) -> int:
    return Daemon(cfg).run()

