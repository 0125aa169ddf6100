"""Every message the agent builds fits its topic's limit (``protocol.MAX_BYTES``) by
construction, far below any broker's ``max_packet_size``: a worker error naming a 2 MB output,
or a gate failure listing 30,000 outputs, must never become a status the broker refuses (it
disconnects the device on every resend, and the outbox never drains).

``fit_message`` cuts long texts with a marker saying how much was cut and summarises long
lists (the first items, then a marker string for lists of strings), tighter and tighter until
the message fits; ``short_job_status`` is the last resort the outbox falls back to: the job's
id, state, version and error code with a short message. Pure; the journal keeps the whole
error and result, and the worker's log everything else.
"""

import json
from typing import Any, Dict, Mapping, Optional, Tuple

from agent.wire import protocol

CUT_MARKER = " [... {} more characters cut]"
LIST_MARKER = "[... {} more items]"
KEYS_MARKER = "..."  # the key summarising the keys cut from a mapping
# (longest string, most items per list or mapping), tried in order until a message fits.
STEPS: Tuple[Tuple[int, int], ...] = ((4096, 256), (1024, 64), (256, 16), (64, 4))
SHORT_MESSAGE = 512  # characters of an error message in a short job status
# statusDetails (job_status.json): at most 64 entries, keys of 128, values of 1024 characters.
DETAILS_MAX = (64, 128, 1024)
ENVELOPE = 512  # room for the MQTT fixed header, topic and properties of a publish


def cut_text(text: str, limit: int) -> str:
    """``text`` if at most ``limit`` characters, else its start and a marker saying how many
    characters were cut (the whole stays at most ``limit``, or the marker's length)."""
    if len(text) <= limit:
        return text
    keep = max(0, limit - len(CUT_MARKER.format(len(text))))
    return text[:keep] + CUT_MARKER.format(len(text) - keep)


def shrink(value: Any, max_str: int, max_items: int, depth: int = 0) -> Any:
    """A copy of a JSON-ready value with strings cut to ``max_str`` characters and lists and
    mappings summarised to ``max_items`` entries; nesting past 32 levels becomes a marker."""
    if depth > protocol.MAX_DEPTH:
        return "[... nested too deep]"
    if isinstance(value, str):
        return cut_text(value, max_str)
    if isinstance(value, (list, tuple)):
        items = [shrink(v, max_str, max_items, depth + 1) for v in value[:max_items]]
        if len(value) > max_items and all(isinstance(v, str) for v in value):
            items.append(LIST_MARKER.format(len(value) - max_items))
        return items
    if isinstance(value, Mapping):
        keys = sorted(value, key=str)
        kept = keys if len(keys) <= max_items else keys[:max(0, max_items - 1)]
        out = {cut_text(str(k), max(16, max_str)): shrink(value[k], max_str, max_items,
                                                           depth + 1)
               for k in kept}
        if len(kept) < len(keys):  # the marker takes the last place: at most max_items keys
            out[KEYS_MARKER] = "{} more keys".format(len(keys) - len(kept))
        return out
    return value


def relative_paths(value: Any, root: str, depth: int = 0) -> Any:
    """A copy of ``value`` whose strings name paths under ``root`` (the state directory)
    relative to it: statuses leave the device, its directory layout need not."""
    root = root.rstrip("/")
    if not root or depth > protocol.MAX_DEPTH:
        return value
    if isinstance(value, str):
        if root not in value:
            return value
        return value.replace(root + "/", "").replace(root, ".")
    if isinstance(value, (list, tuple)):
        return [relative_paths(v, root, depth + 1) for v in value]
    if isinstance(value, Mapping):
        return {k: relative_paths(v, root, depth + 1) for k, v in value.items()}
    return value


def _size(msg: Mapping[str, Any]) -> int:
    return len(protocol.encode(msg))


def fit_message(kind: str, msg: Mapping[str, Any], limit: Optional[int] = None,
                keep: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """``msg`` made to encode within ``limit`` bytes (default ``MAX_BYTES[kind]``): unchanged
    when it fits, else its nested values shrunk step by step (top-level keys in ``keep`` are
    never touched). ValueError when even the tightest step does not fit (a bug: every message
    the agent builds has a small fixed part)."""
    limit = protocol.MAX_BYTES[kind] if limit is None else limit
    msg = dict(msg)
    if _size(msg) <= limit:
        return msg
    for max_str, max_items in STEPS:
        out = {k: v if k in keep else shrink(v, max_str, max_items) for k, v in msg.items()}
        if _size(out) <= limit:
            return out
    raise ValueError("a {} message does not fit {} bytes even shrunk".format(kind, limit))


def fit_details(details: Mapping[str, Any]) -> Dict[str, str]:
    """statusDetails within its schema: strings, at most 64 entries, bounded keys and values."""
    count, key_len, value_len = DETAILS_MAX
    out: Dict[str, str] = {}
    for k in sorted(details, key=str)[:count]:
        out[cut_text(str(k), key_len)] = cut_text(str(details[k]), value_len)
    return out


def fit_error(error: Optional[Mapping[str, Any]],
              limit: int = protocol.MAX_BYTES["job_status"] // 2) -> Optional[Dict[str, Any]]:
    """A job error (code, message, details) within ``limit`` bytes; the code is kept whole."""
    if error is None:
        return None
    out = {k: v for k, v in error.items()}
    if _size(out) <= limit:
        return out
    message = out.get("message")
    if isinstance(message, str):
        out["message"] = cut_text(message, min(len(message), limit // 2))
    for max_str, max_items in STEPS:
        if _size(out) <= limit:
            break
        if "details" in out:
            out["details"] = shrink(out["details"], max_str, max_items)
        if isinstance(out.get("message"), str):
            out["message"] = cut_text(out["message"], max(SHORT_MESSAGE, max_str))
    if _size(out) > limit:
        out.pop("details", None)
        out["message"] = cut_text(str(out.get("message", "")), SHORT_MESSAGE)
    return out


def short_job_status(msg: Mapping[str, Any]) -> Dict[str, Any]:
    """The smallest valid version of a job status: ids, kind, state, version, time, stage,
    progress, and the error's code with a cut message; no result, no details beyond the error
    code. What the outbox stores when a status does not fit, or the broker keeps refusing it."""
    keys = ("protocol", "job_id", "device", "kind", "state", "version", "ts", "stage",
            "progress")
    out: Dict[str, Any] = {k: msg[k] for k in keys if k in msg}
    out["kind"] = cut_text(str(out.get("kind") or ""), 64)
    details: Dict[str, str] = {"truncated": "true"}
    error = msg.get("error")
    if isinstance(error, Mapping):
        code = error.get("code")
        out["error"] = {"code": code if isinstance(code, str) and len(code) <= 64
                        else "internal_error",
                        "message": cut_text(str(error.get("message", "")), SHORT_MESSAGE)}
        details["error_code"] = out["error"]["code"]
    elif out.get("state") in ("FAILED", "REJECTED", "TIMED_OUT"):
        out["error"] = {"code": "internal_error", "message": "the status was too large"}
    out["statusDetails"] = details
    return out


def short_job_status_payload(payload: bytes) -> Optional[bytes]:
    """``short_job_status`` of an encoded job status; None when ``payload`` is not one."""
    try:
        msg = json.loads(bytes(payload).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(msg, dict) or not protocol.valid_id(msg.get("job_id")) or \
            msg.get("state") not in protocol.STATES:
        return None
    return protocol.encode(short_job_status(msg))


def packet_bytes(topic: str, payload: bytes) -> int:
    """An upper bound on the MQTT PUBLISH packet carrying ``payload`` on ``topic``."""
    return len(payload) + len(topic.encode("utf-8")) + ENVELOPE


def encode_fitted(kind: str, msg: Mapping[str, Any], keep: Tuple[str, ...] = ()) -> bytes:
    """``protocol.encode`` of ``fit_message(kind, msg)``, keeping the top-level scalars whole:
    what the daemon publishes outside the outbox (birth status, telemetry, command replies)."""
    keep = tuple(k for k, v in msg.items() if not isinstance(v, (dict, list))) + keep
    return protocol.encode(fit_message(kind, msg, protocol.MAX_BYTES[kind] - ENVELOPE,
                                       keep=keep))
