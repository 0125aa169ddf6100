"""``DeviceRegistry``: what devices say about themselves (their births and Wills, their models
messages, their telemetry) kept in the database, written in bounded batches (each tick, or
once ``streaming.MAX_DIRTY`` are waiting: a burst of births at start-up), and what each device
says it understands (its features), held once per distinct value.
"""

import logging
from typing import Any, Callable, Dict, Optional

from agent.fleet.admission import bounds
from agent.fleet.database import device_models
from agent.fleet.rollouts import streaming
from agent.wire.topics import TopicInfo

log = logging.getLogger("agent.fleet")


class DeviceRegistry(object):
    def __init__(self, store: Any, conn: Any, stats: Dict[str, int],
                 owe_ack: Callable[[str, Dict[str, Any], frozenset], None],
                 devices_saved: Callable[[Dict[str, Dict[str, Any]]], None],
                 models_saved: Callable[[Dict[str, Dict[str, Any]]], None]) -> None:
        self.store = store
        self.conn = conn
        self.stats = stats
        self.owe_ack = owe_ack  # a birth that waits for its acknowledgement
        self.devices_saved = devices_saved  # statuses now in the database
        self.models_saved = models_saved  # models messages now in the database
        self.devices_dirty: Dict[str, Dict[str, Any]] = {}
        self.models_dirty: Dict[str, Dict[str, Any]] = {}  # device -> its models message
        self.telemetry_dirty: Dict[str, Dict[str, Any]] = {}
        # device -> telemetry message, at each flush (agent.fleet.database.history keeps the series)
        self.on_telemetry: Optional[Callable[[Dict[str, Dict[str, Any]]], None]] = None
        self.features: Dict[str, frozenset] = {}  # device -> its last status's features
        self.engine_classes: Dict[str, Any] = {}  # device -> its platform.engine_class
        self._interned: Dict[Any, Any] = {}  # feature sets and engine classes, held once

    def on_status(self, info: TopicInfo, msg: Dict[str, Any]) -> None:
        self.devices_dirty[info.device] = msg
        if msg.get("platform") is not None:  # a Will has none: the last birth's stand
            # One frozenset (and string) per distinct value, not one per device.
            fs = device_models.features(msg)
            self.owe_ack(info.device, msg, fs)
            self.features[info.device] = self._interned.setdefault(fs, fs)
            cls = msg["platform"].get("engine_class")
            self.engine_classes[info.device] = self._interned.setdefault(cls, cls) \
                if isinstance(cls, str) and len(self._interned) < 4096 else cls
        if len(self.devices_dirty) >= streaming.MAX_DIRTY:
            self.flush()  # a burst of births (start-up): bounded batches

    def on_models(self, info: TopicInfo, msg: Dict[str, Any]) -> None:
        self.models_dirty[info.device] = msg
        if len(self.models_dirty) >= streaming.MAX_DIRTY:
            self.flush()

    def on_telemetry_message(self, info: TopicInfo, msg: Dict[str, Any]) -> None:
        msg, dropped = bounds.cap_telemetry(msg)
        if dropped:
            self._telemetry_dropped(info.device, dropped)
        self.telemetry_dirty[info.device] = msg

    def _telemetry_dropped(self, device: str, dropped: int) -> None:
        self.stats["telemetry_keys_dropped"] = self.stats.get("telemetry_keys_dropped", 0) + \
            dropped
        self.stats["telemetry_capped"] = self.stats.get("telemetry_capped", 0) + 1
        n = self.stats["telemetry_capped"]
        if n in (1, 10, 100) or n % 1000 == 0:
            log.warning("telemetry of %s: %d metric(s) dropped (at most %d numeric metrics a "
                        "device, keys of at most %d characters; %d telemetry messages capped, "
                        "%d metrics dropped so far)", device, dropped, bounds.MAX_TELEMETRY_KEYS,
                        bounds.MAX_KEY_CHARS, n, self.stats["telemetry_keys_dropped"])

    def flush(self) -> None:
        if self.devices_dirty:
            self.store.upsert_devices(self.devices_dirty)
            saved, self.devices_dirty = self.devices_dirty, {}
            self.devices_saved(saved)
        if self.models_dirty:
            # Devices born again with a lower boot (re-imaged): their new message replaces
            # the old image's whatever its boot.
            directory = getattr(self.conn, "directory", None)
            reset = sorted(set(directory.reimaged) & set(self.models_dirty)) \
                if directory is not None else []
            device_models.save(self.store, self.models_dirty, reset=reset)
            if directory is not None:
                directory.reimaged.difference_update(reset)
            saved, self.models_dirty = self.models_dirty, {}
            self.models_saved(saved)
        if self.telemetry_dirty:
            self.store.touch_devices(self.telemetry_dirty)
            if self.on_telemetry is not None:
                self.on_telemetry(self.telemetry_dirty)
            self.telemetry_dirty = {}

    def features_of(self, device: str) -> frozenset:
        """What the device's last status says it understands (named models, ...): the
        statuses heard since the start, over those in the database."""
        if device in self.features:
            return self.features[device]
        # Not heard since the start: the database's row, this device's only (not every
        # device's status at once: 50,000 statuses are hundreds of MiB while they are read).
        row = self.store.device(device) or {}
        fs = device_models.features(row.get("status") or None)
        fs = self._interned.setdefault(fs, fs)
        self.features[device] = fs
        return fs

    def engine_class_of(self, device: str) -> Any:
        return self.engine_classes.get(device)
