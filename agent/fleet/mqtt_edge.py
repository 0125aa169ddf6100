"""The I/O edge of the controller: one MQTT connection (agent.wire.mqtt) per command or service
(``FleetConnection``), and the device directory it fills (``discover``). Rollouts are carried
out by ``agent.fleet.service``.
"""

import logging
import queue
import sys
import time
import uuid
from typing import Any, Callable, Dict, Iterable, List, Optional

from agent.errors import AgentError
from agent.fleet.transfer.bytequeue import SheddingByteQueue
from agent.wire import protocol, status_messages
from agent.wire.topics import DEFAULT_PREFIX, TopicInfo, Topics

log = logging.getLogger("agent.fleet")


# ============================================================================ MQTT edge

class DeviceDirectory(object):
    """Devices as their retained status shows them (a late Will of an older boot is dropped),
    their retained models message (named models) and the last telemetry seen."""

    def __init__(self, compact: bool = False) -> None:
        self.status: Dict[str, Dict[str, Any]] = {}
        self.models: Dict[str, Dict[str, Any]] = {}
        self.telemetry: Dict[str, Dict[str, Any]] = {}
        self.reimaged: set = set()  # devices born again with a lower boot, not yet handled
        # compact (fleet serve: the database keeps the messages): only each device's boot is
        # kept, for the ordering checks and the roll call, and no telemetry.
        self.compact = compact
        self.first_heard = 0  # devices that were not in the directory, counted as they come

    def on_status(self, device: str, msg: Dict[str, Any]) -> bool:
        last = self.status.get(device)
        if last is None:
            self.first_heard += 1
        if last is not None and status_messages.status_is_stale(last.get("boot"), msg):
            if msg.get("online") is not True or not isinstance(msg.get("platform"), dict):
                return False
            # A birth of a lower boot: the device was re-imaged (a new journal counts its
            # boots from 1 again). What it held before is gone: its models message starts over.
            self.models.pop(device, None)
            self.reimaged.add(device)
        self.status[device] = _boot_of(msg) if self.compact else msg
        return True

    def on_models(self, device: str, msg: Dict[str, Any]) -> bool:
        from agent.fleet.database import device_models

        if not device_models.newer(self.models.get(device), msg):
            return False
        self.models[device] = _boot_of(msg) if self.compact else msg
        return True

    def on_telemetry(self, device: str, msg: Dict[str, Any]) -> None:
        if not self.compact:
            self.telemetry[device] = msg

    def known(self) -> List[str]:
        return sorted(self.status)

    @staticmethod
    def boot_entry(boot: int) -> Dict[str, Any]:
        """What a compact directory holds of a device known at ``boot``."""
        return _boot_of({"boot": boot})


_BOOTS: Dict[Any, Dict[str, Any]] = {}


def _boot_of(msg: Dict[str, Any]) -> Dict[str, Any]:
    """{"boot": the message's boot}, one shared dict per boot number (a compact directory
    holds a reference a device, not a copy)."""
    boot = msg.get("boot")
    if not isinstance(boot, int) or isinstance(boot, bool) or not 0 <= boot < 4096:
        return {"boot": boot}
    if boot not in _BOOTS:
        _BOOTS[boot] = {"boot": boot}
    return _BOOTS[boot]


class FleetConnection(object):
    """One MQTT connection for a controller command: connect (failing fast with
    ``broker_unreachable``), subscribe, publish, and hand messages to ``on_message``."""

    def __init__(self, broker: str = "mqtt://localhost:1883", prefix: str = DEFAULT_PREFIX,
                 username: Optional[str] = None, password: Optional[str] = None,
                 ca_file: Optional[str] = None, protocol_version: str = "v5",
                 connect_timeout: float = 5.0, cert_file: Optional[str] = None,
                 key_file: Optional[str] = None, client_id: Optional[str] = None) -> None:
        from agent.device.config import parse_broker_url

        parsed = parse_broker_url(broker)
        self.host = parsed[("broker", "host")]
        self.port = int(parsed[("broker", "port")])
        self.tls = bool(parsed.get(("broker", "tls", "enabled"))) or ca_file is not None \
            or cert_file is not None
        self.url = broker
        self.topics = Topics(prefix)
        self.username, self.password, self.ca_file = username, password, ca_file
        self.cert_file, self.key_file = cert_file, key_file  # mutual TLS
        self.protocol_version = protocol_version
        self.connect_timeout = connect_timeout
        self.directory = DeviceDirectory()
        self.client: Any = None
        self.client_id = client_id or "fleet-" + uuid.uuid4().hex[:12]
        self._unacked: List[Any] = []
        self.rollcall: Any = None  # the agent.fleet.admission.rollcall.RollCall under way
        self.last_roll_call: Any = None  # the last one finished (its stats)
        self._lost = False  # the connection dropped since the last CONNECTED
        # (topic info, MQTT event) -> whether a device's message may be read at all
        # (agent.fleet.admission.admission.Admission.check); None: every message is.
        self.gate: Optional[Callable[[TopicInfo, Any], bool]] = None
        # device id -> whether it is admitted (the service's admission), read by the event
        # queue on paho's thread: devices not admitted share one small budget there
        # (agent.fleet.transfer.bytequeue). None (no admission): every device is, each
        # within its own budget.
        self.admitted: Optional[Callable[[str], bool]] = None

    def connect(self) -> "FleetConnection":
        from agent.wire import mqtt, mqtt_types

        tls = mqtt_types.TlsOptions(ca_file=self.ca_file, cert_file=self.cert_file,
                                    key_file=self.key_file) if self.tls else None
        # Never a count-bounded queue: paho's thread must not block (it carries the PUBACKs).
        self.client = mqtt.MqttClient(
            self.client_id, self.host, self.port,
            protocol=self.protocol_version, username=self.username, password=self.password,
            tls=tls, session_expiry=0, clean_start=True, reconnect_min=0.5, reconnect_max=5.0,
            max_packet_bytes=None,
            events=SheddingByteQueue(trusted=self._trusted))  # type: ignore[arg-type]
        self.client.start()
        deadline = time.monotonic() + self.connect_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise AgentError("broker_unreachable", "cannot connect to the MQTT broker at "
                                 "{}:{}: no answer within {:.0f} s (is it running? check "
                                 "--broker)".format(self.host, self.port, self.connect_timeout),
                                 {"host": self.host, "port": self.port})
            try:
                ev = self.client.events.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if ev.kind == mqtt.CONNECTED:
                return self
            if ev.kind == mqtt.CONNECT_FAILED:
                self.close()
                raise AgentError("broker_unreachable", "cannot connect to the MQTT broker at "
                                 "{}:{}: {} (is it running? check --broker)".format(
                                     self.host, self.port, ev.reason),
                                 {"host": self.host, "port": self.port})

    def _trusted(self, device: str) -> bool:
        return self.admitted is None or self.admitted(device)

    def close(self) -> None:
        if self.client is not None:
            self.client.stop()

    def rereads_dropped(self) -> int:
        """Retained births and models messages the event queue let go (over its budget for
        them): the broker keeps them, a roll call reads them again."""
        return int(getattr(getattr(self.client, "events", None), "reread_dropped", 0))

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the broker acknowledged every QoS 1 message published so far."""
        deadline = time.monotonic() + timeout
        for handle in self._unacked:
            if not handle.wait(max(0.0, deadline - time.monotonic())):
                return False
        self._unacked = []
        return True

    def subscribe(self, filters: Iterable[str], qos: int = 1) -> None:
        for f in filters:
            self.client.subscribe(f, qos)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                wait: Optional[float] = None) -> Any:
        handle = self.client.publish(topic, payload, qos=qos, retain=retain)
        if qos:
            self._unacked = [h for h in self._unacked if not h.acked] + [handle]
        if wait is not None and not handle.wait(wait):
            raise AgentError("broker_unreachable", "the broker at {}:{} did not acknowledge a "
                             "message on {} within {:.0f} s".format(self.host, self.port, topic,
                                                                    wait))
        return handle

    def pump(self, on_message: Callable[[TopicInfo, Any], None], timeout: float,
             max_events: Optional[int] = None, drain: bool = False,
             drain_s: Optional[float] = None) -> bool:
        """Handle events for up to ``timeout`` s (or until ``max_events`` were handled: a
        bounded batch; ``drain``: past ``timeout`` too while events are queued, for at most
        ``drain_s`` s more); True if a SUBSCRIBED event was among them. Status and telemetry
        messages update ``directory`` before ``on_message`` sees them."""
        from agent.wire import mqtt

        subscribed = False
        deadline = time.monotonic() + timeout
        handled = 0
        while True:
            if max_events is not None and handled >= max_events:
                return subscribed
            if drain_s is not None and time.monotonic() >= deadline + drain_s:
                return subscribed
            handled += 1
            left = deadline - time.monotonic()
            try:
                ev = self.client.events.get(timeout=max(0.0, min(left, 0.1)))
            except queue.Empty:
                # A quiet connection still times out the roll call's round: its closing mark
                # may be what the broker's queue dropped, and nothing else may come.
                self._poll_roll_call()
                if left <= 0:
                    return subscribed
                continue
            if ev.kind == mqtt.SUBSCRIBED:
                subscribed = True
            elif ev.kind == mqtt.DISCONNECTED:
                log.warning("lost the broker connection (%s); reconnecting", ev.reason)
                self._lost = True
            elif ev.kind == mqtt.CONNECTED and self._lost:
                # Births while away reached no session: the retained ones through the queue.
                self._lost = False
                if self.rollcall is not None:
                    self.rollcall.restart()
                else:
                    self.begin_roll_call()
            elif ev.kind == mqtt.MESSAGE:
                self._dispatch(ev, on_message)
            self._poll_roll_call()
            if time.monotonic() >= deadline and not drain:
                return subscribed  # (draining: the next get, without a wait, ends it)

    # -- the roll call (agent.fleet.admission.rollcall) --------------------------------------------

    def begin_roll_call(self) -> bool:
        """Start a roll call (carried on by ``pump``) unless one is under way; False then."""
        from agent.fleet.admission.rollcall import RollCall

        if self.rollcall is not None:
            return False

        def known(device: str) -> Any:
            return (self.directory.status.get(device) or {}).get("boot")

        self.rollcall = RollCall(self, known).start()
        return True

    def roll_call(self, on_message: Callable[[TopicInfo, Any], None],
                  limit: float = 300.0) -> None:
        """A whole roll call: every device's retained status and models message, in pages
        that fit the broker's queue (or until ``limit`` s passed)."""
        self.begin_roll_call()
        deadline = time.monotonic() + limit
        while self.rollcall is not None and time.monotonic() < deadline:
            self.pump(on_message, 0.1)
        if self.rollcall is not None:
            log.warning("the roll call did not finish within %.0f s", limit)

    def _poll_roll_call(self) -> None:
        rc = self.rollcall
        if rc is None:
            return
        if not rc.done:
            rc.poll()
        if rc.done:
            self.rollcall, self.last_roll_call = None, rc

    def _dispatch(self, ev: Any, on_message: Callable[[TopicInfo, Any], None]) -> None:
        if ev.topic.startswith(self.topics.prefix + "/rollcall/"):
            if self.rollcall is not None:
                self.rollcall.on_topic(ev.topic, ev.payload)
            return
        try:
            info = self.topics.parse(ev.topic)
        except AgentError:
            return
        if self.gate is not None and not self.gate(info, ev):
            return  # a device not admitted, or a message not signed by its pinned key
        if info.device and self.gate is not None:
            # Admitted: the service's tables (and its rollouts') share one name. (Without a
            # gate, anyone's made-up ids would be interned, and on some Pythons never freed.)
            info = info._replace(device=sys.intern(info.device))
        if info.kind in ("artifact_request", "block", "job"):
            on_message(info, ev)
            return
        if not ev.payload:
            return
        try:
            msg = protocol.decode(info.kind, ev.payload)
        except AgentError as exc:
            log.warning("dropping a message on %s: %s", ev.topic, exc)
            return
        if self.rollcall is not None and info.kind in ("status", "models") and ev.retain:
            self.rollcall.counted()
        if info.kind == "status":
            if not self.directory.on_status(info.device, msg):
                return
        elif info.kind == "models":
            if msg.get("device") != info.device or not self.directory.on_models(info.device,
                                                                               msg):
                return
        elif info.kind == "telemetry":
            self.directory.on_telemetry(info.device, msg)
        on_message(info, msg)

    def settle(self, on_message: Callable[[TopicInfo, Any], None],
               quiet: float = 0.3, limit: float = 5.0,
               counted: Optional[Callable[[TopicInfo], bool]] = None) -> None:
        """Wait for the subscriptions to be acknowledged and the retained messages that follow
        them to arrive (until ``quiet`` s pass without one, at most ``limit`` s). ``counted``:
        which messages are the ones waited for (others are handled but do not keep the wait
        going: a busy fleet's live traffic never pauses for ``quiet`` s)."""
        deadline = time.monotonic() + limit
        got_suback = False
        while time.monotonic() < deadline and not got_suback:
            # One event at a time: the wait ends with the acknowledgement, not 0.1 s later.
            got_suback = self.pump(on_message, 0.1, max_events=1)
        seen = [0]

        def counting(info: TopicInfo, msg: Any) -> None:
            if counted is None or counted(info):
                seen[0] += 1
            on_message(info, msg)

        while time.monotonic() < deadline:
            seen[0] = 0
            self.pump(counting, quiet)
            if not seen[0]:
                return


def _ignore(info: TopicInfo, msg: Any) -> None:
    return None


def discover(conn: FleetConnection, telemetry_wait: float = 0.0) -> DeviceDirectory:
    """Retained device statuses and models messages (and telemetry heard within
    ``telemetry_wait`` s): the wildcard subscriptions (devices of the previous release), then a
    roll call (agent.fleet.admission.rollcall) for the devices the broker's queue left out."""
    conn.subscribe([conn.topics.prefix + "/devices/+/status",
                    conn.topics.prefix + "/devices/+/models"])
    if telemetry_wait > 0:
        conn.subscribe([conn.topics.prefix + "/devices/+/telemetry"], 0)
    conn.settle(_ignore)
    conn.roll_call(_ignore)
    if telemetry_wait > 0:
        conn.pump(_ignore, telemetry_wait)
    return conn.directory
