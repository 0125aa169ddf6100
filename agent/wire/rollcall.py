"""The roll call's wire part: where a device's retained roll-call entry lives and what it says.

A broker hands the retained messages matching a new subscription to one session queue; Mosquitto
drops what does not fit (``max_queued_messages``, 1000 in the shipped config, plus
``max_inflight_messages``), so a controller subscribing to ``{p}/devices/+/status`` learns of
about 1,100 devices however many there are. Each device therefore also keeps a small retained
entry under ``{p}/rollcall/{h1}/{h2}/{device}``, where ``h1 h2`` are the first two hex digits of
the SHA-256 of its id: 256 buckets a controller can subscribe to a few at a time, each page
small enough for any queue (``agent.fleet.admission.rollcall`` pages through them). Pure.
"""

import hashlib
import json
from typing import Any, Dict, Optional, Tuple

from agent.wire import protocol

HEX = "0123456789abcdef"
MARKER_MAX_BYTES = 512


def bucket(device: str) -> Tuple[str, str]:
    """The two hex digits (levels) of the device's roll-call bucket."""
    digest = hashlib.sha256(device.encode("utf-8")).hexdigest()
    return digest[0], digest[1]


def topic(prefix: str, device: str) -> str:
    """``{prefix}/rollcall/{h1}/{h2}/{device}``: the device's retained roll-call entry."""
    h1, h2 = bucket(protocol.check_id("device id", device))
    return "{}/rollcall/{}/{}/{}".format(prefix, h1, h2, device)


def page_filter(prefix: str, h1: str, h2: Optional[str] = None) -> str:
    """The entries of one bucket (``h2`` given) or of sixteen (``h1`` only)."""
    return "{}/rollcall/{}/{}/+".format(prefix, h1, h2 if h2 is not None else "+")


def mark_topic(prefix: str, client_id: str) -> str:
    """Where a sweeping controller publishes the mark that ends a page: the broker delivers a
    session's messages in order, so the mark arrives after the page's retained entries (and is
    dropped with them when the page overflowed the session's queue)."""
    return "{}/rollcall/mark/{}".format(prefix, protocol.check_id("client id", client_id))


def marker(device: str, boot: int) -> Dict[str, Any]:
    """A device's entry: its id and boot counter (a controller that knows an older boot, or
    none, reads the device's retained status)."""
    return {"protocol": protocol.PROTOCOL_VERSION, "device": device, "boot": int(boot)}


def encode_marker(device: str, boot: int) -> bytes:
    return protocol.encode(marker(device, boot))


def parse_entry(prefix: str, topic_name: str, payload: bytes) -> Optional[Tuple[str, int]]:
    """(device, boot) of a roll-call entry, or None for anything else (a wrong bucket, a bad
    id, a payload that is not a marker of that device): an entry is only a hint, the device's
    status is what the registry records."""
    parts = topic_name.split("/")
    head = prefix.split("/")
    n = len(head)
    if parts[:n] != head or len(parts) != n + 4 or parts[n] != "rollcall":
        return None
    device = parts[n + 3]
    if not protocol.valid_id(device) or bucket(device) != (parts[n + 1], parts[n + 2]):
        return None
    if not payload or len(payload) > MARKER_MAX_BYTES:
        return None
    try:
        msg = json.loads(bytes(payload).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(msg, dict):
        return None
    boot = msg.get("boot")
    if msg.get("device") != device or not isinstance(boot, int) or isinstance(boot, bool) \
            or boot < 0:
        return None
    return device, boot


# -- births acknowledged, answers paced ---------------------------------------------------------
# A device listing ACK_FEATURE in its birth's ``platform.features`` keeps publishing its birth
# until the controller acknowledges it on ``ack_topic`` (the registry holds it then); a device
# that does not list it is never sent an acknowledgement and publishes its birth once, as
# before. The controller's retained *call* (``call_topic``) says the window over which the
# fleet answers: each device answers (its birth again) at its own slot of that window, a
# fraction fixed by its id's hash, so the answers reach the controller's session queue at the
# rate the window was sized for instead of all at once (Mosquitto drops what does not fit).
# A device retries only once it heard a call: before, no controller that acknowledges is
# known to run, and one starting reads the births it missed by its roll call.

ACK_FEATURE = "birth_ack"
# Births a window is sized for: each is up to three messages (status, models, entry), each
# checked (a signature) by a controller that also serves rollouts meanwhile.
ANSWERS_PER_S = 250.0
MIN_WINDOW_S = 1.0
MAX_WINDOW_S = 600.0
# The first wait for an acknowledgement, doubled at each retry up to MAX_BACKOFF_S (plus the
# device's slot of the window). Births the broker dropped are also read by the controller's
# roll call (their retained copies); the retries are for what that misses.
ACK_WAIT_S = 30.0
MAX_BACKOFF_S = 300.0
ACK_MAX_BYTES = 512
TOKEN_MAX = 64


def call_topic(prefix: str) -> str:
    """``{prefix}/rollcall/call``: the controller's retained call (its token and window)."""
    return "{}/rollcall/call".format(prefix)


def ack_topic(prefix: str, device: str) -> str:
    """``{prefix}/rollcall/ack/{device}``: where the controller acknowledges a birth."""
    return "{}/rollcall/ack/{}".format(prefix, protocol.check_id("device id", device))


def window_for(devices: int) -> float:
    """The answer window for a fleet of ``devices``: ANSWERS_PER_S answers a second."""
    return min(MAX_WINDOW_S, max(MIN_WINDOW_S, devices / ANSWERS_PER_S))


def slot(device: str) -> float:
    """The device's place in any window, in [0, 1): from its id's hash, so a fleet spreads
    evenly and a device answers at the same place every time."""
    return int(hashlib.sha256(device.encode("utf-8")).hexdigest()[:8], 16) / float(1 << 32)


def retry_delay(device: str, attempt: int, window_s: float, ack_wait_s: float = ACK_WAIT_S,
                max_backoff_s: float = MAX_BACKOFF_S) -> float:
    """How long after publishing its birth (``attempt`` 0: the first time) a device not yet
    acknowledged publishes it again: a doubling wait, capped, plus its slot of the window."""
    backoff = min(max_backoff_s, ack_wait_s * (2 ** min(max(0, attempt), 20)))
    return backoff + slot(device) * max(0.0, window_s)


def encode_call(token: str, window_s: float) -> bytes:
    return protocol.encode({"protocol": protocol.PROTOCOL_VERSION, "call": token,
                            "window_s": round(float(window_s), 3)})


def encode_ack(device: str, boot: int, call: Optional[str], window_s: float) -> bytes:
    """The controller's acknowledgement of ``device``'s birth of ``boot``; ``call``: the
    call current when it was recorded (the device need not answer that call again)."""
    return protocol.encode({"protocol": protocol.PROTOCOL_VERSION, "device": device,
                            "boot": int(boot), "call": call,
                            "window_s": round(float(window_s), 3)})


def _small_json(payload: bytes) -> Optional[Dict[str, Any]]:
    if not payload or len(payload) > ACK_MAX_BYTES:
        return None
    try:
        msg = json.loads(bytes(payload).decode("utf-8"))
    except (ValueError, UnicodeDecodeError):
        return None
    return msg if isinstance(msg, dict) else None


def _window(msg: Dict[str, Any]) -> Optional[float]:
    w = msg.get("window_s")
    if not isinstance(w, (int, float)) or isinstance(w, bool) or not w == w:
        return None
    return min(MAX_WINDOW_S, max(0.0, float(w)))


def _token(value: Any) -> Optional[str]:
    return value if isinstance(value, str) and 0 < len(value) <= TOKEN_MAX else None


def parse_call(payload: bytes) -> Optional[Tuple[str, float]]:
    """(token, window_s) of a call, or None for anything else (bounded: a device reads it)."""
    msg = _small_json(payload)
    if msg is None:
        return None
    token, window = _token(msg.get("call")), _window(msg)
    return (token, window) if token is not None and window is not None else None


def parse_ack(device: str, payload: bytes) -> Optional[Tuple[int, Optional[str], float]]:
    """(boot, call, window_s) of an acknowledgement of ``device``'s birth, or None."""
    msg = _small_json(payload)
    if msg is None or msg.get("device") != device:
        return None
    boot, window = msg.get("boot"), _window(msg)
    if not isinstance(boot, int) or isinstance(boot, bool) or boot < 0 or window is None:
        return None
    return boot, _token(msg.get("call")), window
