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

The daemon is a few parts, each handed what it uses in its constructor, none inheriting from
another, wired in one place (``assemble``). A job passes through them in this order:

    MQTT message in          ``Daemon._on_message`` routes it by topic
    validated, queued        ``job_intake.JobIntake``  (the journal is the queue)
    checked                  ``job_scheduler.JobScheduler``  (platform decision, limits)
    downloaded               ``artifact_downloads.ArtifactDownloads``  (agent.wire.device.transfer)
    worker                   ``worker_supervisor.WorkerSupervisor``  (the subprocess)
    activated, committed     ``model_switch.ModelSwitch``  (a deployed engine becomes a version of
                             its name in the models directory, handed to the app, committed or
                             rolled back; its parts ``switch_*``, the table ``switch_states``)
    ended                    ``job_end.JobEnding``  (any stage, any outcome)
    status out               ``status_publisher.StatusPublisher``  (the outbox, PUBACK-acked)

beside them ``device_commands.DeviceCommands`` (cancel, diag, rollback),
``telemetry_publisher.TelemetryPublisher`` and the app socket (``app_requests``: the app's health
reports and commits, answered on the main loop); ``daemon_state`` holds the little they share (the
job in hand, counters, the stop flag, the systemd status line). A part reaches the next one
through a callable it was given (``launch``, ``fail``, ``start_downloads``...), never through
the daemon. ``Daemon`` is the main loop: events routed to the part they are for, ticks,
sd_notify, signals, start and stop.
"""

import functools
import logging
import os
import queue
import signal
import threading
import time
from typing import Any, NamedTuple, Optional

from agent import __version__
from agent.device import backend_check, handoff, state_lock, writable_paths
from agent.device.app import requests as app_requests
from agent.device.artifact_downloads import ArtifactDownloads, reclaim_partials
from agent.device.config import Config, http_ca_file
from agent.device.daemon_state import DaemonState, ServiceStatus
from agent.device.device_commands import DeviceCommands
from agent.device.jobs.end import JobEnding
from agent.device.jobs.intake import JobIntake
from agent.device.jobs.scheduler import JobScheduler
from agent.device.journal.store import Journal
from agent.device.models.directory import ModelsDir
from agent.device.models.switch import ModelSwitch, SwitchEvent
from agent.device.sdnotify import Notifier
from agent.device.status_publisher import StatusPublisher, status_platform
from agent.device.telemetry_publisher import TelemetryPublisher, open_telemetry
from agent.device.worker_process import WorkerEvent
from agent.device.worker_supervisor import WorkerSupervisor, clean_work_dirs
from agent.errors import AgentError
from agent.wire import device_identity, protocol, status_messages
from agent.wire.device import security_posture
from agent.wire.device.artifacts import ArtifactStore
from agent.wire.device.limits import BlockingByteQueue
from agent.wire.device.transfer import MAX_BACKOFF_S, BlockFetcher
from agent.wire.device_identity import (
    DeviceKey,
    ReportSigner,
    create_device_key,
    default_key_path,
    load_device_key,
)
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
from agent.wire.topics import Topics

log = logging.getLogger("agent.device.daemon")

JOURNAL_FILE = "journal.sqlite3"
TICK_S = 0.5
READY_WITHOUT_BROKER_S = 20.0  # tell systemd we run even if the broker is down at boot


def journal_path(state_dir: str) -> str:
    return os.path.join(state_dir, JOURNAL_FILE)


def device_key_path(cfg: Config) -> str:
    return cfg.security.device_key or default_key_path(cfg.source)


def device_key(cfg: Config) -> Optional[DeviceKey]:
    """This device's key (docs/security.md, "Device identity"). A configured key that cannot
    be read stops the daemon (device_key_unreadable); ``security.create_device_key`` makes a
    missing one. Without a configured key and none at the default place the daemon reports
    unsigned, as the previous release did (a controller admits it only as a legacy device)."""
    path = device_key_path(cfg)
    if os.path.exists(path) or (cfg.security.device_key and not cfg.security.create_device_key):
        return load_device_key(path)
    if cfg.security.create_device_key:
        key = create_device_key(path)
        log.warning("security: made a new device key %s (key id %s); its public key is %s.pub",
                    path, key.key_id, path)
        return key
    log.warning("security: no device key at %s: this device's reports are unsigned and a "
                "controller admits it only as a legacy device (make one with 'jetson-agent "
                "keygen --device %s', docs/security.md)", path, path)
    return None


class Parts(NamedTuple):
    """What ``assemble`` opened and wired: the main loop routes events and ticks to these."""

    topics: Topics
    lock: Any  # the state directory's lock (agent.device.state_lock)
    journal: Journal
    mqtt: MqttClient
    fetcher: BlockFetcher
    intake: JobIntake
    scheduler: JobScheduler
    downloads: ArtifactDownloads
    supervisor: WorkerSupervisor
    publisher: StatusPublisher
    commands: DeviceCommands
    telemetry: TelemetryPublisher
    switch: ModelSwitch
    app_socket: Any  # agent.device.app.server.AppSocket, or None


def assemble(cfg: Config, events: "queue.Queue[Any]", shared: DaemonState,
             status: ServiceStatus) -> Parts:
    """Open the state directory, journal and artifact store, build the broker client (``run``
    connects it), and wire the parts: first where every stage reports (status out, a job's
    end), then the stages in the order a job passes them (message in -> queued -> checked ->
    downloaded -> worker)."""
    device, state_dir = cfg.device_id or "", cfg.state_dir or ""
    topics = Topics(cfg.topic_prefix)
    # One daemon per state directory (agent/device/state_lock.py); the error names the other PID.
    lock = state_lock.acquire(state_dir, device)
    journal = Journal(journal_path(state_dir))
    boot = journal.next_boot()
    journal.prune()
    store = ArtifactStore(state_dir, journal, max_bytes=cfg.limits.max_store_bytes)
    reclaim_partials(store, cfg.limits.max_partial_age_s, "start-up")
    from agent import platform as platforms

    platform = platforms.detect(cfg.platform_root)
    # Can the worker's Python import it? Warned once; the birth message says so.
    backend, backend_problem = backend_check.choose(cfg.backend, platform.backend,
                                                    cfg.worker_python)
    if backend_problem:
        log.warning("%s", backend_problem)
    key = device_key(cfg)
    # The identity the birth and the Will state; its ``session`` is new for every connection
    # (the Will below), so a Will captured and replayed later is not this connection's.
    identity = key.identity() if key is not None else None
    platform_status = functools.partial(
        status_platform, platform, backend, backend_problem, cfg.labels,
        identity=identity,
        requires_signed_jobs=not cfg.security.allow_unsigned)

    def publish_request(topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> None:
        mqtt.publish(topic, payload, qos=qos, retain=retain)  # block requests out

    t = cfg.transfer
    fetcher = BlockFetcher(store, publish_request, topics, device, block_size=t.block_size,
                           window=t.window, timeout_s=t.timeout_s,
                           max_timeout_s=max(MAX_BACKOFF_S, t.timeout_s))
    fetcher.http_ca_file = http_ca_file(cfg)  # https:// artifact URLs
    b = cfg.broker
    tls = None
    if b.tls.enabled:
        tls = TlsOptions(b.tls.ca_file, b.tls.cert_file, b.tls.key_file, b.tls.insecure)
    # Every report is signed with the device's key, bound to this boot (device_identity).
    signer = ReportSigner(key, device, boot) if key is not None else None

    def will() -> Will:
        if identity is not None:
            identity["session"] = device_identity.new_session()
        payload = protocol.encode(status_messages.will_message(device, boot, platform_status()))
        return Will(topics.status(device), payload, user_properties=signer.properties(
            topics.status(device), payload, will=True) if signer is not None else None)

    mqtt = MqttClient(
        device, b.host, b.port, protocol=b.protocol, keepalive=b.keepalive,
        username=b.username, password=b.password, tls=tls, will=will,
        session_expiry=b.session_expiry,
        max_packet_bytes=max(cfg.limits.max_message_bytes, t.block_size + 4096),
        reconnect_min=b.reconnect_min, reconnect_max=b.reconnect_max, events=events,
        signer=signer.properties if signer is not None else None)
    for topic, qos in topics.device_subscriptions(device):
        mqtt.subscribe(topic, qos)
    clean_work_dirs(state_dir, journal)
    telemetry_source = open_telemetry(cfg.platform_root)

    def show_activity() -> None:
        status.show("connected to {}; {}".format(mqtt.address, shared.activity()))

    # Where every stage reports. Status out: each state change goes through the journal's
    # outbox (deleted on PUBACK); a job's end reclaims the partial downloads no job names.
    publisher = StatusPublisher(
        journal, mqtt, topics, device, boot, state_dir, platform_status, shared.counters,
        on_job_end=lambda: reclaim_partials(store, cfg.limits.max_partial_age_s, "job end"))
    for topic in publisher.birth_subscriptions():  # the roll call's call and acknowledgements
        mqtt.subscribe(topic, 1)
    # Ended: whatever stage a job reached, it ends here (its downloads cancelled).
    ending = JobEnding(shared, publisher, fetcher.cancel, show_activity)

    # A job's life, in order. A stage hands the job on through a callable; where the next
    # stage is built further down, a lambda looks it up when it is called.
    # Message in -> validated -> queued (the journal is the queue); cancel jobs and cancels.
    intake = JobIntake(cfg, device, journal, shared, publisher,
                       lambda run: supervisor.stop_worker(run), ending)
    # Queued -> checked: the oldest queued job when the daemon is free, then its downloads.
    scheduler = JobScheduler(cfg, journal, platform, backend, backend_problem, shared,
                             publisher, lambda run: downloads.start(run), ending.fail,
                             intake.run_cancel_job, show_activity,
                             lambda doc, sha: switch.check_job(doc, sha),
                             lambda run: switch.resume(run))
    # Checked -> downloaded: artifact blocks in, progress out, then the worker.
    downloads = ArtifactDownloads(fetcher, mqtt, topics, shared, publisher,
                                  lambda run: supervisor.launch(run), ending.fail)
    # Downloaded -> worker -> activated: the subprocess; its lines come back through the
    # events. A deployed engine becomes a version of its model name (the models directory),
    # handed to the app and committed or rolled back; its steps run on threads that post
    # SwitchEvents back.
    def set_stage(run: Any, stage: str) -> None:
        publisher.set_state(run, "IN_PROGRESS", stage=stage, progress=None)
        show_activity()

    # ProtectSystem=strict: a path missing from ReadWritePaths= is read-only; say so now.
    for problem in writable_paths.problems(cfg.models_dir, cfg.handoff):
        log.warning("%s", problem)
    switch = ModelSwitch(cfg, journal, ModelsDir(cfg.models_dir, cfg.models.group),
                         handoff.parse(cfg.handoff, "handoff"), events, shared, ending.end,
                         set_stage, publisher.publish_birth, platform_status)
    publisher.models_state = switch.models_list
    publisher.models_pins = switch.pins
    switch.reconcile()
    supervisor = WorkerSupervisor(cfg, device, state_dir, store, journal, events, shared,
                                  publisher, ending, show_activity, switch.activate)
    supervisor.engine_class = lambda: platform_status().get("engine_class")

    # Beside the job's life: telemetry out, and the device commands (cancel, diag, rollback).
    telemetry = TelemetryPublisher(telemetry_source, cfg.telemetry_interval, mqtt, topics,
                                   device, boot)
    telemetry.extra = switch.live.telemetry  # INT8 clipping rates in the field
    commands = DeviceCommands(cfg, device, topics, mqtt, journal, platform, shared, publisher,
                              telemetry, intake.cancel, switch)
    # The app's health reports and commits (SO_PEERCRED-checked, rate-limited).
    app_socket = app_requests.open_socket(cfg, events, lambda name, payload:
                                          switch.live.samples.donate(cfg.models_dir, name,
                                                                     payload))
    log.info("jetson-agent %s: device %s, boot %d, backend %s, platform %s, state %s",
             __version__, device, boot, backend, platform.describe(), state_dir)
    for problem in security_posture.posture(cfg)["problems"]:
        log.warning("security: %s (%s)", problem["problem"], problem["fix"])
    return Parts(topics, lock, journal, mqtt, fetcher, intake, scheduler, downloads, supervisor,
                 publisher, commands, telemetry, switch, app_socket)


class Daemon:
    """The main loop: events routed to the parts, ticks, sd_notify, signals, start/stop."""

    parts: Parts  # set by setup()

    def __init__(self, cfg: Config, notifier: Optional[Notifier] = None) -> None:
        self.cfg = cfg
        self.device: str = cfg.device_id or ""
        self.events: "queue.Queue[Any]" = BlockingByteQueue()  # bounded by bytes, not count
        self.shared = DaemonState()
        self.status = ServiceStatus(notifier)
        self.last_watchdog = 0.0
        self.last_fetcher_tick = 0.0
        self.last_connect_log = 0.0

    def setup(self) -> None:
        self.parts = assemble(self.cfg, self.events, self.shared, self.status)

    # ------------------------------------------------------------------------- main loop

    def request_stop(self, *_: Any) -> None:
        self.shared.stop_requested = True

    def run(self) -> int:
        self.setup()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        self.parts.mqtt.start()
        self.status.show("connecting to {}".format(self.parts.mqtt.address))
        try:
            while not self.shared.stop_requested:
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
            if handled >= 500 or self.shared.stop_requested:
                break
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                break
        self.parts.publisher.flush()

    def _handle(self, event: Any) -> None:
        """Any exception here is logged and the daemon carries on (bad input never kills it)."""
        try:
            if isinstance(event, WorkerEvent):
                self.parts.supervisor.on_event(event)
            elif isinstance(event, SwitchEvent):
                self.parts.switch.on_event(event)
            elif isinstance(event, app_requests.AppRequest):
                app_requests.answer(self.parts.switch, event)
            elif isinstance(event, Event):
                self._on_mqtt_event(event)
        except AgentError as exc:
            log.warning("%s", exc)
        except Exception:  # noqa: BLE001 - last line of defence, logged with a traceback
            log.exception("unexpected error handling %r", event)

    def _tick(self) -> None:
        now = time.monotonic()
        p = self.parts
        for step in (p.scheduler.schedule, p.supervisor.check_run, p.switch.tick,
                     self._fetcher_tick,
                     p.telemetry.tick, p.publisher.flush, p.publisher.birth_tick):
            try:
                step()
            except Exception:  # noqa: BLE001
                log.exception("error in %s", step.__name__)
        if not self.status.ready and now - self.shared.started > READY_WITHOUT_BROKER_S:
            self.status.ready = True
            self.status.notifier.ready("broker {} unreachable ({}); retrying".format(
                p.mqtt.address, p.mqtt.last_error or "no answer"))
        interval = self.status.notifier.watchdog_interval
        if interval is not None and now - self.last_watchdog >= min(1.0, interval / 2):
            self.status.notifier.watchdog()
            self.last_watchdog = now

    def _fetcher_tick(self) -> None:
        # The fetcher's tick flushes every transfer (fsync + journal commit) and re-asks timed
        # out blocks: about once per TICK_S, not after every burst of blocks the loop drains.
        now = time.monotonic()
        if self.parts.mqtt.connected and now - self.last_fetcher_tick >= TICK_S:
            self.last_fetcher_tick = now
            self.parts.fetcher.tick()

    # ------------------------------------------------------------------------- MQTT events

    def _on_mqtt_event(self, ev: Event) -> None:
        p, status = self.parts, self.status
        if ev.kind == MESSAGE:
            self.shared.counters["messages"] += 1
            self._on_message(ev)
        elif ev.kind == PUBLISHED:
            p.publisher.on_published(ev)
        elif ev.kind == CONNECTED:
            log.info("connected to %s (session %s)", p.mqtt.address,
                     "resumed" if ev.session_present else "new")
            p.publisher.pacer.connected()
            p.publisher.publish_birth()
            p.fetcher.on_reconnect()
            p.publisher.outbox_changed()
        elif ev.kind == SUBSCRIBED:
            text = "connected to {}; {}".format(p.mqtt.address, self.shared.activity())
            if not status.ready:
                status.ready = True
                status.notifier.ready(text)
                status.text = text
            else:
                status.show(text)
        elif ev.kind == DISCONNECTED:
            log.warning("disconnected from %s: %s", p.mqtt.address, ev.reason)
            p.publisher.connection_lost(ev)
            status.show("disconnected from {}: {}; reconnecting".format(
                p.mqtt.address, ev.reason))
        elif ev.kind == CONNECT_FAILED:
            now = time.monotonic()
            if now - self.last_connect_log > 30:
                self.last_connect_log = now
                log.warning("broker_unreachable: %s: %s (retrying)", p.mqtt.address,
                            ev.reason)
            status.show("broker {} unreachable: {}; retrying".format(p.mqtt.address,
                                                                     ev.reason))

    def _on_message(self, ev: Event) -> None:
        if self.parts.publisher.on_rollcall(ev.topic, ev.payload):
            return
        try:
            info = self.parts.topics.parse(ev.topic)
        except AgentError as exc:
            log.debug("dropped message on %s: %s", ev.topic, exc)
            return
        if info.device != self.device and not (info.kind == "block" and not info.device):
            return  # another device's topic (a shared fan-out block has no device)
        if info.kind == "job":
            self.parts.intake.on_job_doc(str(info.job_id), ev.payload)
        elif info.kind == "block":
            self.parts.downloads.on_block(ev.topic, ev.payload)
        elif info.kind == "command":
            self.parts.commands.on_command(ev)

    # ------------------------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        p = self.parts
        self.status.notifier.stopping("stopping")
        log.info("stopping")
        p.supervisor.stop_for_shutdown()
        if p.app_socket is not None:
            p.app_socket.close()
        p.fetcher.close()
        if p.mqtt.connected:
            p.publisher.flush()
            handle = p.publisher.publish_offline()
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline and (p.publisher.inflight or not handle.acked):
                try:
                    ev = self.events.get(timeout=0.1)
                except queue.Empty:
                    continue
                if isinstance(ev, Event) and ev.kind == PUBLISHED:
                    self._handle(ev)
        p.mqtt.stop()
        p.telemetry.close()
        p.journal.close()
        p.lock.close()
        self.status.notifier.close()


def run_daemon(cfg: Config) -> int:
    return Daemon(cfg).run()
