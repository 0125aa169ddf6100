"""Device commands on the command topic (cancel, diag, rollback, remove, revoke_engine), each
answered with a reply on the topic the command names (or this device's reply topic)."""

import logging
import os
import time
from typing import Any, Callable, Dict, Optional

from agent import __version__
from agent.device.config import Config
from agent.device.daemon_state import DaemonState
from agent.device.status_publisher import StatusPublisher
from agent.device.telemetry_publisher import TelemetryPublisher
from agent.errors import AgentError
from agent.wire import message_caps, protocol, status_messages
from agent.wire.device import security_posture
from agent.wire.mqtt_types import Event
from agent.wire.topics import Topics, reply_topic

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon


class DeviceCommands:
    """The command topic. ``cancel(job_id)`` cancels a job (intake) and returns its state."""

    def __init__(self, cfg: Config, device: str, topics: Topics, mqtt: Any,
                 journal: Any, platform: Any, shared: DaemonState, publisher: StatusPublisher,
                 telemetry: TelemetryPublisher, cancel: Callable[[str], str],
                 switch: Any = None) -> None:
        self.cfg, self.device, self.topics, self.mqtt = cfg, device, topics, mqtt
        # What diag reports on, and where rollback and cancel go.
        self.journal, self.platform, self.shared = journal, platform, shared
        self.publisher, self.telemetry, self.cancel = publisher, telemetry, cancel
        self.switch = switch  # named models: rollback (agent.device.models.switch)

    def on_command(self, ev: Event) -> None:
        limit = min(protocol.MAX_BYTES["command"], self.cfg.limits.max_message_bytes)
        try:
            cmd = protocol.decode("command", ev.payload, max_bytes=limit)
        except AgentError as exc:
            self.shared.counters["rejected_messages"] += 1
            log.warning("bad command: %s", exc)
            self._reply(ev, {}, False, error=exc.to_dict())
            return
        try:
            if cmd["command"] == "cancel":
                state = self.cancel(cmd["job_id"])
                result: Dict[str, Any] = {"job_id": cmd["job_id"], "state": state}
            elif cmd["command"] == "rollback":
                from agent.device.models import rollback as engine_rollback

                result = engine_rollback.rollback(self.journal, self.switch, cmd)
            elif cmd["command"] == "remove":
                from agent.device.models import removal as model_removal

                result = model_removal.remove(self.switch, cmd["name"])
            elif cmd["command"] == "revoke_engine":
                from agent.device.models import rollback as engine_rollback

                result = engine_rollback.revoke(self.journal, self.switch, cmd,
                                                os.path.join(self.cfg.cache_dir, "engines"))
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
            topic = reply_topic(self.topics, self.device, cmd, ev.response_topic)
        except AgentError as exc:
            log.warning("command reply goes to the default topic: %s", exc)
            topic = self.topics.command_reply(self.device)
        msg = status_messages.command_reply(self.device, cmd, ok, result=result, error=error)
        self.mqtt.publish(topic, message_caps.encode_fitted("command_reply", msg), qos=1,
                          correlation=ev.correlation)

    def diag(self) -> Dict[str, Any]:
        counts: Dict[str, int] = {}
        for row in self.journal.jobs():
            counts[row["state"]] = counts.get(row["state"], 0) + 1
        return {
            "agent_version": __version__,
            "boot": self.publisher.boot,
            "uptime_s": round(time.monotonic() - self.shared.started, 1),
            "rss_mb": rss_mb(),
            "platform": self.publisher.platform_status(),
            "problems": [dict(p) for p in self.platform.problems],
            "jobs": counts,
            "current_job": self.shared.run.job_id if self.shared.run else None,
            "outbox": self.journal.outbox_count(),
            "transfers": [{"sha256": t["sha256"], "size": t["size"]}
                          for t in self.journal.transfers()],
            "active_engines": self.journal.active_engines(),
            "models": self.switch.models_list() if self.switch is not None else [],
            "telemetry": self.telemetry.last,
            "counters": dict(self.shared.counters),
            "security": security_posture.posture(self.cfg),
        }


def rss_mb() -> Optional[float]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024.0, 1)
    except OSError:
        pass
    return None
