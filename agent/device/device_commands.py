"""Device commands (cancel, diag, rollback) and their replies."""

import logging
import time
from typing import Any, Dict, Optional

from agent import __version__
from agent.device.job_intake import JobIntake
from agent.errors import AgentError
from agent.wire import message_caps, protocol, security_posture, status_messages
from agent.wire.mqtt_types import Event
from agent.wire.topics import reply_topic

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon


class DeviceCommands(JobIntake):
    """Daemon layer: the command topic."""

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
            elif cmd["command"] == "rollback":
                from agent.device import engine_rollback

                result = engine_rollback.rollback(self.journal, cmd["model"])
                self._publish_birth()  # the retained status lists the active engines
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
            "boot": self.boot,
            "uptime_s": round(time.monotonic() - self.started, 1),
            "rss_mb": rss_mb(),
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
