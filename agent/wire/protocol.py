"""The MQTT protocol's core: its vocabulary, ids, the message codec and the artifact blocks.

Pure: no paho, no files except the JSON Schemas shipped in ``agent/data/schemas/`` (the contract
for controllers in other languages; ``docs/protocol.md`` describes it), checked through
``json_schema`` (fastjsonschema; each kind compiled once, on first use). Around this core:
``topics`` (topic names), ``job_document`` (a job beyond its schema), ``status_messages``
(device, job and command-reply messages).
"""

import base64
import binascii
import json
import math
import os
import re
import threading
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple, Union

from agent.errors import AgentError
from agent.wire.json_schema import Validator, json_type, short

PROTOCOL_VERSION = 1

JOB_KINDS = ("deploy", "search", "bench", "cancel")
ARTIFACT_ROLES = ("model", "calibration", "inputs", "goldens", "labels", "plugin", "engine")
STATES = ("QUEUED", "IN_PROGRESS", "SUCCEEDED", "FAILED", "REJECTED", "CANCELED", "TIMED_OUT")
TERMINAL_STATES = frozenset(("SUCCEEDED", "FAILED", "REJECTED", "CANCELED", "TIMED_OUT"))
STAGES = ("downloading", "checking", "calibrating", "building", "verifying", "searching",
          "benchmarking", "activating", "committing")
COMMANDS = ("cancel", "diag", "rollback", "remove", "revoke_engine")

MESSAGE_KINDS = ("status", "job", "job_status", "artifact_request", "telemetry", "command",
                 "command_reply", "models")
# Largest accepted payload per message kind (AWS IoT Jobs caps job documents at 32 KB).
MAX_BYTES = {
    "status": 64 * 1024,
    "job": 32 * 1024,
    "job_status": 64 * 1024,
    "artifact_request": 256 * 1024,
    "telemetry": 64 * 1024,
    "command": 8 * 1024,
    "command_reply": 256 * 1024,
    "models": 64 * 1024,  # at most 256 names (agent/data/schemas/models.json)
}
MAX_DEPTH = 32  # nesting of JSON containers; deeper payloads are rejected before validation

DEFAULT_BLOCK_SIZE = 128 * 1024
MIN_BLOCK_SIZE = 1024
MAX_BLOCK_SIZE = 1024 * 1024
MAX_BLOCKS = 1 << 20

Bits = Union[bytes, bytearray]  # a block bitmap

# Allowed job state changes (AWS IoT Jobs): None is "not yet known to the device".
_TRANSITIONS = {
    None: ("QUEUED", "REJECTED"),
    "QUEUED": ("IN_PROGRESS", "REJECTED", "CANCELED", "TIMED_OUT", "FAILED"),
    "IN_PROGRESS": ("IN_PROGRESS", "SUCCEEDED", "FAILED", "REJECTED", "CANCELED", "TIMED_OUT"),
}

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")

SCHEMA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "data", "schemas")


class Publication(NamedTuple):
    """One message to publish (what the journal's outbox stores)."""

    topic: str
    payload: bytes
    qos: int
    retain: bool


# ---------------------------------------------------------------------------- ids

def valid_id(value: Any) -> bool:
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def check_id(what: str, value: Any) -> str:
    if not valid_id(value):
        raise AgentError(
            "bad_message",
            "{} must be 1-64 characters of [A-Za-z0-9._-] starting with a letter or digit, "
            "found {}".format(what, short(value)),
        )
    return value


def valid_sha256(value: Any) -> bool:
    return isinstance(value, str) and _SHA_RE.fullmatch(value) is not None


def check_sha256(value: Any) -> str:
    if not valid_sha256(value):
        raise AgentError("bad_message", "a sha256 must be 64 lowercase hex digits, found {}"
                         .format(short(value)))
    return value


# ---------------------------------------------------------------------------- encode / decode

def _plain(value: Any, depth: int = 0) -> Any:
    """JSON-ready copy: tuples -> lists, numpy values -> Python, non-finite floats -> None."""
    if depth > 64:
        raise AgentError("internal_error", "message nests deeper than 64 levels")
    t = type(value)  # the usual types by identity: isinstance against typing's Mapping is slow
    if t is str or t is int or t is bool or value is None:
        return value
    if t is dict:
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy scalars and arrays, without importing numpy
    if callable(tolist):
        return _plain(tolist(), depth + 1)
    raise AgentError("internal_error", "cannot encode {} in a message".format(type(value)))


def encode(msg: Mapping[str, Any]) -> bytes:
    """Compact UTF-8 JSON with sorted keys; non-finite numbers become null."""
    return json.dumps(_plain(msg), separators=(",", ":"), sort_keys=True, ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError("duplicate key {!r}".format(key))
        out[key] = value
    return out


def _finite(text: str) -> Union[int, float]:
    """A JSON number with a fraction or exponent; an integral one decodes as an int (JSON
    Schema calls 1.0 an integer: what passes ``"type": "integer"`` is then a Python int)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("number {} is out of range".format(text[:20]))
    return int(value) if value.is_integer() else value


def _no_constant(name: str) -> Any:
    raise ValueError("{} is not JSON".format(name))


def _depth(value: Any) -> int:
    """Nesting depth of containers, iteratively (a hostile payload must not recurse us)."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, d = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, d)
        if deepest > MAX_DEPTH:
            return deepest
        # Only containers go on the stack (a message is mostly scalars).
        stack.extend((child, d + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def decode(kind: str, payload: bytes, max_bytes: Optional[int] = None) -> Dict[str, Any]:
    """Parse and validate one message of ``kind`` (one of MESSAGE_KINDS).

    AgentError ``message_too_large`` (over ``max_bytes``, default MAX_BYTES[kind]),
    ``unknown_job_kind`` (a job document whose kind is not in JOB_KINDS) or ``bad_message``
    (not UTF-8, not a JSON object, duplicate keys, NaN, too deep, schema violation)."""
    if kind not in MESSAGE_KINDS:
        raise ValueError("unknown message kind {!r}".format(kind))
    limit = MAX_BYTES[kind] if max_bytes is None else max_bytes
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise AgentError("bad_message", "expected a {} payload as bytes, found {}".format(
            kind, type(payload).__name__))
    if len(payload) > limit:
        raise AgentError("message_too_large", "a {} message may be at most {} bytes, found {}"
                         .format(kind, limit, len(payload)))
    try:
        text = bytes(payload).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise AgentError("bad_message", "expected a UTF-8 JSON {} message, found invalid UTF-8 "
                         "at byte {}".format(kind, exc.start))
    try:
        msg = json.loads(text, object_pairs_hook=_no_duplicates, parse_float=_finite,
                         parse_constant=_no_constant)
    except RecursionError:
        raise AgentError("bad_message", "expected a {} JSON object, found nesting too deep"
                         .format(kind))
    except ValueError as exc:  # JSONDecodeError, duplicates, NaN, huge integers
        raise AgentError("bad_message", "expected a {} JSON object, found invalid JSON: {}"
                         .format(kind, str(exc)[:200]))
    if not isinstance(msg, dict):
        raise AgentError("bad_message", "expected a {} JSON object, found {}".format(
            kind, json_type(msg)))
    if _depth(msg) > MAX_DEPTH:
        raise AgentError("bad_message", "expected a {} message nested at most {} levels deep"
                         .format(kind, MAX_DEPTH))
    if kind == "job" and isinstance(msg.get("kind"), str) and msg["kind"] not in JOB_KINDS:
        raise AgentError("unknown_job_kind", "job kind must be one of {}, found {}".format(
            ", ".join(JOB_KINDS), short(msg["kind"])))
    validate(kind, msg)
    return msg


def peek_kind(payload: bytes) -> str:
    """Best-effort ``kind`` of a job document that failed ``decode`` (for its REJECTED
    status): the string if one can be read, else ""."""
    try:
        msg = json.loads(bytes(payload[: MAX_BYTES["job"]]).decode("utf-8"))
    except (ValueError, RecursionError):
        return ""
    kind = msg.get("kind") if isinstance(msg, dict) else None
    return kind if isinstance(kind, str) and 0 < len(kind) <= 64 else ""


# ---------------------------------------------------------------------------- schemas

_SCHEMAS: Dict[str, Dict[str, Any]] = {}
_VALIDATORS: Dict[str, Validator] = {}
_SCHEMAS_LOCK = threading.Lock()


def schema(kind: str) -> Dict[str, Any]:
    """The JSON Schema of a message kind (loaded once)."""
    if kind not in _SCHEMAS:
        if kind not in MESSAGE_KINDS:
            raise ValueError("unknown message kind {!r}".format(kind))
        with open(os.path.join(SCHEMA_DIR, kind + ".json"), "rb") as f:
            loaded = json.loads(f.read().decode("utf-8"))
        _SCHEMAS.setdefault(kind, loaded)
    return _SCHEMAS[kind]


def _validator(kind: str) -> Validator:
    """The compiled schema of a kind: compiled on first use, once, whichever thread asks."""
    found = _VALIDATORS.get(kind)
    if found is None:
        with _SCHEMAS_LOCK:
            found = _VALIDATORS.get(kind)
            if found is None:
                found = _VALIDATORS[kind] = Validator(schema(kind), kind)
    return found


def validate(kind: str, msg: Any) -> None:
    """Check ``msg`` against the schema of ``kind``; AgentError bad_message naming the path,
    what was expected and what was found."""
    error = _validator(kind).first_violation(msg, kind)
    if error is not None:
        raise AgentError("bad_message", error)


# ---------------------------------------------------------------------------- job states

def next_state_ok(old: Optional[str], new: str) -> bool:
    """Whether a job may go from ``old`` (None: not yet known) to ``new``."""
    return new in _TRANSITIONS.get(old, ())


def is_terminal(state: str) -> bool:
    return state in TERMINAL_STATES


# ---------------------------------------------------------------------------- artifact requests

def request_message(sha256: str, size: int, block_size: int, want: Bits,
                    job_id: Optional[str] = None, fanout: bool = False) -> Dict[str, Any]:
    msg: Dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "sha256": sha256,
        "size": size,
        "block_size": block_size,
        "blocks": block_count(size, block_size),
        "want": bitmap_encode(want),
    }
    if job_id is not None:
        msg["job_id"] = job_id
    if fanout:  # the device listens on the artifact's shared block topic
        msg["fanout"] = True
    return msg


def check_request(msg: Mapping[str, Any]) -> bytes:
    """Semantic checks of a decoded artifact request beyond its schema; returns the decoded
    ``want`` bitmap. AgentError bad_message."""
    blocks = block_count(msg["size"], msg["block_size"])
    if msg["blocks"] != blocks:
        raise AgentError("bad_message", "blocks must be ceil(size / block_size) = {}, found {}"
                         .format(blocks, msg["blocks"]))
    if blocks > MAX_BLOCKS:
        raise AgentError("bad_message", "an artifact may have at most {} blocks, found {}"
                         .format(MAX_BLOCKS, blocks))
    return bitmap_decode(msg["want"], blocks)


# ---------------------------------------------------------------------------- blocks and bitmaps

def manifest_block_size(size: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """The block size an artifact of ``size`` bytes is hashed and fetched in: ``block_size``,
    or larger (whole KiB) when it would need more than MAX_BLOCKS blocks."""
    needed = -(-size // MAX_BLOCKS)
    return max(block_size, -(-needed // 1024) * 1024)


def block_count(size: int, block_size: int) -> int:
    return (size + block_size - 1) // block_size


def block_length(size: int, block_size: int, index: int) -> int:
    """Bytes in block ``index`` (the last one may be short); 0 past the end."""
    return max(0, min(block_size, size - index * block_size))


def bitmap_new(blocks: int, fill: bool = False) -> bytearray:
    bitmap = bytearray(b"\xff" * ((blocks + 7) // 8) if fill else (blocks + 7) // 8)
    if fill and blocks % 8:
        bitmap[-1] = (1 << (blocks % 8)) - 1
    return bitmap


def bitmap_get(bitmap: Bits, index: int) -> bool:
    return bool(bitmap[index >> 3] >> (index & 7) & 1)


def bitmap_set(bitmap: bytearray, index: int, value: bool = True) -> None:
    if value:
        bitmap[index >> 3] |= 1 << (index & 7)
    else:
        bitmap[index >> 3] &= ~(1 << (index & 7)) & 0xFF


def bitmap_indices(bitmap: Bits, blocks: int, limit: Optional[int] = None) -> List[int]:
    """Indices of set bits below ``blocks``, ascending, at most ``limit`` of them."""
    out: List[int] = []
    for byte_index, byte in enumerate(bitmap):
        if not byte:
            continue
        for bit in range(8):
            i = byte_index * 8 + bit
            if i >= blocks:
                return out
            if byte >> bit & 1:
                out.append(i)
                if limit is not None and len(out) >= limit:
                    return out
    return out


def bitmap_from_indices(indices: Iterable[int], blocks: int) -> bytes:
    bitmap = bitmap_new(blocks)
    for i in indices:
        bitmap_set(bitmap, i)
    return bytes(bitmap)


def bitmap_count(bitmap: Bits, blocks: int) -> int:
    full, rest = divmod(blocks, 8)
    count = sum(bin(b).count("1") for b in bitmap[:full])
    if rest and full < len(bitmap):
        count += bin(bitmap[full] & ((1 << rest) - 1)).count("1")
    return count


def bitmap_encode(bitmap: Bits) -> str:
    return base64.b64encode(bytes(bitmap)).decode("ascii")


def bitmap_decode(text: str, blocks: int) -> bytes:
    """Decode a base64 bitmap of exactly ceil(blocks / 8) bytes with no bit past the end."""
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        raise AgentError("bad_message", "want must be base64, found {}".format(short(text)))
    expected = (blocks + 7) // 8
    if len(raw) != expected:
        raise AgentError("bad_message", "want must be {} bytes for {} blocks, found {}".format(
            expected, blocks, len(raw)))
    if blocks % 8 and raw[-1] >> (blocks % 8):
        raise AgentError("bad_message", "want sets bits past the last block ({})".format(
            blocks - 1))
    return raw
