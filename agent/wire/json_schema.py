"""The JSON Schema subset that checks every message against agent/data/schemas (Python >= 3.8).

Generic and pure: it knows nothing of message kinds (``protocol.schema``/``protocol.validate``
load the files and name the kind). It implements exactly the keywords those files use, and
``check_keywords`` refuses any other (an unimplemented keyword would pass silently).
"""

import json
import re
from typing import Any, Dict, Optional

_ANNOTATIONS = frozenset(("$schema", "$id", "$defs", "$comment", "title", "description",
                          "default", "examples"))
_KEYWORDS = frozenset(("type", "enum", "const", "properties", "required", "additionalProperties",
                       "items", "minItems", "maxItems", "minLength", "maxLength", "pattern",
                       "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                       "minProperties", "maxProperties", "propertyNames", "$ref", "allOf", "if",
                       "then", "else")) | _ANNOTATIONS
_PATTERNS: Dict[str, "re.Pattern[str]"] = {}
_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))


def short(value: Any, limit: int = 60) -> str:
    """A found value for an error message: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_keywords(node: Any, where: str) -> None:
    """Refuse schema keywords the validator does not implement (they would pass silently)."""
    if isinstance(node, dict):
        unknown = set(node) - _KEYWORDS
        if unknown:
            raise ValueError("{}: unsupported schema keywords {}".format(where, sorted(unknown)))
        for key, child in node.items():
            if key in ("properties", "$defs"):
                for name, sub in child.items():
                    check_keywords(sub, where + "." + name)
            elif key in ("items", "additionalProperties", "propertyNames", "if", "then", "else"):
                check_keywords(child, where)
            elif key == "allOf":
                for sub in child:
                    check_keywords(sub, where)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    for cls, name in _JSON_TYPES:  # bool before int: True is an int to Python, not to JSON
        if isinstance(value, cls):
            return name
    return type(value).__name__


def _is_type(value: Any, name: str) -> bool:
    found = json_type(value)
    return found == name or (name == "number" and found == "integer")


def _matches(pattern: str, text: str) -> bool:
    if pattern not in _PATTERNS:
        # ECMA-262 "^...$" means the whole string; Python's "$" would also accept a final "\n".
        if pattern.startswith("^") and pattern.endswith("$") and not pattern.endswith("\\$"):
            _PATTERNS[pattern] = re.compile(r"\A(?:" + pattern[1:-1] + r")\Z")
        else:
            _PATTERNS[pattern] = re.compile(pattern)
    return _PATTERNS[pattern].search(text) is not None


def first_violation(sch: Any, value: Any, path: str, root: Dict[str, Any]) -> Optional[str]:
    """First violation as a message, or None."""
    if sch is True or sch == {}:
        return None
    if sch is False:
        return "{}: not allowed here, found {}".format(path, short(value))
    if "$ref" in sch:
        ref = sch["$ref"]
        if not ref.startswith("#/$defs/"):
            raise ValueError("only local $refs are supported, found {!r}".format(ref))
        err = first_violation(root["$defs"][ref[len("#/$defs/"):]], value, path, root)
        if err:
            return err
    if "type" in sch:
        types = sch["type"] if isinstance(sch["type"], list) else [sch["type"]]
        if not any(_is_type(value, t) for t in types):
            return "{}: expected {}, found {} {}".format(
                path, " or ".join(types), json_type(value), short(value))
    if "const" in sch and not _same(value, sch["const"]):
        return "{}: expected {}, found {}".format(path, short(sch["const"]), short(value))
    if "enum" in sch and not any(_same(value, e) for e in sch["enum"]):
        return "{}: expected one of {}, found {}".format(
            path, ", ".join(json.dumps(e) for e in sch["enum"]), short(value))
    if isinstance(value, str):
        err = _count_violation(sch, "minLength", "maxLength", len(value), "characters", path)
        if err:
            return err
        if "pattern" in sch and not _matches(sch["pattern"], value):
            return "{}: expected a string matching {}, found {}".format(
                path, sch["pattern"], short(value))
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
        err = _count_violation(sch, "minItems", "maxItems", len(value), "items", path)
        if err:
            return err
        if "items" in sch:
            for i, item in enumerate(value):
                err = first_violation(sch["items"], item, "{}[{}]".format(path, i), root)
                if err:
                    return err
    if isinstance(value, dict):
        err = _validate_object(sch, value, path, root)
        if err:
            return err
    for sub in sch.get("allOf", ()):
        err = first_violation(sub, value, path, root)
        if err:
            return err
    if "if" in sch:
        branch = "then" if first_violation(sch["if"], value, path, root) is None else "else"
        if branch in sch:
            err = first_violation(sch[branch], value, path, root)
            if err:
                return err
    return None


def _count_violation(sch: Dict[str, Any], low: str, high: str, count: int, noun: str,
                     path: str) -> Optional[str]:
    """A min/max keyword pair on a count of characters, items or keys."""
    if count < sch.get(low, 0):
        return "{}: expected at least {} {}, found {}".format(path, sch[low], noun, count)
    if high in sch and count > sch[high]:
        return "{}: expected at most {} {}, found {}".format(path, sch[high], noun, count)
    return None


def _same(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but true != 1."""
    if _is_type(a, "number") and _is_type(b, "number"):
        return bool(a == b)
    return json_type(a) == json_type(b) and bool(a == b)


def _validate_object(sch: Dict[str, Any], value: Dict[str, Any], path: str,
                     root: Dict[str, Any]) -> Optional[str]:
    for name in sch.get("required", ()):
        if name not in value:
            return "{}: expected key {!r}, found keys {}".format(
                path, name, short(sorted(value), 120))
    err = _count_violation(sch, "minProperties", "maxProperties", len(value), "keys", path)
    if err:
        return err
    props = sch.get("properties", {})
    extra = sch.get("additionalProperties", True)
    for key, item in value.items():
        if "propertyNames" in sch:
            err = first_violation(sch["propertyNames"], key,
                                  "{} key {}".format(path, short(key)), root)
            if err:
                return err
        if key in props:
            err = first_violation(props[key], item, "{}.{}".format(path, key), root)
        elif extra is False:
            return "{}: unexpected key {} (expected one of {})".format(
                path, short(key), ", ".join(sorted(props)))
        else:
            err = first_violation(extra, item, "{}.{}".format(path, key), root)
        if err:
            return err
    return None

