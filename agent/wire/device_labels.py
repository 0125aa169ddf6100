"""Device labels as a device reports them (config ``labels:``, the birth status's
``platform.labels``) and as the controller assigns them: Kubernetes label syntax, capped in
number and size, checked where they enter (the daemon's config, the controller's intake of a
status, ``fleet label``). Pure; the daemon and the controller share it.

- key: an optional DNS-subdomain prefix and ``/``, then a name of 1-63 characters of
  ``[A-Za-z0-9_.-]`` starting and ending with a letter or digit (Kubernetes' rule); the key as a
  whole at most ``MAX_KEY`` characters;
- value: empty, or 1-63 such characters;
- at most ``MAX_LABELS`` labels per source.

The keys the controller derives from the verified status (``DERIVED``: board, jetpack,
tensorrt, class) and the prefixes that name a source (``device/``, ``fleet/``) are reserved: a
device cannot claim them and an operator cannot assign them.
"""

import re
from typing import Any, Dict, Mapping, Tuple

from agent.errors import AgentError

MAX_LABELS = 32
MAX_KEY = 127
MAX_VALUE = 63
DERIVED = ("board", "jetpack", "tensorrt", "class")
SOURCE_PREFIXES = ("device", "fleet")  # device/KEY: the device's claim; fleet/KEY: assigned

_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?"
_NAME_RE = re.compile(_NAME)
_PREFIX_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]{0,61}"
                        r"[a-z0-9])?)*")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def valid_key(key: Any) -> bool:
    if not isinstance(key, str) or not key or len(key) > MAX_KEY:
        return False
    prefix, sep, name = key.rpartition("/")
    if sep and (not prefix or len(prefix) > 253 or _PREFIX_RE.fullmatch(prefix) is None):
        return False
    return _NAME_RE.fullmatch(name) is not None


def valid_value(value: Any) -> bool:
    return isinstance(value, str) and (value == "" or (
        len(value) <= MAX_VALUE and _NAME_RE.fullmatch(value) is not None))


def check_key(key: Any, where: str = "label key") -> str:
    if not valid_key(key):
        raise AgentError("bad_label", "{}: expected [PREFIX/]NAME with NAME 1-63 characters of "
                         "[A-Za-z0-9_.-] starting and ending with a letter or digit (at most {} "
                         "characters in all), found {}".format(where, MAX_KEY, _shown(key)))
    return key


def check_value(key: str, value: Any, where: str = "label") -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # YAML reads `floor: 3` as a number
    if not valid_value(value):
        raise AgentError("bad_label", "{} {}: expected a value of 0-63 characters of "
                         "[A-Za-z0-9_.-] starting and ending with a letter or digit, found {}"
                         .format(where, key, _shown(value)))
    return value


def reserved(key: str) -> bool:
    """A key only the controller derives (board, ...) or a source prefix (device/, fleet/)."""
    return key in DERIVED or key.split("/", 1)[0] in SOURCE_PREFIXES and "/" in key


def check_labels(labels: Any, where: str = "labels") -> Dict[str, str]:
    """A mapping of labels checked whole: AgentError bad_label naming the first bad one."""
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise AgentError("bad_label", "{}: expected a mapping of key: value, found {}".format(
            where, type(labels).__name__))
    if len(labels) > MAX_LABELS:
        raise AgentError("bad_label", "{}: expected at most {} labels, found {}".format(
            where, MAX_LABELS, len(labels)))
    out: Dict[str, str] = {}
    for key, value in labels.items():
        check_key(key, "{}: key".format(where))
        if reserved(key):
            raise AgentError("bad_label", "{}: {!r} is reserved (board, jetpack, tensorrt and "
                             "class come from the verified platform; device/ and fleet/ name "
                             "a label's source); expected another key".format(where, key))
        out[key] = check_value(key, value, where)
    return out


def lenient(labels: Any) -> Tuple[Dict[str, str], int]:
    """What a controller keeps of a device's claimed labels: the valid ones, at most
    ``MAX_LABELS`` (sorted by key), and how many were dropped."""
    if not isinstance(labels, Mapping):
        return {}, 0 if labels is None else 1
    good = {k: v for k, v in labels.items()
            if valid_key(k) and not reserved(k) and valid_value(v)}
    kept = dict(sorted(good.items())[:MAX_LABELS])
    return kept, len(labels) - len(kept)
