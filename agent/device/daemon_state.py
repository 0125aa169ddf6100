"""What the daemon knows: its configuration, connections, counters and the current job, shared by
the layers that do the work (status_publisher, worker_supervisor, artifact_downloads, job_intake,
device_commands, daemon), and the one-line status it shows systemd."""

import queue
import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from agent.device.config import Config
from agent.device.job_run import Run
from agent.device.sdnotify import Notifier
from agent.wire.limits import ByteQueue, TokenBucket
from agent.wire.topics import Topics

if TYPE_CHECKING:  # types only: the daemon opens these in Daemon.setup()
    from agent.device.journal import Journal
    from agent.platform.info import PlatformInfo
    from agent.wire.artifacts import ArtifactStore
    from agent.wire.mqtt import MqttClient
    from agent.wire.signing import TrustStore
    from agent.wire.transfer import BlockFetcher


class DaemonState:
    """The daemon's state; the connections below are opened by ``Daemon.setup()``."""

    journal: "Journal"
    boot: int
    store: "ArtifactStore"
    platform: "PlatformInfo"
    backend: str
    backend_problem: Optional[str] = None  # why the configured backend cannot run (start-up)
    fetcher: "BlockFetcher"
    mqtt: "MqttClient"
    trust: "TrustStore"
    job_bucket: "TokenBucket"

    def __init__(self, cfg: Config, notifier: Optional[Notifier] = None) -> None:
        self.cfg = cfg
        self.device: str = cfg.device_id or ""
        self.state_dir: str = cfg.state_dir or ""
        self.notifier = notifier or Notifier()
        self.topics = Topics(cfg.topic_prefix)
        self.events: "queue.Queue[Any]" = ByteQueue()  # bounded by bytes, not count
        self.stop_requested = False
        self.run_: Optional[Run] = None
        self.inflight: Dict[int, Any] = {}
        self.refusals: Dict[int, int] = {}
        self.drops_in_flight: Dict[int, int] = {}  # outbox seq -> connections lost in flight
        self.refused_bytes: Optional[int] = None  # outbox messages this large: refused
        self.outbox_dirty = True
        self.ready = False
        self.counters = {"messages": 0, "rejected_messages": 0, "jobs": 0, "blocks": 0,
                         "unauthenticated_jobs": 0, "rejections_dropped": 0,
                         "session_taken_over": 0}
        self.last_takeover_log = 0.0
        self.quick_drops: List[float] = []  # when connections closed right after accepted
        # Job intake: REJECTED jobs recorded per minute (60, bursts of 20), when a known job's
        # status was last sent again, rate-limited log lines (key -> (last, not logged)).
        self.reject_bucket = TokenBucket(1.0, 20)
        self.republished: Dict[str, float] = {}
        self.log_limits: Dict[str, Tuple[float, int]] = {}
        self.started = time.monotonic()
        self.token = 0
        self.telemetry: Any = None
        self.last_telemetry: Dict[str, Any] = {}
        self.next_telemetry = 0.0
        self.last_watchdog = 0.0
        self.last_fetcher_tick = 0.0
        self.last_outbox_scan = 0.0
        self.last_connect_log = 0.0
        self.status_text = ""

    def _notify_status(self, text: str) -> None:
        if text != self.status_text:
            self.status_text = text
            self.notifier.status(text)

    def _activity(self) -> str:
        run = self.run_
        if run is None:
            return "idle"
        return "job {} {}".format(run.job_id, run.stage or "starting")
