"""Job states out: every state change goes through the journal's outbox and is published from
there, deleted on PUBACK, so nothing is lost on a disconnect or a crash; a message the broker
refuses goes out in its short form. Also the retained birth status (and the offline one at
shutdown), and a session takeover made visible. Handed the journal and the MQTT client; the other
parts call ``set_state`` / ``emit`` and never touch the outbox themselves."""

import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional

from agent import __version__
from agent.device.birth_pacing import BirthPacer
from agent.device.jobs.run import Run
from agent.errors import AgentError
from agent.wire import message_caps, protocol, rollcall, status_messages
from agent.wire.mqtt import SESSION_TAKEN_OVER
from agent.wire.mqtt_types import Event, PublishHandle
from agent.wire.topics import Topics

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

OUTBOX_BATCH = 200
# An outbox message the broker refused this many times (PUBACK reason codes), or that was in
# flight when the connection dropped this many times (a broker closes the connection on a
# packet over its max_packet_size), is replaced by its short form; a short form refused as
# often is dropped (logged): one message must never wedge the connection.
MAX_PUBLISH_REFUSALS = 3
MAX_DROPS_IN_FLIGHT = 3
SMALL_STATUS_BYTES = 4096  # never shortened for dropped connections: any broker takes these
MAX_ERROR_BYTES = 64 * 1024  # a job error as the journal keeps it
# Connections closed by the broker within QUICK_DROP_S of being accepted, QUICK_DROPS times in
# a minute, without a DISCONNECT saying why: a suspected session takeover.
QUICK_DROP_S = 5.0
QUICK_DROPS = 3
# signed_engines: a shared engine comes with its builder's signature (checked here), and this
# device signs the engines it offers.
# model_sets: the job's model_set (agent.device.models.sets); model_pins: the models message's
# pins (jetson-agent models pin).
# remove_model: the remove command (agent.device.models.removal; a deployment's on_leave).
# revoke_engine: the revoke_engine command (fleet engines revoke; agent.device.models.rollback).
# birth_ack: the birth is published again until acknowledged (agent.device.birth_pacing).
FEATURES = ("named_models", "signed_engines", "model_sets", "model_pins", "remove_model",
            "revoke_engine", rollcall.ACK_FEATURE)
MAX_RESULT_BYTES = 48 * 1024  # job status <= 64 KiB (protocol.MAX_BYTES) with room to spare


def status_platform(platform: Any, backend: str, backend_problem: Optional[str],
                    labels: Optional[Dict[str, str]] = None,
                    identity: Optional[Dict[str, str]] = None,
                    requires_signed_jobs: Optional[bool] = None) -> Dict[str, Any]:
    """What the birth status, the Will and ``diag`` say of this device's platform and backend;
    ``labels``: the config's (checked there), a claim the controller keeps apart;
    ``identity``: the device's public key (``DeviceKey.identity``); ``requires_signed_jobs``:
    whether it drops unsigned job documents (not ``security.allow_unsigned``)."""
    p = platform
    out = {"board": p.board, "jetpack": p.jetpack, "tensorrt": p.tensorrt,
           "backend": backend, "precisions": p.supported_precisions, "kind": p.kind,
           "l4t": p.l4t, "soc": p.soc, "engine_class": p.engine_class(backend),
           # What this daemon understands beyond the first release (the controller sends
           # model_name/model_version and rollback by name only where it is listed).
           "features": list(FEATURES)}
    if identity:
        out["identity"] = dict(identity)
    if requires_signed_jobs is not None:
        out["requires_signed_jobs"] = bool(requires_signed_jobs)
    if labels:  # an extra key of platform: a controller of the previous release accepts it
        out["labels"] = dict(labels)
    if backend_problem:  # the truth: no backend that runs here
        out["backend"] = None
        out["backend_problem"] = backend_problem[:512]
    return out


class StatusPublisher:
    """The outbox (job states), the birth status and connection loss."""

    def __init__(self, journal: Any, mqtt: Any, topics: Topics, device: str, boot: int,
                 state_dir: str, platform_status: Callable[[], Dict[str, Any]],
                 counters: Dict[str, int], on_job_end: Callable[[], None] = lambda: None
                 ) -> None:
        """``platform_status()``: what the birth status says of the platform (status_platform);
        ``on_job_end()``: called after a job's terminal state is recorded."""
        self.journal = journal
        self.mqtt = mqtt
        self.topics = topics
        self.device = device
        self.boot = boot
        self.state_dir = state_dir
        self.platform_status = platform_status
        self.counters = counters
        self.on_job_end = on_job_end
        self.inflight: Dict[int, Any] = {}
        self.refusals: Dict[int, int] = {}
        self.drops_in_flight: Dict[int, int] = {}  # outbox seq -> connections lost in flight
        self.refused_bytes: Optional[int] = None  # outbox messages this large: refused
        self.dirty = True  # the outbox may hold something unsent: scan it at the next flush
        self.last_scan = 0.0
        self.quick_drops: List[float] = []  # when connections closed right after accepted
        self.last_takeover_log = 0.0
        # The per-name models state (agent.device.models.switch), set once it is built.
        self.models_state: Callable[[], List[Dict[str, Any]]] = lambda: []
        self.models_pins: Callable[[], Dict[str, str]] = lambda: {}  # name -> pinned version
        self.pacer = BirthPacer(device, boot)  # the birth again, until acknowledged

    def _birth(self) -> Dict[str, Any]:
        return status_messages.status_message(
            self.device, True, self.boot, agent_version=__version__,
            platform=self.platform_status(),
            active_engines=list(self.journal.active_engines()),  # type: ignore[arg-type]
            ts=time.time())

    def publish_birth(self) -> None:
        """The retained status (with ``active_engines``), the retained models state and the
        retained roll-call entry (agent.wire.rollcall: how a controller finds this device
        whatever its broker's queue limits; a broker whose ACL predates it drops it, and the
        controller then learns of this device as it did before)."""
        self.mqtt.publish(self.topics.status(self.device),
                          message_caps.encode_fitted("status", self._birth()), qos=1,
                          retain=True)
        self.publish_models()
        self.mqtt.publish(rollcall.topic(self.topics.prefix, self.device),
                          rollcall.encode_marker(self.device, self.boot), qos=1, retain=True)
        self.pacer.published()

    def birth_subscriptions(self) -> List[str]:
        """The controller's call and this device's acknowledgements (agent.wire.rollcall)."""
        prefix = self.topics.prefix
        return [rollcall.call_topic(prefix), rollcall.ack_topic(prefix, self.device)]

    def on_rollcall(self, topic: str, payload: bytes) -> bool:
        """A message on the call or acknowledgement topic; False for any other topic."""
        prefix = self.topics.prefix
        if topic == rollcall.call_topic(prefix):
            self.pacer.on_call(payload)
        elif topic == rollcall.ack_topic(prefix, self.device):
            self.pacer.on_ack(payload)
        else:
            return False
        return True

    def birth_tick(self) -> None:
        """The birth again when its acknowledgement is overdue or a call's slot came."""
        if self.mqtt.connected and self.pacer.due():
            self.publish_birth()

    def models_message(self) -> Dict[str, Any]:
        msg = {"protocol": protocol.PROTOCOL_VERSION, "device": self.device, "boot": self.boot,
               "ts": time.time(), "models": self.models_state()}
        pins = self.models_pins()
        if pins:  # only when there are any: a controller before pins knows no such key
            msg["pins"] = dict(pins)
        return msg

    def publish_models(self) -> None:
        """The retained ``{p}/devices/{id}/models`` (at birth and on every change), and the
        status with today's ``active_engines`` for controllers of the previous release."""
        msg = self.models_message()
        payload = protocol.encode(msg)
        while len(payload) > protocol.MAX_BYTES["models"] and msg["models"]:
            msg["models"] = msg["models"][:len(msg["models"]) // 2]  # never over the cap
            payload = protocol.encode(msg)
        try:
            protocol.validate("models", msg)
        except AgentError as exc:  # a controller would drop it: say so here instead
            log.error("models message does not match its schema, not published: %s", exc)
            return
        self.mqtt.publish(self.topics.models(self.device), payload, qos=1, retain=True)

    def publish_offline(self) -> PublishHandle:
        """The retained offline status of a clean shutdown (the Will says it otherwise)."""
        offline = status_messages.status_message(self.device, False, self.boot,
                                          agent_version=__version__, reason="shutdown",
                                          ts=time.time(), platform=self.platform_status())
        return self.mqtt.publish(self.topics.status(self.device), protocol.encode(offline),
                                 qos=1, retain=True)

    # ------------------------------------------------------------------------- outbox

    def emit(self, row: Dict[str, Any]) -> protocol.Publication:
        return status_messages.job_status_publication(self.topics, self.device, row)

    def set_state(self, run_or_id: Any, state: str, **kwargs: Any) -> None:
        job_id = run_or_id.job_id if isinstance(run_or_id, Run) else run_or_id
        if isinstance(run_or_id, Run) and "details" not in kwargs:
            kwargs["details"] = run_or_id.details
        for key in ("error", "result", "details"):
            if kwargs.get(key) is not None:
                kwargs[key] = message_caps.relative_paths(kwargs[key], self._state_root())
        if kwargs.get("error") is not None:
            kwargs["error"] = message_caps.fit_error(kwargs["error"], MAX_ERROR_BYTES)
        self.journal.set_state(job_id, state, emit=self.emit, **kwargs)
        self.dirty = True
        if protocol.is_terminal(state):
            self.on_job_end()

    def _state_root(self) -> str:
        return os.path.abspath(self.state_dir) if self.state_dir else ""

    def outbox_changed(self) -> None:
        """Something went into the outbox besides ``set_state`` (a job added with its status
        by the journal): scan it at the next flush."""
        self.dirty = True

    def republish(self, row: Dict[str, Any]) -> None:
        pub = self.emit(row)
        self.journal.outbox_put(pub.topic, pub.payload, pub.qos, pub.retain, coalesce=True)
        self.dirty = True

    def flush(self) -> None:
        now = time.monotonic()
        if not self.mqtt.connected:
            return
        if not self.dirty and now - self.last_scan < 5.0:
            return
        self.dirty = False
        self.last_scan = now
        for item in self.journal.outbox_pending(limit=OUTBOX_BATCH + len(self.inflight)):
            if item.seq in self.inflight:
                continue
            if len(self.inflight) >= OUTBOX_BATCH:
                self.dirty = True
                break
            payload = item.payload
            refused = self.refused_bytes is not None and len(payload) >= self.refused_bytes
            if refused or not self.mqtt.fits(item.topic, payload):
                short = self._shorten(item.seq, item.topic, payload,
                                      "over the broker's maximum packet size ({} bytes)".format(
                                          self.mqtt.server_max_packet or "a {}-byte message was "
                                          "refused".format(self.refused_bytes)))
                if short is None or not self.mqtt.fits(item.topic, short):
                    log.error("outbox message %d on %s does not fit the broker's maximum packet "
                              "size even shortened; dropping it", item.seq, item.topic)
                    self.journal.outbox_ack(item.seq)
                    continue
                payload = short
            self.inflight[item.seq] = self.mqtt.publish(item.topic, payload, qos=item.qos,
                                                        retain=item.retain,
                                                        token=("outbox", item.seq))

    def _shorten(self, seq: int, topic: str, payload: bytes, why: str) -> Optional[bytes]:
        """Replace outbox message ``seq`` by its short form; the short payload, or None when
        there is none shorter (not a job status, or already short)."""
        short = message_caps.short_job_status_payload(payload)
        if short is None or len(short) >= len(payload):
            return None
        if not self.journal.outbox_replace(seq, short):
            return None
        log.error("outbox message %d on %s (%d bytes) %s: replaced by its short form (%d bytes)",
                  seq, topic, len(payload), why, len(short))
        return short

    def _retry_short(self, seq: int, why: str) -> bool:
        """Swap a refused in-flight message for its short form (sent at the next flush); False
        when it has none."""
        handle = self.inflight.get(seq)
        item = next((i for i in self.journal.outbox_pending(limit=OUTBOX_BATCH * 2)
                     if i.seq == seq), None)
        if item is None:  # superseded (a newer status of the job took its place): forget it
            log.warning("outbox message %d, no longer pending, %s: not sent again", seq, why)
        elif self._shorten(seq, item.topic, item.payload, why) is None:
            return False
        if handle is not None:
            self.mqtt.abandon(handle)
        self.inflight.pop(seq, None)
        self.refusals.pop(seq, None)
        self.dirty = True
        return True

    def on_published(self, ev: Event) -> None:
        token = ev.token
        if not (isinstance(token, tuple) and token[0] == "outbox"):
            return
        seq = int(token[1])
        self.inflight.pop(seq, None)
        self.drops_in_flight.pop(seq, None)
        if ev.ok:
            self.journal.outbox_ack(seq)
            self.refusals.pop(seq, None)
            return
        count = self.refusals.get(seq, 0) + 1
        self.refusals[seq] = count
        if count >= MAX_PUBLISH_REFUSALS:
            if self._retry_short(seq, "refused by the broker {} times ({})".format(
                    count, ev.reason)):
                return
            log.error("broker refused outbox message %d %d times (%s); dropping it", seq, count,
                      ev.reason)
            self.journal.outbox_ack(seq)
            self.refusals.pop(seq, None)
        else:
            self.dirty = True

    def _outbox_connection_lost(self) -> None:
        """The connection dropped: each message then in flight counts one try; one in flight
        at MAX_DROPS_IN_FLIGHT drops in a row goes out in its short form (a broker closes the
        connection on a packet it refuses). A short message is never dropped for this: a
        flapping network must not lose a status."""
        for seq, handle in list(self.inflight.items()):
            if getattr(handle, "size", SMALL_STATUS_BYTES + 1) <= SMALL_STATUS_BYTES:
                continue
            count = self.drops_in_flight.get(seq, 0) + 1
            self.drops_in_flight[seq] = count
            if count >= MAX_DROPS_IN_FLIGHT and self._retry_short(
                    seq, "was in flight at {} dropped connections".format(count)):
                self.drops_in_flight.pop(seq, None)
                # A message this large is taken for refused from now on (the broker did not
                # say its limit): later ones, a status sent again included, go out short.
                size = int(getattr(handle, "size", 0))
                self.refused_bytes = min(self.refused_bytes or size, size)
        if len(self.drops_in_flight) > 4 * OUTBOX_BATCH:  # acked entries leave; bound the rest
            for seq in list(self.drops_in_flight)[:-OUTBOX_BATCH]:
                del self.drops_in_flight[seq]

    # ------------------------------------------------------------------------- connection

    def connection_lost(self, ev: Event) -> None:
        """The connection dropped (``ev`` is the DISCONNECTED event): count the outbox's
        tries, and surface a session takeover (another client connected with this device's
        client id) in the log and in ``jetson-agent status``. A broker that says so sends
        DISCONNECT "Session taken over" (MQTT v5, 0x8E); one that only closes the socket
        (Mosquitto 2.0.11 does) shows the same as connections closed right after being
        accepted, again and again: reported as a suspected takeover."""
        self._outbox_connection_lost()
        now = time.monotonic()
        confirmed = ev.code == SESSION_TAKEN_OVER
        if not confirmed:
            if ev.code is not None or ev.held_s is None or ev.held_s > QUICK_DROP_S:
                self.quick_drops.clear()
                return
            self.quick_drops = [t for t in self.quick_drops if now - t < 60.0] + [now]
            if len(self.quick_drops) < QUICK_DROPS:
                return
            self.quick_drops.clear()
        self.counters["session_taken_over"] += 1
        previous = self.journal.note("connection") or {}
        count = int(previous.get("taken_over", 0) or 0) + 1
        self.journal.note_put("connection", {
            "taken_over": count, "last_taken_over": time.time(), "client_id": self.device,
            "confirmed": confirmed, "reason": ev.reason})
        if now - self.last_takeover_log >= 60.0 or count == 1:
            self.last_takeover_log = now
            log.error("session_taken_over: the broker at %s %s (%d time(s) so far): another "
                      "client connects with this device's client id %r (another device with "
                      "this id, or its key leaked); the broker should bind client ids to "
                      "identities (use_username_as_clientid, docs/security.md)%s",
                      self.mqtt.address, "closed this connection: session taken over (MQTT "
                      "reason 0x8E)" if confirmed else "keeps closing this connection right "
                      "after accepting it", count, self.device,
                      "" if confirmed else "; or it refuses a packet we send (see its log)")


def fit_result(result: Dict[str, Any], limit: int = MAX_RESULT_BYTES) -> Dict[str, Any]:
    """Drop the largest entries of a result until its JSON fits ``limit`` bytes; the names of
    the dropped entries are listed under ``truncated`` (the worker's log has everything)."""
    result = dict(result)
    if len(protocol.encode(result)) <= limit:
        return result
    # Each entry's size is measured once: dropping one does not change the others'.
    sizes = {k: len(protocol.encode({k: v})) for k, v in result.items() if k != "truncated"}
    dropped: List[str] = []
    for key in sorted(sizes, key=lambda k: sizes[k], reverse=True):
        del result[key]
        dropped.append(key)
        result["truncated"] = sorted(dropped)
        if len(protocol.encode(result)) <= limit:
            break
    return result
