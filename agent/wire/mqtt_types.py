"""The values the MQTT edge (``mqtt``) takes and gives, without paho (Python >= 3.8): the
``Event`` it queues (its ``kind`` one of ``mqtt``'s event kinds), the ``Will`` and
``TlsOptions`` it connects with, the ``PublishHandle`` a publish returns.
"""

import threading
from typing import Any, List, Optional, Tuple


class Event:
    __slots__ = ("kind", "topic", "payload", "retain", "qos", "token", "ok", "reason",
                 "session_present", "response_topic", "correlation", "code", "held_s",
                 "user_properties")

    def __init__(self, kind: str, topic: str = "", payload: bytes = b"", retain: bool = False,
                 qos: int = 0, token: Any = None, ok: bool = True, reason: str = "",
                 session_present: bool = False, response_topic: Optional[str] = None,
                 correlation: Optional[bytes] = None, code: Optional[int] = None,
                 held_s: Optional[float] = None,
                 user_properties: Optional[List[Tuple[str, str]]] = None) -> None:
        self.kind, self.topic, self.payload, self.retain = kind, topic, payload, retain
        self.qos, self.token, self.ok, self.reason = qos, token, ok, reason
        self.session_present = session_present
        self.response_topic = response_topic  # MQTT v5 request/response properties
        self.correlation = correlation
        self.code = code  # the reason code of a DISCONNECT the broker sent (v5), else None
        self.held_s = held_s  # how long the connection a DISCONNECTED event ends had lasted
        self.user_properties = user_properties or []  # MQTT v5 (a device's report signature)

    def nbytes(self) -> int:
        """Memory this event holds, roughly (the daemon bounds its queue by it)."""
        return len(self.payload) + len(self.topic) + 200

    def __repr__(self) -> str:
        return "Event({}, topic={!r}, {} bytes, token={!r}, reason={!r})".format(
            self.kind, self.topic, len(self.payload), self.token, self.reason)


class Will:
    def __init__(self, topic: str, payload: bytes, qos: int = 1, retain: bool = True,
                 user_properties: Optional[List[Tuple[str, str]]] = None) -> None:
        self.topic, self.payload, self.qos, self.retain = topic, payload, qos, retain
        self.user_properties = list(user_properties or [])  # MQTT v5 Will properties


class TlsOptions:
    def __init__(self, ca_file: Optional[str] = None, cert_file: Optional[str] = None,
                 key_file: Optional[str] = None, insecure: bool = False) -> None:
        self.ca_file, self.cert_file, self.key_file = ca_file, cert_file, key_file
        self.insecure = insecure


# Guards the events of every PublishHandle: made only for a caller that waits (a fleet service
# publishes hundreds of thousands of messages and waits for none; an event each was 3 % of it).
_WAITERS = threading.Lock()


class PublishHandle:
    """One publish. ``wait(timeout)`` -> True once the broker acknowledged it (QoS 0: once it
    was written to the socket); ``ok`` is False when the broker refused it (v5 reason code)."""

    def __init__(self, topic: str, token: Any) -> None:
        self.topic = topic
        self.token = token
        self.mid = 0
        self.size = 0  # payload bytes
        self.ok = False
        self.reason = ""
        self._acked = False
        self._event: Optional[threading.Event] = None

    @property
    def acked(self) -> bool:
        return self._acked

    def wait(self, timeout: Optional[float] = None) -> bool:
        with _WAITERS:
            if self._acked:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def _finish(self, ok: bool, reason: str) -> None:
        self.ok, self.reason = ok, reason
        with _WAITERS:
            self._acked = True
            event = self._event
        if event is not None:
            event.set()
