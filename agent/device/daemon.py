"""The on-device daemon: MQTT in, one worker subprocess at a time, job states out.

One thread does the work: it drains a queue fed by paho's network thread (``agent.wire.mqtt``) and
by one reader thread per worker (the worker's JSON lines), and ticks twice a second (block
re-requests, timeouts, telemetry, the systemd watchdog). Nothing heavy is imported here: the
idle daemon stays small, and numpy/onnxruntime live in the worker.

A job goes QUEUED -> IN_PROGRESS (checking: platform decision; downloading: artifact blocks;
then the worker's stages) -> SUCCEEDED | FAILED | REJECTED | CANCELED | TIMED_OUT. Every state
change is written to the journal together with its status message (the outbox) and published
from there; an outbox entry is deleted only on the broker's PUBACK, so no status is lost on a
disconnect or a crash. On restart, unfinished jobs resume: downloads from their block bitmaps;
a job whose worker was running is run once more, and fails on the next interruption.

The work is split into layers, one module each, stacked by inheritance (each calls only itself
and the layers below): ``daemon_state`` (what the daemon knows), ``status_publisher`` (outbox,
birth status, telemetry), ``worker_supervisor`` (the worker subprocess, how a job ends),
``artifact_downloads`` (artifact blocks), ``job_intake`` (job documents in, cancels, scheduling)
and ``device_commands`` (cancel, diag). This module is the top: the main loop, MQTT events,
signals, sd_notify, start/stop.
"""

import logging
import os
import queue
import shutil
import signal
import subprocess
import threading
import time
from typing import Any

from agent import __version__
from agent.device import backend_check, state_lock
from agent.device.config import Config
from agent.device.device_commands import DeviceCommands
from agent.device.job_run import Run
from agent.device.journal import Journal
from agent.device.status_publisher import fit_result
from agent.device.worker_supervisor import (
    KILL_GRACE_S,
    WorkerEvent,
    describe_exit,
    signal_group,
)
from agent.errors import AgentError
from agent.wire import protocol, security_posture, signing, status_messages
from agent.wire.artifacts import ArtifactStore
from agent.wire.limits import TokenBucket
from agent.wire.mqtt import (
    CONNECT_FAILED,
    CONNECTED,
    DISCONNECTED,
    MESSAGE,
    PUBLISHED,
    SUBSCRIBED,
    MqttClient,
)
from agent.wire.mqtt_types import Event, TlsOptions, Will
from agent.wire.transfer import BlockFetcher

# Names callers import from here (agent.cli, tests).
__all__ = ["Daemon", "run_daemon", "journal_path", "describe_exit", "fit_result", "Run",
           "WorkerEvent", "JOURNAL_FILE"]

log = logging.getLogger("agent.device.daemon")

JOURNAL_FILE = "journal.sqlite3"
TICK_S = 0.5
READY_WITHOUT_BROKER_S = 20.0  # tell systemd we run even if the broker is down at boot


def journal_path(state_dir: str) -> str:
    return os.path.join(state_dir, JOURNAL_FILE)


class Daemon(DeviceCommands):
    """The daemon: main loop, signals, sd_notify, start/stop (the layers below do the work)."""

    # ------------------------------------------------------------------------- set-up

    def setup(self) -> None:
        # One daemon per state directory (agent/device/state_lock.py); the error names the other
        # PID.
        self.state_lock = state_lock.acquire(self.state_dir, self.device)
        self.journal = Journal(journal_path(self.state_dir))
        self.boot = self.journal.next_boot()
        self.journal.prune()
        self.store = ArtifactStore(self.state_dir, self.journal,
                                   max_bytes=self.cfg.limits.max_store_bytes)
        self._reclaim_partials("start-up")
        from agent import platform

        self.platform = platform.detect(self.cfg.platform_root)
        # Can the worker's Python import it? Warned once; the birth message says so.
        self.backend, self.backend_problem = backend_check.choose(
            self.cfg.backend, self.platform.backend, self.cfg.worker_python)
        if self.backend_problem:
            log.warning("%s", self.backend_problem)
        t = self.cfg.transfer
        self.fetcher = BlockFetcher(self.store, self._publish_request, self.topics, self.device,
                                    block_size=t.block_size, window=t.window,
                                    timeout_s=t.timeout_s, max_timeout_s=max(60.0, t.timeout_s))
        b = self.cfg.broker
        tls = None
        if b.tls.enabled:
            tls = TlsOptions(b.tls.ca_file, b.tls.cert_file, b.tls.key_file, b.tls.insecure)
        will = Will(self.topics.status(self.device),
                    protocol.encode(status_messages.will_message(self.device, self.boot,
                                                                 self._status_platform())))
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
        for problem in security_posture.posture(self.cfg)["problems"]:
            log.warning("security: %s (%s)", problem["problem"], problem["fix"])

    def _open_telemetry(self) -> None:
        try:
            from agent.device.telemetry import open_source

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
        # The fetcher's tick flushes every transfer (fsync + journal commit) and re-asks timed
        # out blocks: about once per TICK_S, not after every burst of blocks the loop drains.
        now = time.monotonic()
        if self.mqtt.connected and now - self.last_fetcher_tick >= TICK_S:
            self.last_fetcher_tick = now
            self.fetcher.tick()

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
            self._connection_lost(ev)
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

    def _on_message(self, ev: Event) -> None:
        try:
            info = self.topics.parse(ev.topic)
        except AgentError as exc:
            log.debug("dropped message on %s: %s", ev.topic, exc)
            return
        if info.device != self.device and not (info.kind == "block" and not info.device):
            return  # another device's topic (a shared fan-out block has no device)
        if info.kind == "job":
            self._on_job_doc(str(info.job_id), ev.payload)
        elif info.kind == "block":
            self._on_block(ev.topic, ev.payload)
        elif info.kind == "command":
            self._on_command(ev)

    # ------------------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        self.notifier.stopping("stopping")
        log.info("stopping")
        run = self.run_
        if run is not None and run.proc is not None:
            run.stopping_for_shutdown = True
            proc = run.proc
            signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                signal_group(proc, signal.SIGKILL)
                proc.wait(5)
        fetcher = getattr(self, "fetcher", None)
        if fetcher is not None:
            fetcher.close()
        mqtt = getattr(self, "mqtt", None)
        if mqtt is not None:
            if mqtt.connected:
                self._flush_outbox()
                offline = status_messages.status_message(self.device, False, self.boot,
                                                         agent_version=__version__,
                                                         reason="shutdown", ts=time.time(),
                                                         platform=self._status_platform())
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
        if getattr(self, "state_lock", None) is not None:
            self.state_lock.close()
        self.notifier.close()


def run_daemon(cfg: Config) -> int:
    return Daemon(cfg).run()
