"""Reading YAML into nested dataclasses, the way the daemon's config (``agent.device.config``)
is defined: a nested dataclass is a YAML section, a field's type is the type its value must
have, field metadata adds the rules below. Every error is ``bad_config`` and names the key and,
from a file, its line. Generic: it knows no key of the daemon's config.

Field metadata keys: "choices" (allowed values), "size" (accepts 512MiB etc.), "min"/"max"
(bounds), "secret" (hidden by ``as_dict``), "entries" (a list of mappings, taken as it is
and checked by the section's own parser: the daemon's ``handoff:`` list), "internal" (not
settable: no YAML key, no variable; with "refused", the message that says why a key of that
name is not accepted).
"""

import dataclasses
import re
import typing
from typing import Any, Dict, List, Tuple

import yaml

from agent.errors import AgentError

SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.I)


def parse_size(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise AgentError("bad_config", "{} expects a size, found {!r}".format(where, value))
    if isinstance(value, int):
        return value
    m = SIZE_RE.match(str(value))
    if not m:
        raise AgentError("bad_config", "{} expects a size such as 1048576, 512MiB or 2GB, "
                                       "found {!r}".format(where, value))
    number, unit, binary = float(m.group(1)), m.group(2).upper(), m.group(3)
    base = 1024 if binary else 1000
    return int(number * base ** " KMGT".index(unit or " "))


def as_dict(obj: Any, show_secrets: bool) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if dataclasses.is_dataclass(value):
            out[field.name] = as_dict(value, show_secrets)
        elif field.metadata.get("secret"):
            if value is not None:
                out[field.name] = value if show_secrets else "***"
        else:
            out[field.name] = value
    return out


def _line_index(node: Any, path: Tuple[str, ...], out: Dict[Tuple[str, ...], int]) -> None:
    """path -> 1-based line of the key (or of the document for the root)."""
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                sub = path + (str(key_node.value),)
                out[sub] = key_node.start_mark.line + 1
                _line_index(value_node, sub, out)


def read_yaml(path: str) -> Tuple[Any, Dict[Tuple[str, ...], int]]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise AgentError("bad_config", "cannot read config file {}: {}".format(
            path, exc.strerror or exc))
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = " line {}".format(mark.line + 1) if mark is not None else ""
        raise AgentError("bad_config", "{}{}: not valid YAML: {}".format(
            path, where, getattr(exc, "problem", None) or exc))
    lines: Dict[Tuple[str, ...], int] = {}
    if node is not None:
        _line_index(node, (), lines)
    return data, lines


def _type_name(value: Any) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "mapping", type(None): "null"}.get(type(value), type(value).__name__)


def _expected_name(tp: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp))


def _unwrap_optional(tp: Any) -> Tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        return [a for a in args if a is not type(None)][0], True
    return tp, False


def _check_value(field: "dataclasses.Field[Any]", tp: Any, value: Any, where: str) -> Any:
    base, optional = _unwrap_optional(tp)
    meta = field.metadata
    if meta.get("entries"):  # a list of mappings, checked later by its own parser
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(i, dict) for i in value):
            raise AgentError("bad_config", "{} expects a list of mappings, found {} {!r}".format(
                where, _type_name(value), value))
        return list(value)
    if meta.get("mapping"):  # a mapping of strings, checked later by its own parser
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise AgentError("bad_config", "{} expects a mapping of key: value, found {} {!r}"
                             .format(where, _type_name(value), value))
        return dict(value)
    if typing.get_origin(base) is list:  # a list of strings; one string is a list of one
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise AgentError("bad_config", "{} expects a list of strings, found {} {!r}".format(
                where, _type_name(value), value))
        return list(items)
    if value is None:
        if optional:
            return None
        raise AgentError("bad_config", "{} expects {}, found null".format(
            where, _expected_name(base)))
    if meta.get("size"):
        value = parse_size(value, where)
    elif base is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    elif base is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)  # e.g. a numeric device id
    if not isinstance(value, base) or (base is not bool and isinstance(value, bool)):
        raise AgentError("bad_config", "{} expects {}, found {} {!r}".format(
            where, _expected_name(base), _type_name(value), value))
    if "choices" in meta and value not in meta["choices"]:
        raise AgentError("bad_config", "{} must be one of {}, found {!r}".format(
            where, ", ".join(meta["choices"]), value))
    if "min" in meta and value < meta["min"]:
        raise AgentError("bad_config", "{} must be >= {}, found {!r}".format(
            where, meta["min"], value))
    if "max" in meta and value > meta["max"]:
        raise AgentError("bad_config", "{} must be <= {}, found {!r}".format(
            where, meta["max"], value))
    return value


def _hints(cls: Any) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def apply(obj: Any, data: Any, path: Tuple[str, ...], describe: Any) -> None:
    """Set the fields of ``obj`` from mapping ``data``; ``describe(path)`` says where a key is."""
    if not isinstance(data, dict):
        raise AgentError("bad_config", "{} expects a mapping, found {} {!r}".format(
            describe(path) if path else "the config file", _type_name(data), data))
    fields = {f.name: f for f in dataclasses.fields(obj) if not f.metadata.get("internal")}
    refused = {f.name: f.metadata["refused"] for f in dataclasses.fields(obj)
               if "refused" in f.metadata}
    hints = _hints(type(obj))
    for key, value in data.items():
        sub = path + (str(key),)
        if key in refused:
            raise AgentError("bad_config", "{}: {} is not accepted: {}".format(
                describe(sub), ".".join(sub), refused[key]))
        if key not in fields:
            raise AgentError("bad_config", "{}: unknown key {!r}; expected one of {}".format(
                describe(sub), ".".join(sub), ", ".join(sorted(fields))))
        field = fields[key]
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            apply(getattr(obj, key), value if value is not None else {}, sub, describe)
        else:
            setattr(obj, key, _check_value(field, tp, value, describe(sub)))


def leaf_paths(cls: Any, prefix: Tuple[str, ...] = ()) -> List[Tuple[str, ...]]:
    out: List[Tuple[str, ...]] = []
    hints = _hints(cls)
    for field in dataclasses.fields(cls):
        if field.metadata.get("internal"):
            continue
        tp = hints[field.name]
        if dataclasses.is_dataclass(tp):
            out += leaf_paths(tp, prefix + (field.name,))
        else:
            out.append(prefix + (field.name,))
    return out


def nest(path: Tuple[str, ...], value: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {path[-1]: value}
    for key in reversed(path[:-1]):
        out = {key: out}
    return out
