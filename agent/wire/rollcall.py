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
