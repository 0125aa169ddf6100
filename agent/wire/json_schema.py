"""Message validation against agent/data/schemas with fastjsonschema, in our words (Python >= 3.8).

Generic and pure: it knows nothing of message kinds (``protocol.schema``/``protocol.validate``
load the files and name the kind). The schemas say draft 2020-12; fastjsonschema implements
draft-07, so ``check_keywords`` admits only the keywords both drafts read the same way (and our
messages render), and refuses what one of them would ignore or read differently: an unknown
keyword, a ``$ref`` beside other keywords, a non-local ``$ref``, ``items`` as a list, a
``const``/``enum`` holding numbers or booleans without a ``type`` (Python's ``True == 1``), and a
``$`` anywhere but at a pattern's end. ``Validator`` compiles one schema (as draft-07, without
its root ``$id``) and turns the library's first error into "<path>: expected X, found Y".
"""

import copy
import json
import threading
from typing import Any, Callable, Dict, Optional

import fastjsonschema

_ANNOTATIONS = frozenset(("$schema", "$id", "$defs", "$comment", "title", "description",
                          "default", "examples"))
_KEYWORDS = frozenset(("type", "enum", "const", "properties", "required", "additionalProperties",
                       "items", "minItems", "maxItems", "minLength", "maxLength", "pattern",
                       "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                       "minProperties", "maxProperties", "propertyNames", "$ref", "allOf", "if",
                       "then", "else")) | _ANNOTATIONS
_JSON_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
               (list, "array"), (dict, "object"))
_DRAFT_07 = "http://json-schema.org/draft-07/schema#"
_COUNTS = {"minLength": ("at least", "characters"), "maxLength": ("at most", "characters"),
           "minItems": ("at least", "items"), "maxItems": ("at most", "items"),
           "minProperties": ("at least", "keys"), "maxProperties": ("at most", "keys")}
_BOUNDS = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}


def short(value: Any, limit: int = 60) -> str:
    """A found value for an error message: its repr, cut to ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    for cls, name in _JSON_TYPES:  # bool before int: True is an int to Python, not to JSON
        if isinstance(value, cls):
            return name
    return type(value).__name__


def check_keywords(node: Any, where: str, root: bool = True) -> None:
    """Refuse what the validator would ignore or read differently from draft 2020-12
    (ValueError naming the place)."""
    if isinstance(node, bool):
        return
    if not isinstance(node, dict):
        raise ValueError("{}: expected a schema object or boolean, found {}".format(
            where, short(node)))
    unknown = set(node) - _KEYWORDS
    if unknown:
        raise ValueError("{}: unsupported schema keywords {}".format(where, sorted(unknown)))
    if not root and "$id" in node:
        raise ValueError("{}: $id is allowed at the root only".format(where))
    if "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#/$defs/"):
            raise ValueError("{}: only local $refs (#/$defs/...) are supported, found {!r}"
                             .format(where, ref))
        beside = set(node) - _ANNOTATIONS - {"$ref"}
        if beside:  # draft-07 ignores keywords beside a $ref; 2020-12 applies them
            raise ValueError("{}: keywords {} beside a $ref (put both in an allOf)".format(
                where, sorted(beside)))
    literals = list(node.get("enum", ())) + ([node["const"]] if "const" in node else [])
    if "type" not in node and any(isinstance(v, (bool, int, float)) for v in literals):
        raise ValueError("{}: a const or enum holding numbers or booleans needs a type (true "
                         "would equal 1)".format(where))
    pattern = node.get("pattern")
    if isinstance(pattern, str) and _inner_dollar(pattern):
        raise ValueError("{}: a pattern may use $ only as its end anchor, found {!r}".format(
            where, pattern))
    if isinstance(node.get("items"), list):
        raise ValueError("{}: items must be one schema (a list means prefixItems in 2020-12)"
                         .format(where))
    for key, child in node.items():
        if key in ("properties", "$defs"):
            for name, sub in child.items():
                check_keywords(sub, where + "." + name, False)
        elif key in ("items", "additionalProperties", "propertyNames", "if", "then", "else"):
            check_keywords(child, where, False)
        elif key == "allOf":
            for sub in child:
                check_keywords(sub, where, False)


def _inner_dollar(pattern: str) -> bool:
    """Whether an unescaped ``$`` stands before the pattern's last character (fastjsonschema
    turns every one into ``\\Z``, which would break a ``[$]`` set)."""
    escaped = False
    for i, char in enumerate(pattern):
        if char == "$" and not escaped and i != len(pattern) - 1:
            return True
        escaped = char == "\\" and not escaped
    return False


class Validator:
    """One compiled schema: ``first_violation(value, path)`` is None or our message.

    Compiling runs the library's code generator once; the compiled function is thread-safe
    (no state between calls)."""

    def __init__(self, schema: Dict[str, Any], where: str) -> None:
        check_keywords(schema, where)
        self._schema = schema
        self._validate = _compile(schema, schema.get("$defs", {}))
        self._keys_lock = threading.Lock()
        self._key_validators: Dict[str, Callable[..., Any]] = {}

    def first_violation(self, value: Any, path: str) -> Optional[str]:
        return self._run(self._validate, value, path)

    def _run(self, fn: Callable[..., Any], value: Any, path: str) -> Optional[str]:
        try:
            fn(value, name_prefix=path)
        except fastjsonschema.JsonSchemaValueException as exc:
            return self._message(exc)
        return None

    def _message(self, exc: "fastjsonschema.JsonSchemaValueException") -> str:
        path, rule, value = exc.name or "", exc.rule, exc.value
        sch = exc.definition if isinstance(exc.definition, dict) else {}
        if rule == "type":
            types = sch["type"] if isinstance(sch["type"], list) else [sch["type"]]
            return "{}: expected {}, found {} {}".format(
                path, " or ".join(types), json_type(value), short(value))
        if rule == "const":
            return "{}: expected {}, found {}".format(path, short(sch["const"]), short(value))
        if rule == "enum":
            return "{}: expected one of {}, found {}".format(
                path, ", ".join(json.dumps(e) for e in sch["enum"]), short(value))
        if rule == "pattern":
            return "{}: expected a string matching {}, found {}".format(
                path, sch["pattern"], short(value))
        if rule in _COUNTS:
            most, noun = _COUNTS[rule]
            return "{}: expected {} {} {}, found {}".format(
                path, most, sch[rule], noun, len(value))
        if rule in _BOUNDS:
            return "{}: expected {} {}, found {}".format(path, _BOUNDS[rule], sch[rule], value)
        if rule == "required":
            missing = [name for name in sch["required"] if name not in value]
            return "{}: expected key {!r}, found keys {}".format(
                path, missing[0] if missing else "?", short(sorted(value), 120))
        if rule == "additionalProperties" and sch.get("additionalProperties") is False:
            props = sch.get("properties", {})
            extra = [key for key in value if key not in props]
            return "{}: unexpected key {} (expected one of {})".format(
                path, short(extra[0] if extra else "?"), ", ".join(sorted(props)))
        if rule == "propertyNames" and isinstance(value, dict):
            names = self._key_validator(sch["propertyNames"])
            for key in value:
                err = self._run(names, key, "{} key {}".format(path, short(key)))
                if err:
                    return err
        if rule is None or rule in ("items", "propertyNames"):  # a false schema
            return "{}: not allowed here, found {}".format(path, short(value))
        said = exc.message[len(path):].strip() if exc.message.startswith(path) else exc.message
        return "{}: expected the schema's {} ({}), found {}".format(path, rule, said, short(value))

    def _key_validator(self, sub: Any) -> Callable[..., Any]:
        """The propertyNames schema compiled alone, to name the key that broke it (keyed by its
        text: the library rebuilds the definition it reports at each error, so there are as
        many keys as propertyNames schemas in the file)."""
        text = json.dumps(sub, sort_keys=True)
        with self._keys_lock:
            if text not in self._key_validators:
                self._key_validators[text] = _compile({"allOf": [sub]},
                                                      self._schema.get("$defs", {}))
            return self._key_validators[text]


_LATER = ("allOf", "if", "then", "else")


def _ordered(node: Any) -> Any:
    """The same schema with a node's own keywords checked before its allOf and if/then/else
    (fastjsonschema runs allOf first): an unexpected key is named before a missing one that
    a condition requires. A conjunction either way, so the meaning is unchanged."""
    if not isinstance(node, dict):
        return node
    out: Dict[str, Any] = {}
    for key, val in node.items():
        if key in ("properties", "$defs"):
            out[key] = {name: _ordered(sub) for name, sub in val.items()}
        elif key in ("then", "else") and isinstance(val, dict) and not set(val) - _ANNOTATIONS:
            out[key] = True  # fastjsonschema 2.21 generates a block with no body for {}
        elif key in ("items", "additionalProperties", "propertyNames", "if", "then", "else"):
            out[key] = _ordered(val)
        elif key == "allOf":
            out[key] = [_ordered(sub) for sub in val]
        else:
            out[key] = copy.deepcopy(val)
    own = {k: v for k, v in out.items() if k not in _LATER and k not in _ANNOTATIONS}
    if not own or not any(k in out for k in ("allOf", "if")):
        return out
    later = [own] + list(out.get("allOf", []))
    if "if" in out:
        later.append({k: out[k] for k in ("if", "then", "else") if k in out})
    return dict({k: v for k, v in out.items() if k in _ANNOTATIONS}, allOf=later)


def _compile(schema: Dict[str, Any], defs: Dict[str, Any]) -> Callable[..., Any]:
    """Compile as draft-07 (what check_keywords keeps equal to 2020-12) without the root's
    ``$id``: every $ref is local, so no base URI is needed."""
    doc = _ordered({key: val for key, val in schema.items() if key not in ("$id", "$schema")})
    doc["$schema"] = _DRAFT_07
    if defs and "$defs" not in doc:
        doc["$defs"] = copy.deepcopy(defs)
    return fastjsonschema.compile(doc)  # type: ignore[no-any-return]
