"""The one module that imports paho: a small MQTT client for the daemon and controllers.

- MQTT v5 (default) or 3.1.1; a persistent session (clean start off, a session expiry) so the
  broker keeps our subscriptions and queued QoS 1 messages while we are away.
- A Will (LWT) set before connecting; reconnects with exponential backoff; the subscription list
  is sent again on every connect (a restarted broker may have lost the session).
- ``publish`` returns a ``PublishHandle``: wait on it, or pass a ``token`` and receive a
  ``published`` event when the broker acknowledges (PUBACK) - the daemon acks its outbox then.
- ``set_gate`` (a controller's lease): every QoS >= 1 message carries a fence key, checked on
  paho's thread just before its packet is written; a refused key's messages are dropped from
  paho's queues (``agent.wire.send_gate``).
- Everything paho reports becomes an ``Event`` on ``events`` (a queue the owner drains): no work
  happens in paho's network thread. ``Event`` and the other values the client takes and gives
  live in ``mqtt_types`` (no paho there), the texts explaining a failed connection in
  ``mqtt_errors``.

paho-mqtt 2.x is used with its VERSION2 callbacks; 1.6 (no CallbackAPIVersion) works too.
"""

import logging
import queue
import socket
import ssl
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Union

import paho.mqtt.client as paho

from agent.errors import AgentError
from agent.wire.mqtt_errors import (
    PahoLog,
    closed_before_connack,
    connect_failure,
    is_failure,
    reason_text,
)
from agent.wire.mqtt_types import Event, PublishHandle, TlsOptions, Will

try:
    from paho.mqtt.enums import CallbackAPIVersion  # paho >= 2.0
except ImportError:  # paho 1.6
    CallbackAPIVersion = None  # type: ignore[assignment,misc]

log = logging.getLogger("agent.wire.mqtt")

PROTOCOLS = {"v5": paho.MQTTv5, "v3.1.1": paho.MQTTv311}

# Event kinds
CONNECTED = "connected"  # .session_present
CONNECT_FAILED = "connect_failed"  # .reason
DISCONNECTED = "disconnected"  # .reason
SUBSCRIBED = "subscribed"  # every subscription of this connection was acknowledged
MESSAGE = "message"  # .topic, .payload, .retain, .qos
PUBLISHED = "published"  # .token, .ok, .reason

SESSION_TAKEN_OVER = 0x8E  # MQTT v5 DISCONNECT: another client connected with our client id


def _no_delay(sock: Any) -> None:
    """Turn Nagle's algorithm off (paho leaves it on): a PUBACK or a block request of a few
    bytes must not wait for the broker's delayed ACK of the previous one (40 ms on Linux),
    which stalls a stream of blocks many times a second."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except (AttributeError, OSError):  # not a TCP socket (a test double, a Unix socket)
        pass


class MqttClient:
    """A connection to one broker. Call ``start()``, then drain ``events``."""

    def __init__(
        self,
        client_id: str,
        host: str = "localhost",
        port: int = 1883,
        protocol: str = "v5",
        keepalive: int = 30,
        username: Optional[str] = None,
        password: Optional[str] = None,
        tls: Optional[TlsOptions] = None,
        will: "Optional[Union[Will, Callable[[], Will]]]" = None,
        session_expiry: int = 7 * 24 * 3600,
        clean_start: bool = False,
        max_packet_bytes: Optional[int] = None,
        reconnect_min: float = 1.0,
        reconnect_max: float = 30.0,
        events: "Optional[queue.Queue[Event]]" = None,
        max_events: int = 2000,
        signer: Optional[Callable[[str, bytes], List[Tuple[str, str]]]] = None,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise AgentError("bad_config", "MQTT protocol must be one of {}, found {!r}".format(
                ", ".join(PROTOCOLS), protocol))
        self.client_id = client_id
        self.host, self.port, self.protocol = host, int(port), protocol
        self.keepalive = int(keepalive)
        self.session_expiry = int(session_expiry)
        self.clean_start = clean_start
        self.max_packet_bytes = max_packet_bytes
        # (topic, payload) -> MQTT v5 user properties put on every publish (a device's report
        # signature, agent.wire.device_identity); None: none.
        self.signer = signer if protocol == "v5" else None
        self.events: "queue.Queue[Event]" = events if events is not None else queue.Queue(
            max_events)
        self.last_error = ""
        self.server_max_packet: Optional[int] = None  # the broker's CONNACK Maximum Packet Size
        self._subscriptions: Dict[str, int] = {}
        self._sub_mids: Dict[int, bool] = {}
        # SUBACKs handled before subscribe() returned their mid (paho's thread won the race):
        # recorded here, or the mid would wait for ever and no SUBSCRIBED event would follow.
        self._sub_early: Set[int] = set()
        self._pending: Dict[int, PublishHandle] = {}
        self._early: Dict[int, Tuple[bool, str]] = {}
        self._abandoned: Set[int] = set()
        self._connected_at = 0.0
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._attempted = threading.Event()
        self._closing = False
        self._started = False
        self._gate: Any = None  # agent.wire.send_gate.SendGate (set_gate)
        self._default_fence: Callable[[], Any] = lambda: None

        v5 = protocol == "v5"
        kwargs: Dict[str, Any] = {"client_id": client_id, "protocol": PROTOCOLS[protocol]}
        if not v5:
            kwargs["clean_session"] = clean_start
        if CallbackAPIVersion is not None:
            kwargs["callback_api_version"] = CallbackAPIVersion.VERSION2
        self._v2 = CallbackAPIVersion is not None
        self._client = paho.Client(**kwargs)
        self._client.reconnect_delay_set(reconnect_min, reconnect_max)  # type: ignore[arg-type]
        self._client.max_inflight_messages_set(100)
        if username is not None:
            self._client.username_pw_set(username, password)
        self.tls_enabled = tls is not None
        self._has_client_cert = tls is not None and bool(tls.cert_file)
        if tls is not None:
            self._client.tls_set(ca_certs=tls.ca_file, certfile=tls.cert_file,
                                 keyfile=tls.key_file, cert_reqs=ssl.CERT_REQUIRED)
            self._client.tls_insecure_set(tls.insecure)
        # A callable Will is made again for every connection (a device's Will states its
        # connection's session: a captured one replayed later is dropped, device_identity).
        self._will_factory = will if callable(will) else None
        self._set_will(will() if callable(will) else will)
        self._client.on_connect = self._on_connect
        self._client.on_connect_fail = self._on_connect_fail
        self._client.on_disconnect = self._on_disconnect
        self._client.on_message = self._on_message
        self._client.on_publish = self._on_publish
        self._client.on_subscribe = self._on_subscribe
        self._socket_error = ""  # paho's last socket-level warning (a TLS alert, a reset)
        self._client.enable_logger(PahoLog(self))  # type: ignore[arg-type]

    def _set_will(self, will: Optional[Will]) -> None:
        if will is None:
            return
        will_props = None
        if self.protocol == "v5" and will.user_properties:
            will_props = self._properties("WILLMESSAGE", will.user_properties)
        self._client.will_set(will.topic, will.payload, will.qos, will.retain,
                              properties=will_props)

    # --- owner's API --------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return "{}:{}".format(self.host, self.port)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def start(self) -> None:
        """Connect in the background; paho's thread keeps reconnecting until ``stop()``."""
        if self._started:
            return
        self._started = True
        connect_kwargs: Dict[str, Any] = {"keepalive": self.keepalive}
        if self.protocol == "v5":
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = self.session_expiry
            if self.max_packet_bytes:
                props.MaximumPacketSize = int(self.max_packet_bytes)
            connect_kwargs["clean_start"] = self.clean_start
            connect_kwargs["properties"] = props
        self._client.connect_async(self.host, self.port, **connect_kwargs)
        self._client.loop_start()

    def wait_connected(self, timeout: float) -> None:
        """Block until connected; AgentError("broker_unreachable") naming host:port and the
        last reason otherwise (the client keeps trying in the background)."""
        if not self._connected.wait(timeout):
            reason = self.last_error or "no answer within {:.0f} s".format(timeout)
            raise AgentError("broker_unreachable", "cannot connect to the MQTT broker at {}: "
                                                   "{}".format(self.address, reason),
                             {"host": self.host, "port": self.port})

    def subscribe(self, topic: str, qos: int = 1) -> None:
        """Subscribe now (if connected) and again on every reconnect."""
        with self._lock:
            self._subscriptions[topic] = qos
        if self.connected:
            self._send_subscriptions([(topic, qos)])

    def unsubscribe(self, topic: str) -> None:
        with self._lock:
            self._subscriptions.pop(topic, None)
        if self.connected:
            self._client.unsubscribe(topic)

    def set_gate(self, check: Callable[[Any], bool], default: Callable[[], Any]) -> bool:
        """From now on, write a QoS >= 1 message only while ``check(its fence key)`` is true
        (asked on paho's thread just before writing: cheap, no I/O); the messages of a key it
        refuses are dropped, their handles fail, and ``take_fenced`` counts them. A message
        published without a ``fence`` gets ``default()``'s. False (no gate) with a paho whose
        queues this cannot reach."""
        from agent.wire.send_gate import SendGate

        if not SendGate.supported(self._client):
            return False
        self._gate = SendGate(check)
        self._default_fence = default
        self._client._packet_write = self._gated_write  # type: ignore[method-assign]
        self._client._sock_send = self._gated_sock_send  # type: ignore[method-assign]
        return True

    def take_fenced(self) -> Dict[Any, int]:
        """fence key -> messages dropped by the gate since the last call."""
        return self._gate.take_dropped() if self._gate is not None else {}

    def _gated_write(self) -> Any:
        gate = self._gate
        with gate.lock:  # (paho's thread) nothing is written before its key was looked at
            mids, cut = gate.before_write(self._client)
            if mids:
                with self._lock:
                    handles = [self._pending.pop(m, None) for m in mids]
                for h in handles:
                    if h is not None:
                        self._ack(h, False, "not sent: its fence (a lease) had gone")
                if cut:  # a packet half written: the broker discards it with the connection
                    self.drop_connection()
            return type(self._client)._packet_write(self._client)

    def _gated_sock_send(self, buf: Any) -> int:
        """paho writes its whole queue after one ``_gated_write`` check: each packet is
        looked at again right before its bytes go (a stop may fall between two)."""
        if self._gate.refuses_any():
            raise BlockingIOError()  # the packet goes back; the next write drops the refused
        return type(self._client)._sock_send(self._client, buf)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                token: Any = None, correlation: Optional[bytes] = None,
                response_topic: Optional[str] = None,
                user_properties: Optional[List[Tuple[str, str]]] = None,
                fence: Any = None) -> PublishHandle:
        """Hand a message to paho (queued while disconnected, resent after a reconnect).
        With a ``token``, a PUBLISHED event carrying it follows the broker's acknowledgement.
        ``correlation`` / ``response_topic`` / ``user_properties`` are MQTT v5 properties
        (ignored on 3.1.1); the client's ``signer`` adds its own to every message. ``fence``:
        the key the gate (``set_gate``) checks before the message is written."""
        handle = PublishHandle(topic, token)
        handle.size = len(payload)
        props = None
        users = list(user_properties or [])
        if self.signer is not None:
            users += self.signer(topic, payload)
        if self.protocol == "v5" and (correlation is not None or response_topic is not None
                                      or users):
            props = self._properties("PUBLISH", users)
            if correlation is not None:
                props.CorrelationData = bytes(correlation)
            if response_topic is not None:
                props.ResponseTopic = response_topic
        gate = self._gate
        if gate is None:
            info = self._client.publish(topic, payload, qos=qos, retain=retain,
                                        properties=props)
        else:
            with gate.lock:  # recorded before paho's thread may write it
                info = self._client.publish(topic, payload, qos=qos, retain=retain,
                                            properties=props)
                if qos > 0 and info.rc != paho.MQTT_ERR_QUEUE_SIZE:
                    gate.record(info.mid, self._default_fence() if fence is None else fence)
        handle.mid = info.mid
        if info.rc == paho.MQTT_ERR_QUEUE_SIZE:
            handle._finish(False, "paho's outgoing queue is full")
            return handle
        with self._lock:
            early = self._early.pop(info.mid, None)
            if early is None:
                self._pending[info.mid] = handle
        if early is not None:
            self._ack(handle, *early)
        return handle

    @staticmethod
    def _properties(packet: str, users: List[Tuple[str, str]]) -> Any:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(getattr(PacketTypes, packet))
        if users:
            props.UserProperty = [(str(k), str(v)) for k, v in users]
        return props

    def abandon(self, handle: PublishHandle) -> None:
        """Never resend ``handle``'s message (the owner replaced it: the broker kept refusing
        it). paho resends unacknowledged messages after a reconnect; they are dropped from its
        queue before that, at the next connection."""
        with self._lock:
            self._pending.pop(handle.mid, None)
            self._abandoned.add(handle.mid)
        if not self.connected:
            return
        self._forget({handle.mid})

    def _forget(self, mids: Set[int]) -> None:
        out = getattr(self._client, "_out_messages", None)
        mutex = getattr(self._client, "_out_message_mutex", None)
        if out is None or mutex is None:  # another paho: it resends, the broker refuses again
            return
        with mutex:
            for mid in mids:
                out.pop(mid, None)
        if self._gate is not None:
            for mid in mids:
                self._gate.done(mid)

    def fits(self, topic: str, payload: bytes) -> bool:
        """Whether the broker's advertised Maximum Packet Size (MQTT v5 CONNACK) allows this
        message; True when it advertised none."""
        from agent.wire.message_caps import packet_bytes

        limit = self.server_max_packet
        return limit is None or packet_bytes(topic, payload) <= limit

    def stop(self) -> None:
        """Disconnect cleanly (the broker does not publish the Will) and stop the thread."""
        self._closing = True
        if not self._started:
            return
        try:
            self._client.disconnect()
        except Exception:  # noqa: BLE001 - already gone is fine
            pass
        self._client.loop_stop()
        self._connected.clear()

    def drop_connection(self) -> None:
        """Close the socket without a DISCONNECT (tests: the broker then publishes the Will)."""
        sock = self._client.socket()
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    # --- paho's thread: record and enqueue, nothing more --------------------------------------

    def _put(self, event: Event) -> None:
        while not self._closing:
            try:
                self.events.put(event, timeout=0.5)
                return
            except queue.Full:
                continue  # the owner is busy; backpressure onto the socket

    def _send_subscriptions(self, subs: List[Tuple[str, int]]) -> None:
        if not subs:
            return
        rc, mid = self._client.subscribe(subs)
        if rc == paho.MQTT_ERR_SUCCESS and mid is not None:
            with self._lock:
                if mid in self._sub_early:
                    self._sub_early.discard(mid)  # acknowledged already (SUBSCRIBED was put)
                else:
                    self._sub_mids[mid] = True

    def _on_connect(self, client: Any, userdata: Any, flags: Any, rc: Any,
                    properties: Any = None) -> None:
        if is_failure(rc):
            self.last_error = "connection refused: " + reason_text(rc)
            self._attempted.set()
            self._put(Event(CONNECT_FAILED, reason=self.last_error))
            return
        if isinstance(flags, dict):
            session_present = bool(flags.get("session present"))
        else:
            session_present = bool(getattr(flags, "session_present", False))
        self.last_error = ""
        self._socket_error = ""
        _no_delay(client.socket())
        limit = getattr(properties, "MaximumPacketSize", None) if properties is not None else None
        self.server_max_packet = int(limit) if isinstance(limit, int) and limit > 0 else None
        with self._lock:
            abandoned, self._abandoned = self._abandoned, set()
        if abandoned:
            self._forget(abandoned)
        self._connected_at = time.monotonic()
        self._connected.set()
        self._attempted.set()
        with self._lock:
            subs = list(self._subscriptions.items())
            self._sub_mids.clear()
            self._sub_early.clear()
        self._put(Event(CONNECTED, session_present=session_present))
        if subs:
            self._send_subscriptions(subs)
        else:
            self._put(Event(SUBSCRIBED))

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        # paho calls this from inside its ``except OSError`` block: the error is current.
        self.last_error = connect_failure(sys.exc_info()[1], self.tls_enabled, self.port)
        self._attempted.set()
        self._put(Event(CONNECT_FAILED, reason=self.last_error))

    def _on_disconnect(self, client: Any, userdata: Any, *args: Any) -> None:
        # v2: (flags, reason_code, properties); v1: (rc) or (rc, properties)
        rc = args[1] if self._v2 else args[0]
        was_connected = self._connected.is_set()
        self._connected.clear()
        if self._will_factory is not None and not self._closing:
            self._set_will(self._will_factory())  # the next connection's, before it opens
        reason = reason_text(rc) if is_failure(rc) else "disconnected"
        flags = args[0] if self._v2 else None
        from_server = bool(getattr(flags, "is_disconnect_packet_from_server", False))
        code = getattr(rc, "value", None) if from_server else None
        if from_server:
            reason = "the broker disconnected us: " + reason_text(rc)
        elif is_failure(rc):
            reason = "connection closed without a DISCONNECT from the broker"
        if was_connected:
            if is_failure(rc):
                self.last_error = "connection lost: " + reason
            self._put(Event(DISCONNECTED, reason=reason,
                            code=code if isinstance(code, int) else None,
                            held_s=time.monotonic() - self._connected_at))
        elif not self._closing and self._socket_error:
            # Closed before CONNACK: with TLS 1.3 a refused client certificate shows up here.
            self.last_error = closed_before_connack(self._socket_error, self.tls_enabled,
                                                    self._has_client_cert)
            self._socket_error = ""
            self._attempted.set()
            self._put(Event(CONNECT_FAILED, reason=self.last_error))

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, *args: Any) -> None:
        codes = args[0] if args else []
        # v5 / VERSION2: ReasonCode objects; paho 1.6 with 3.1.1: granted QoS ints (128: refused)
        refused = [c for c in (codes or []) if (c.is_failure if hasattr(c, "is_failure")
                                                 else int(c) >= 0x80)]
        if refused:
            log.warning("broker refused a subscription: %s", refused)
        with self._lock:
            if self._sub_mids.pop(mid, None) is None and len(self._sub_early) < 1024:
                self._sub_early.add(mid)
            done = not self._sub_mids
        if done:
            self._put(Event(SUBSCRIBED, ok=not refused))

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        try:
            topic = message.topic
        except UnicodeDecodeError:
            return  # not a topic we could have subscribed to
        props = getattr(message, "properties", None)
        response_topic = getattr(props, "ResponseTopic", None) if props is not None else None
        correlation = getattr(props, "CorrelationData", None) if props is not None else None
        users = getattr(props, "UserProperty", None) if props is not None else None
        self._put(Event(MESSAGE, topic=topic, payload=bytes(message.payload),
                        retain=bool(message.retain), qos=int(message.qos),
                        response_topic=response_topic,
                        correlation=bytes(correlation) if correlation is not None else None,
                        user_properties=[(str(k), str(v)) for k, v in users[:16]]
                        if isinstance(users, list) else None))

    def _on_publish(self, client: Any, userdata: Any, mid: int, *args: Any) -> None:
        rc = args[0] if args else 0
        ok, reason = not is_failure(rc), reason_text(rc) if args else "Success"
        if self._gate is not None:
            self._gate.done(mid)
        with self._lock:
            handle = self._pending.pop(mid, None)
            if handle is None:
                self._early[mid] = (ok, reason)
                if len(self._early) > 1000:  # acks of messages nobody registers (never here)
                    self._early.pop(next(iter(self._early)))
        if handle is not None:
            self._ack(handle, ok, reason)

    def _ack(self, handle: PublishHandle, ok: bool, reason: str) -> None:
        handle._finish(ok, reason)
        if handle.token is not None:
            self._put(Event(PUBLISHED, topic=handle.topic, token=handle.token, ok=ok,
                            reason=reason))
