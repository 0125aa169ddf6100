"""Device health out: a telemetry sample every ``telemetry_interval`` seconds, published (QoS 0)
while connected and kept as the last sample for ``diag``. Telemetry is optional: a source that
cannot open leaves the daemon running without it."""

import logging
import time
from typing import Any, Callable, Dict

from agent.wire import message_caps, protocol
from agent.wire.topics import Topics

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon


def open_telemetry(platform_root: str) -> Any:
    """The device's telemetry source (agent.device.telemetry), or None when none opens."""
    try:
        from agent.device.telemetry import open_source

        return open_source(platform_root)
    except Exception as exc:  # noqa: BLE001 - telemetry is optional, jobs are not
        log.warning("telemetry disabled: %s", exc)
        return None


class TelemetryPublisher:
    """Samples ``source`` on ``tick()`` and publishes the sample."""

    def __init__(self, source: Any, interval_s: float, mqtt: Any, topics: Topics,
                 device: str, boot: int) -> None:
        self.source, self.interval_s = source, interval_s
        self.mqtt, self.topics, self.device, self.boot = mqtt, topics, device, boot
        self.last: Dict[str, Any] = {}  # the last sample, for diag
        self.next_at = 0.0
        self.extra: Callable[[], Dict[str, Any]] = dict  # the daemon's own figures

    def tick(self) -> None:
        now = time.monotonic()
        if self.source is None or now < self.next_at:
            return
        self.next_at = now + self.interval_s
        sample = dict(self.source.sample())
        sample.update(self.extra())
        source = sample.pop("source", getattr(self.source, "kind", "host"))
        self.last = sample
        if not self.mqtt.connected:
            return
        msg = {"protocol": protocol.PROTOCOL_VERSION, "device": self.device, "boot": self.boot,
               "ts": time.time(), "source": source, "metrics": sample}
        self.mqtt.publish(self.topics.telemetry(self.device),
                          message_caps.encode_fitted("telemetry", msg), qos=0)

    def close(self) -> None:
        if self.source is not None:
            try:
                self.source.close()
            except Exception:  # noqa: BLE001
                pass
