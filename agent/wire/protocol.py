"""The MQTT protocol between a fleet controller and the agent: topics, messages, job states.

Pure: no paho, no files except the JSON Schemas shipped in ``agent/data/schemas/`` (the contract
for controllers in other languages; ``docs/protocol.md`` describes it). Schemas are checked by
the small validator below, which understands exactly the keywords those files use.
"""

import base64
import binascii
import json
import math
import os
import re
from typing import Any, Dict, Iterable, List, Mapping, NamedTuple, Optional, Tuple, Union

from agent.errors import AgentError

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = "jetson-agent"

JOB_KINDS = ("deploy", "search", "bench", "cancel")
ARTIFACT_ROLES = ("model", "calibration", "inputs", "goldens", "labels", "engine")
STATES = ("QUEUED", "IN_PROGRESS", "SUCCEEDED", "FAILED", "REJECTED", "CANCELED", "TIMED_OUT")
TERMINAL_STATES = frozenset(("SUCCEEDED", "FAILED", "REJECTED", "CANCELED", "TIMED_OUT"))
STAGES = ("downloading", "checking", "calibrating", "building", "verifying", "searching",
          "benchmarking", "activating")
COMMANDS = ("cancel", "diag", "rollback")

MESSAGE_KINDS = ("status", "job", "job_status", "artifact_request", "telemetry", "command",
                 "command_reply")
# Largest accepted payload per message kind (AWS IoT Jobs caps job documents at 32 KB).
MAX_BYTES = {
    "status": 64 * 1024,
    "job": 32 * 1024,
    "job_status": 64 * 1024,
    "artifact_request": 256 * 1024,
    "telemetry": 64 * 1024,
    "command": 8 * 1024,
    "command_reply": 256 * 1024,
}
MAX_DEPTH = 32  # nesting of JSON containers; deeper payloads are rejected before validation

DEFAULT_BLOCK_SIZE = 128 * 1024
MIN_BLOCK_SIZE = 1024
MAX_BLOCK_SIZE = 1024 * 1024
MAX_BLOCKS = 1 << 20
MAX_REPLY_TOPIC = 256

Bits = Union[bytes, bytearray]  # a block bitmap

# Allowed job state changes (AWS IoT Jobs): None is "not yet known to the device".
_TRANSITIONS = {
    None: ("QUEUED", "REJECTED"),
    "QUEUED": ("IN_PROGRESS", "REJECTED", "CANCELED", "TIMED_OUT", "FAILED"),
    "IN_PROGRESS": ("IN_PROGRESS", "SUCCEEDED", "FAILED", "REJECTED", "CANCELED", "TIMED_OUT"),
}

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA_RE = re.compile(r"[0-9a-f]{64}")
_INDEX_RE = re.compile(r"0|[1-9][0-9]{0,6}")

SCHEMA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "data", "schemas")


class TopicInfo(NamedTuple):
    """What a topic names. ``kind`` is one of MESSAGE_KINDS or "block"."""

    kind: str
    device: str
    job_id: Optional[str] = None
    sha256: Optional[str] = None
    block: Optional[int] = None  # block index


class Publication(NamedTuple):
    """One message to publish (what the journal's outbox stores)."""

    topic: str
    payload: bytes
    qos: int
    retain: bool


# ---------------------------------------------------------------------------- ids and topics

def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def valid_id(value: Any) -> bool:
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def check_id(what: str, value: Any) -> str:
    if not valid_id(value):
        raise AgentError(
            "bad_message",
            "{} must be 1-64 characters of [A-Za-z0-9._-] starting with a letter or digit, "
            "found {}".format(what, _short(value)),
        )
    return value


def valid_sha256(value: Any) -> bool:
    return isinstance(value, str) and _SHA_RE.fullmatch(value) is not None


def check_sha256(value: Any) -> str:
    if not valid_sha256(value):
        raise AgentError("bad_message", "a sha256 must be 64 lowercase hex digits, found {}"
                         .format(_short(value)))
    return value


def _check_publish_topic(what: str, topic: Any, max_len: int = MAX_REPLY_TOPIC) -> str:
    if (
        not isinstance(topic, str)
        or not topic
        or len(topic.encode("utf-8")) > max_len
        or topic.startswith("$")
        or any(c in topic for c in "+#\x00")
    ):
        raise AgentError(
            "bad_message",
            "{} must be an MQTT topic without wildcards, not starting with '$', at most {} "
            "bytes, found {}".format(what, max_len, _short(topic)),
        )
    return topic


class Topics(object):
    """Topic names under one prefix: ``{prefix}/devices/{device}/...``."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        levels = prefix.split("/") if isinstance(prefix, str) else []
        if not levels or any(not lv or set(lv) & set("+#\x00") for lv in levels) or (
                prefix.startswith("$")):
            raise AgentError(
                "bad_config",
                "topic prefix must be one or more non-empty levels without wildcards, not "
                "starting with '$', found {}".format(_short(prefix)),
            )
        self.prefix = prefix
        self._levels = levels

    def _dev(self, device: str) -> str:
        return "{}/devices/{}".format(self.prefix, check_id("device id", device))

    def status(self, device: str) -> str:
        return self._dev(device) + "/status"

    def job(self, device: str, job_id: str) -> str:
        return "{}/jobs/{}".format(self._dev(device), check_id("job id", job_id))

    def job_status(self, device: str, job_id: str) -> str:
        return self.job(device, job_id) + "/status"

    def artifact_request(self, device: str, sha256: str) -> str:
        return "{}/artifacts/{}/request".format(self._dev(device), check_sha256(sha256))

    def block(self, device: str, sha256: str, index: int) -> str:
        if not isinstance(index, int) or not 0 <= index < MAX_BLOCKS:
            raise AgentError("bad_message", "block index must be 0..{}, found {}".format(
                MAX_BLOCKS - 1, _short(index)))
        return "{}/artifacts/{}/block/{}".format(self._dev(device), check_sha256(sha256), index)

    def fanout_block(self, sha256: str, index: int) -> str:
        """Block ``index`` on the artifact's shared topic: published once, the broker hands
        it to every device fetching the artifact (they subscribe while they fetch)."""
        if not isinstance(index, int) or not 0 <= index < MAX_BLOCKS:
            raise AgentError("bad_message", "block index must be 0..{}, found {}".format(
                MAX_BLOCKS - 1, _short(index)))
        return "{}/artifacts/{}/block/{}".format(self.prefix, check_sha256(sha256), index)

    def fanout_blocks(self, sha256: str) -> str:
        return "{}/artifacts/{}/block/+".format(self.prefix, check_sha256(sha256))

    def telemetry(self, device: str) -> str:
        return self._dev(device) + "/telemetry"

    def commands(self, device: str) -> str:
        return self._dev(device) + "/commands"

    def command_reply(self, device: str) -> str:
        return self._dev(device) + "/commands/reply"

    def device_subscriptions(self, device: str) -> List[Tuple[str, int]]:
        """What a device subscribes to: its job documents, artifact blocks and commands."""
        base = self._dev(device)
        return [(base + "/jobs/+", 1), (base + "/artifacts/+/block/+", 1),
                (base + "/commands", 1)]

    def controller_subscriptions(
        self, share_group: Optional[str] = None, serve_blocks: bool = True
    ) -> List[Tuple[str, int]]:
        """What a controller subscribes to. ``share_group`` puts the block requests on an MQTT v5
        shared subscription so that several controller workers split them; the retained status
        topics are never shared (brokers send no retained messages to shared subscriptions)."""
        base = self.prefix + "/devices/+"
        subs = [(base + "/status", 1), (base + "/jobs/+/status", 1), (base + "/telemetry", 0),
                (base + "/commands/reply", 1), (base + "/commands/reply/+", 1)]
        if serve_blocks:
            requests = base + "/artifacts/+/request"
            if share_group is not None:
                requests = "$share/{}/{}".format(check_id("share group", share_group), requests)
            subs.append((requests, 1))
        return subs

    def parse(self, topic: str) -> TopicInfo:
        """The kind and ids a topic names; ids are validated. AgentError bad_message."""
        parts = topic.split("/") if isinstance(topic, str) else []
        n = len(self._levels)
        if parts[:n] == self._levels and len(parts) == n + 4 and parts[n] == "artifacts" \
                and parts[n + 2] == "block":
            # A shared (fan-out) block: no device level, ``device`` is "".
            sha = check_sha256(parts[n + 1])
            if _INDEX_RE.fullmatch(parts[n + 3]) is None or int(parts[n + 3]) >= MAX_BLOCKS:
                raise AgentError("bad_message", "block index must be a decimal 0..{}, found {}"
                                 .format(MAX_BLOCKS - 1, _short(parts[n + 3])))
            return TopicInfo("block", "", sha256=sha, block=int(parts[n + 3]))
        if parts[:n] != self._levels or len(parts) < n + 3 or parts[n] != "devices":
            raise AgentError("bad_message", "expected a topic under {}/devices/, found {}".format(
                self.prefix, _short(topic)))
        device = check_id("device id", parts[n + 1])
        rest = parts[n + 2:]
        if rest == ["status"]:
            return TopicInfo("status", device)
        if rest == ["telemetry"]:
            return TopicInfo("telemetry", device)
        if rest == ["commands"]:
            return TopicInfo("command", device)
        if rest == ["commands", "reply"] or (rest[:2] == ["commands", "reply"] and len(rest) == 3
                                            and valid_id(rest[2])):
            return TopicInfo("command_reply", device)
        if len(rest) == 2 and rest[0] == "jobs":
            return TopicInfo("job", device, job_id=check_id("job id", rest[1]))
        if len(rest) == 3 and rest[0] == "jobs" and rest[2] == "status":
            return TopicInfo("job_status", device, job_id=check_id("job id", rest[1]))
        if len(rest) == 3 and rest[0] == "artifacts" and rest[2] == "request":
            return TopicInfo("artifact_request", device, sha256=check_sha256(rest[1]))
        if len(rest) == 4 and rest[0] == "artifacts" and rest[2] == "block":
            sha = check_sha256(rest[1])
            if _INDEX_RE.fullmatch(rest[3]) is None or int(rest[3]) >= MAX_BLOCKS:
                raise AgentError("bad_message", "block index must be a decimal 0..{}, found {}"
                                 .format(MAX_BLOCKS - 1, _short(rest[3])))
            return TopicInfo("block", device, sha256=sha, block=int(rest[3]))
        raise AgentError(
            "bad_message",
            "expected status, telemetry, commands[/reply], jobs/ID[/status], "
            "artifacts/SHA/request or artifacts/SHA/block/N after the device id, found {}".format(
                _short("/".join(rest))),
        )


# ---------------------------------------------------------------------------- encode / decode

def _plain(value: Any, depth: int = 0) -> Any:
    """JSON-ready copy: tuples -> lists, numpy values -> Python, non-finite floats -> None."""
    if depth > 64:
        raise AgentError("internal_error", "message nests deeper than 64 levels")
    if value is None or isinstance(value, (bool, int, str)):
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


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError("number {} is out of range".format(text[:20]))
    return value


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
        stack.extend((child, d + 1) for child in children)
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
            kind, _json_type(msg)))
    if _depth(msg) > MAX_DEPTH:
        raise AgentError("bad_message", "expected a {} message nested at most {} levels deep"
                         .format(kind, MAX_DEPTH))
    if kind == "job" and isinstance(msg.get("kind"), str) and msg["kind"] not in JOB_KINDS:
        raise AgentError("unknown_job_kind", "job kind must be one of {}, found {}".format(
            ", ".join(JOB_KINDS), _short(msg["kind"])))
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


# ---------------------------------------------------------------------------- schema subset

_SCHEMAS: Dict[str, Dict[str, Any]] = {}
_ANNOTATIONS = frozenset(("$schema", "$id", "$defs", "$comment", "title", "description",
                          "default", "examples"))
_KEYWORDS = frozenset(("type", "enum", "const", "properties", "required", "additionalProperties",
                       "items", "minItems", "maxItems", "minLength", "maxLength", "pattern",
                       "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                       "minProperties", "maxProperties", "propertyNames", "$ref", "allOf", "if",
                       "then", "else")) | _ANNOTATIONS
_PATTERNS: Dict[str, "re.Pattern[str]"] = {}


def schema(kind: str) -> Dict[str, Any]:
    """The JSON Schema of a message kind (loaded once)."""
    if kind not in _SCHEMAS:
        if kind not in MESSAGE_KINDS:
            raise ValueError("unknown message kind {!r}".format(kind))
        with open(os.path.join(SCHEMA_DIR, kind + ".json"), "rb") as f:
            loaded = json.loads(f.read().decode("utf-8"))
        _check_keywords(loaded, kind)
        _SCHEMAS[kind] = loaded
    return _SCHEMAS[kind]


def _check_keywords(node: Any, where: str) -> None:
    """Refuse schema keywords the validator does not implement (they would pass silently)."""
    if isinstance(node, dict):
        unknown = set(node) - _KEYWORDS
        if unknown:
            raise ValueError("{}: unsupported schema keywords {}".format(where, sorted(unknown)))
        for key, child in node.items():
            if key in ("properties", "$defs"):
                for name, sub in child.items():
                    _check_keywords(sub, where + "." + name)
            elif key in ("items", "additionalProperties", "propertyNames", "if", "then", "else"):
                _check_keywords(child, where)
            elif key == "allOf":
                for sub in child:
                    _check_keywords(sub, where)


def validate(kind: str, msg: Any) -> None:
    """Check ``msg`` against the schema of ``kind``; AgentError bad_message naming the path,
    what was expected and what was found."""
    root = schema(kind)
    error = _validate(root, msg, kind, root)
    if error is not None:
        raise AgentError("bad_message", error)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is_type(value: Any, name: str) -> bool:
    found = _json_type(value)
    return found == name or (name == "number" and found == "integer")


def _matches(pattern: str, text: str) -> bool:
    if pattern not in _PATTERNS:
        # ECMA-262 "^...$" means the whole string; Python's "$" would also accept a final "\n".
        if pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$"):
            _PATTERNS[pattern] = re.compile(r"\A(?:" + pattern[1:-1] + r")\Z")
        else:
            _PATTERNS[pattern] = re.compile(pattern)
    return _PATTERNS[pattern].search(text) is not None


def _validate(sch: Any, value: Any, path: str, root: Dict[str, Any]) -> Optional[str]:
    """First violation as a message, or None."""
    if sch is True or sch == {}:
        return None
    if sch is False:
        return "{}: not allowed here, found {}".format(path, _short(value))
    if "$ref" in sch:
        ref = sch["$ref"]
        if not ref.startswith("#/$defs/"):
            raise ValueError("only local $refs are supported, found {!r}".format(ref))
        err = _validate(root["$defs"][ref[len("#/$defs/"):]], value, path, root)
        if err:
            return err
    if "type" in sch:
        types = sch["type"] if isinstance(sch["type"], list) else [sch["type"]]
        if not any(_is_type(value, t) for t in types):
            return "{}: expected {}, found {} {}".format(
                path, " or ".join(types), _json_type(value), _short(value))
    if "const" in sch and not _same(value, sch["const"]):
        return "{}: expected {}, found {}".format(path, _short(sch["const"]), _short(value))
    if "enum" in sch and not any(_same(value, e) for e in sch["enum"]):
        return "{}: expected one of {}, found {}".format(
            path, ", ".join(json.dumps(e) for e in sch["enum"]), _short(value))
    if isinstance(value, str):
        if len(value) < sch.get("minLength", 0):
            return "{}: expected at least {} characters, found {}".format(
                path, sch["minLength"], len(value))
        if "maxLength" in sch and len(value) > sch["maxLength"]:
            return "{}: expected at most {} characters, found {}".format(
                path, sch["maxLength"], len(value))
        if "pattern" in sch and not _matches(sch["pattern"], value):
            return "{}: expected a string matching {}, found {}".format(
                path, sch["pattern"], _short(value))
    if _is_type(value, "number") and not isinstance(value, bool):
        if "minimum" in sch and value < sch["minimum"]:
            return "{}: expected >= {}, found {}".format(path, sch["minimum"], value)
        if "maximum" in sch and value > sch["maximum"]:
            return "{}: expected <= {}, found {}".format(path, sch["maximum"], value)
        if "exclusiveMinimum" in sch and value <= sch["exclusiveMinimum"]:
            return "{}: expected > {}, found {}".format(path, sch["exclusiveMinimum"], value)
        if "exclusiveMaximum" in sch and value >= sch["exclusiveMaximum"]:
            return "{}: expected < {}, found {}".format(path, sch["exclusiveMaximum"], value)
    if isinstance(value, list):
        if len(value) < sch.get("minItems", 0):
            return "{}: expected at least {} items, found {}".format(
                path, sch["minItems"], len(value))
        if "maxItems" in sch and len(value) > sch["maxItems"]:
            return "{}: expected at most {} items, found {}".format(
                path, sch["maxItems"], len(value))
        if "items" in sch:
            for i, item in enumerate(value):
                err = _validate(sch["items"], item, "{}[{}]".format(path, i), root)
                if err:
                    return err
    if isinstance(value, dict):
        err = _validate_object(sch, value, path, root)
        if err:
            return err
    for sub in sch.get("allOf", ()):
        err = _validate(sub, value, path, root)
        if err:
            return err
    if "if" in sch:
        branch = "then" if _validate(sch["if"], value, path, root) is None else "else"
        if branch in sch:
            err = _validate(sch[branch], value, path, root)
            if err:
                return err
    return None


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if _is_type(a, "number") and _is_type(b, "number"):
        return bool(a == b)
    return _json_type(a) == _json_type(b) and bool(a == b)


def _validate_object(sch: Dict[str, Any], value: Dict[str, Any], path: str,
                     root: Dict[str, Any]) -> Optional[str]:
    for name in sch.get("required", ()):
        if name not in value:
            return "{}: expected key {!r}, found keys {}".format(
                path, name, _short(sorted(value), 120))
    if len(value) < sch.get("minProperties", 0):
        return "{}: expected at least {} keys, found {}".format(
            path, sch["minProperties"], len(value))
    if "maxProperties" in sch and len(value) > sch["maxProperties"]:
        return "{}: expected at most {} keys, found {}".format(
            path, sch["maxProperties"], len(value))
    props = sch.get("properties", {})
    extra = sch.get("additionalProperties", True)
    for key, item in value.items():
        if "propertyNames" in sch:
            err = _validate(sch["propertyNames"], key, "{} key {}".format(path, _short(key)),
                            root)
            if err:
                return err
        if key in props:
            err = _validate(props[key], item, "{}.{}".format(path, key), root)
        elif extra is False:
            return "{}: unexpected key {} (expected one of {})".format(
                path, _short(key), ", ".join(sorted(props)))
        else:
            err = _validate(extra, item, "{}.{}".format(path, key), root)
        if err:
            return err
    return None


# ---------------------------------------------------------------------------- jobs and states

def next_state_ok(old: Optional[str], new: str) -> bool:
    """Whether a job may go from ``old`` (None: not yet known) to ``new``."""
    return new in _TRANSITIONS.get(old, ())


def is_terminal(state: str) -> bool:
    return state in TERMINAL_STATES


def check_job_topic(doc: Mapping[str, Any], device: str, job_id: str) -> None:
    """A job document must name the device and job id of the topic it came on."""
    if doc.get("job_id") != job_id:
        raise AgentError("bad_message", "job document on the topic of job {!r} names job_id {}"
                         .format(job_id, _short(doc.get("job_id"))))
    if doc.get("device") != device:
        raise AgentError("bad_message", "job document for device {!r} names device {}"
                         .format(device, _short(doc.get("device"))))


def plan_dict(doc: Mapping[str, Any]) -> Dict[str, Any]:
    """The job's plan in the shape ``BuildPlan.from_dict`` accepts; calibration paths are left
    None for the agent to fill from the ``calibration`` artifact and its own caches."""
    plan = dict(doc.get("plan") or {})
    out: Dict[str, Any] = {
        "precision": plan.get("precision", "fp32"),
        "layer_precisions": dict(plan.get("layer_precisions") or {}),
        "precision_constraints": plan.get("precision_constraints", "none"),
        "calibration": None,
        "shapes": dict(plan.get("shapes") or {}),
        "workspace_bytes": plan.get("workspace_bytes"),
        "dla_core": plan.get("dla_core"),
    }
    calib = plan.get("calibration")
    needs = out["precision"] in ("int8", "best") or "int8" in out["layer_precisions"].values()
    if calib or needs:
        calib = dict(calib or {})
        out["calibration"] = {
            "data": None,
            "cache": None,
            "algorithm": calib.get("algorithm", "entropy2"),
            "batch_size": calib.get("batch_size", 8),
            "shuffle_seed": calib.get("shuffle_seed"),
            "max_samples": calib.get("max_samples"),
        }
    return out


# ---------------------------------------------------------------------------- message builders

def status_is_stale(last_boot: Optional[int], msg: Mapping[str, Any]) -> bool:
    """Whether a device status (birth or Will) is older than the newest boot seen: a late Will
    from a previous connection must not mark a restarted device offline."""
    boot = msg.get("boot")
    if not isinstance(boot, int) or isinstance(boot, bool):
        return True
    return last_boot is not None and boot < last_boot


def status_message(
    device: str,
    online: bool,
    boot: int,
    agent_version: Optional[str] = None,
    platform: Optional[Mapping[str, Any]] = None,
    active_engines: Optional[List[Mapping[str, Any]]] = None,
    reason: Optional[str] = None,
    ts: Optional[float] = None,
) -> Dict[str, Any]:
    msg: Dict[str, Any] = {"protocol": PROTOCOL_VERSION, "device": device, "online": online,
                           "boot": boot}
    if ts is not None:
        msg["ts"] = ts
    if agent_version is not None:
        msg["agent_version"] = agent_version
    if platform is not None:
        msg["platform"] = dict(platform)
    if active_engines is not None:
        keys = ("model", "engine_key", "precision", "activated", "job_id")
        msg["active_engines"] = [{k: e.get(k) for k in keys if e.get(k) is not None}
                                 for e in active_engines]
    if reason is not None:
        msg["reason"] = reason
    return msg


def will_message(device: str, boot: int, platform: Optional[Mapping[str, Any]] = None
                 ) -> Dict[str, Any]:
    """The Last Will: offline, with the boot counter of the connection it belongs to (and
    the platform, so an offline device keeps its board in ``fleet devices``)."""
    return status_message(device, False, boot, reason="connection_lost", platform=platform)


def job_status_message(device: str, row: Mapping[str, Any],
                       ts: Optional[float] = None) -> Dict[str, Any]:
    """The job status message for a ``Journal.job()`` row, within ``MAX_BYTES["job_status"]``
    by construction (``agent.wire.message_caps``: long texts cut, long lists summarised)."""
    from agent.wire import message_caps as caps

    details = {str(k): str(v) for k, v in (row.get("details") or {}).items()}
    msg: Dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "job_id": row["job_id"],
        "device": device,
        "kind": row.get("kind") or "",
        "state": row["state"],
        "version": row["version"],
        "ts": row.get("updated") if ts is None else ts,
    }
    if row.get("stage"):
        msg["stage"] = row["stage"]
        details.setdefault("stage", row["stage"])
    if row.get("progress"):
        msg["progress"] = {"done": row["progress"]["done"], "of": row["progress"]["of"]}
    if row.get("error"):
        msg["error"] = caps.fit_error(row["error"])
        details.setdefault("error_code", str(row["error"].get("code")))
    if row.get("result") is not None:
        msg["result"] = row["result"]
    msg["statusDetails"] = caps.fit_details(details)
    if msg["ts"] is None:
        del msg["ts"]
    limit = MAX_BYTES["job_status"] - caps.ENVELOPE
    try:
        return caps.fit_message("job_status", msg, limit, keep=(
            "protocol", "job_id", "device", "kind", "state", "version", "ts", "stage",
            "progress", "statusDetails"))
    except ValueError:
        return caps.short_job_status(msg)


def job_status_publication(topics: Topics, device: str, row: Mapping[str, Any]) -> Publication:
    """Retained QoS 1 job status for the outbox (``Journal.set_state(..., emit=...)``)."""
    return Publication(topics.job_status(device, row["job_id"]),
                       encode(job_status_message(device, row)), 1, True)


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


def command_reply(
    device: str,
    command: Mapping[str, Any],
    ok: bool,
    result: Optional[Mapping[str, Any]] = None,
    error: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """Reply to a command; echoes its request_id and correlation."""
    name = command.get("command")
    msg: Dict[str, Any] = {"protocol": PROTOCOL_VERSION, "device": device,
                           "command": name if isinstance(name, str) else "", "ok": ok}
    for key in ("request_id", "correlation"):
        if isinstance(command.get(key), str):
            msg[key] = command[key]
    if result is not None:
        msg["result"] = dict(result)
    if error is not None:
        msg["error"] = dict(error)
    return msg


def reply_topic(topics: Topics, device: str, command: Mapping[str, Any],
                response_topic: Optional[str] = None) -> str:
    """Where a command reply goes: the MQTT v5 response topic, else the command's ``reply_to``
    (MQTT 3.1.1), else ``{prefix}/devices/{id}/commands/reply``. Only the controller's reply
    topics are allowed: that topic or one level below it (``.../commands/reply/REQUEST``), so a
    command cannot make the device publish on another device's topics or a job's status.
    AgentError bad_message."""
    default = topics.command_reply(device)
    for what, topic in (("response topic", response_topic), ("reply_to",
                                                             command.get("reply_to"))):
        if topic is None:
            continue
        _check_publish_topic(what, topic)
        rest = topic[len(default) + 1:] if topic.startswith(default + "/") else None
        if topic != default and not valid_id(rest):
            raise AgentError("bad_message", "{} must be {} or {}/ID (the controller's reply "
                             "topics), found {}".format(what, default, default, _short(topic)))
        return topic
    return default


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
        raise AgentError("bad_message", "want must be base64, found {}".format(_short(text)))
    expected = (blocks + 7) // 8
    if len(raw) != expected:
        raise AgentError("bad_message", "want must be {} bytes for {} blocks, found {}".format(
            expected, blocks, len(raw)))
    if blocks % 8 and raw[-1] >> (blocks % 8):
        raise AgentError("bad_message", "want sets bits past the last block ({})".format(
            blocks - 1))
    return raw
