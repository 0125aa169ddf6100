"""A check at the moment of sending for ``agent.wire.mqtt.MqttClient``: every QoS >= 1 message
carries a fence key, and just before paho writes packets to its socket (on paho's network
thread), and again before each packet's bytes, each key with messages still outstanding is
asked whether its messages may go. Those of a refused key are dropped from paho's queues (not
yet written, queued behind the in-flight window, or waiting for a PUBACK, which would be sent
again after a reconnect): never sent, never resent, their handles fail. A controller uses it
to send nothing once its lease may have gone (agent.fleet.database.leases), however long its
main thread was held up before noticing.

Works on paho's queues (``_out_packet``, ``_out_messages``) by duck typing, without importing
paho; another paho without them leaves the gate open (``supported``).
"""

import collections
import sys
import threading
from typing import Any, Callable, Dict, List, Set, Tuple

PUBLISH = 0x30  # the packet type, upper four bits of the fixed header


class SendGate(object):
    """``check(key) -> bool`` decides, cheaply and without I/O, whether ``key``'s messages may
    be written now. ``record`` (under ``lock``, with paho's publish) and ``done`` (its PUBACK)
    keep the keys of the messages outstanding; ``before_write`` drops the refused ones. Only
    QoS >= 1 messages are recorded (a QoS 0 one has no PUBACK to end its record)."""

    def __init__(self, check: Callable[[Any], bool]) -> None:
        self.check = check
        # Held from a message's hand-over to paho until its key is recorded, and over each
        # write: a packet is written only after its key was looked at.
        self.lock = threading.RLock()
        self._key_of: Dict[int, Any] = {}  # mid -> key
        self._live: Dict[Any, int] = {}  # key -> messages outstanding
        self.dropped: Dict[Any, int] = {}  # key -> messages dropped, until ``take_dropped``
        # Acknowledged mids, handed over without the lock (paho acknowledges holding its own
        # queue's lock, which a publish takes inside ours): forgotten at the next record/write.
        self._acked: "collections.deque[int]" = collections.deque()

    @staticmethod
    def supported(client: Any) -> bool:
        paho = sys.modules.get(type(client).__module__)
        return hasattr(paho, "mqtt_ms_wait_for_puback") and all(
            hasattr(client, a) for a in ("_out_packet", "_out_messages", "_out_message_mutex",
                                         "_inflight_messages", "_update_inflight",
                                         "_packet_write", "_sock_send"))

    def record(self, mid: int, key: Any) -> None:
        self._drain()
        self._key_of[mid] = key
        self._live[key] = self._live.get(key, 0) + 1

    def done(self, mid: int) -> None:
        self._acked.append(mid)

    def _drain(self) -> None:
        while self._acked:
            self._forget(self._acked.popleft())

    def _forget(self, mid: int) -> Any:
        if mid not in self._key_of:
            return None
        key = self._key_of.pop(mid)
        n = self._live.get(key, 0) - 1
        if n > 0:
            self._live[key] = n
        else:
            self._live.pop(key, None)
        return key

    def refuses_any(self) -> bool:
        """(Call with ``lock`` held.) Whether a key with messages outstanding is refused now."""
        return any(not self.check(k) for k in list(self._live))

    def take_dropped(self) -> Dict[Any, int]:
        with self.lock:
            out, self.dropped = self.dropped, {}
        return out

    def before_write(self, client: Any) -> Tuple[List[int], bool]:
        """(Call with ``lock`` held.) Drop the messages of the keys ``check`` refuses now.
        Returns their mids and whether one of them was partly written already (the caller
        closes the connection: the broker discards a packet cut short)."""
        self._drain()
        shut: Set[Any] = {k for k in list(self._live) if not self.check(k)}
        if not shut:
            return [], False
        mids = [mid for mid, key in self._key_of.items() if key in shut]
        gone = set(mids)
        cut = False
        paho = sys.modules[type(client).__module__]  # its message states, by name
        in_flight = (paho.mqtt_ms_wait_for_puback, paho.mqtt_ms_wait_for_pubrec)
        with client._out_message_mutex:  # paho's publish appends under it
            for mid in mids:
                msg = client._out_messages.pop(mid, None)
                if msg is not None and msg.state in in_flight:
                    client._inflight_messages -= 1
            queue = client._out_packet
            for _ in range(len(queue)):  # in place: packets appended meanwhile stay
                pkt = queue.popleft()
                if pkt["command"] & 0xF0 == PUBLISH and pkt["mid"] in gone:
                    if pkt["pos"] == 0:
                        continue
                    cut = True
                queue.append(pkt)
            client._update_inflight()  # the window the dropped ones held, to the others
        for mid in mids:
            key = self._forget(mid)
            self.dropped[key] = self.dropped.get(key, 0) + 1
        return mids, cut
