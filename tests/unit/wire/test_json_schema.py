"""The schema validator (fastjsonschema under agent.wire.json_schema): one message per keyword in
our words, the guards against keywords the library would read differently from draft 2020-12,
``$`` anchoring, booleans that Python calls numbers, and the per-kind compile done once under
concurrency."""

import json
import threading

import pytest

from agent.errors import AgentError
from agent.wire import json_schema, protocol
from tests.unit.wire_samples import SHA, code_of, job_doc

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "urn:test:schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["n"],
    "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 9},
        "x": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        "s": {"type": "string", "minLength": 2, "maxLength": 3, "pattern": "^[a-z]+$"},
        "e": {"enum": ["a", "b"]},
        "c": {"type": "boolean", "const": True},
        "l": {"type": "array", "minItems": 1, "maxItems": 2, "items": {"$ref": "#/$defs/id"}},
        "o": {"type": "object", "minProperties": 1, "maxProperties": 2,
              "propertyNames": {"maxLength": 3}},
        "never": False,
        "t": {"type": ["string", "null"]},
    },
    "allOf": [{"if": {"properties": {"e": {"const": "b"}}}, "then": {"required": ["s"]}}],
    "$defs": {"id": {"type": "string", "pattern": "^[0-9a-f]{4}$"}},
}


@pytest.mark.parametrize("value, message", [
    ([], "t: expected object, found array []"),
    ({}, "t: expected key 'n', found keys []"),
    ({"n": 1, "z": 0}, "t: unexpected key 'z' (expected one of c, e, l, n, never, o, s, t, x)"),
    ({"n": 0}, "t.n: expected >= 1, found 0"),
    ({"n": 10}, "t.n: expected <= 9, found 10"),
    ({"n": True}, "t.n: expected integer, found boolean True"),
    ({"n": 1.5}, "t.n: expected integer, found number 1.5"),
    ({"n": 1, "x": 0}, "t.x: expected > 0, found 0"),
    ({"n": 1, "x": 1}, "t.x: expected < 1, found 1"),
    ({"n": 1, "s": "a"}, "t.s: expected at least 2 characters, found 1"),
    ({"n": 1, "s": "abcd"}, "t.s: expected at most 3 characters, found 4"),
    ({"n": 1, "s": "AB"}, "t.s: expected a string matching ^[a-z]+$, found 'AB'"),
    ({"n": 1, "s": "ab\n"}, "t.s: expected a string matching ^[a-z]+$, found 'ab\\n'"),
    ({"n": 1, "e": "z"}, 't.e: expected one of "a", "b", found \'z\''),
    ({"n": 1, "c": False}, "t.c: expected True, found False"),
    ({"n": 1, "c": 1}, "t.c: expected boolean, found integer 1"),
    ({"n": 1, "l": []}, "t.l: expected at least 1 items, found 0"),
    ({"n": 1, "l": ["aaaa"] * 3}, "t.l: expected at most 2 items, found 3"),
    ({"n": 1, "l": ["aaaa", "AAAA"]}, "t.l[1]: expected a string matching ^[0-9a-f]{4}$, "
                                      "found 'AAAA'"),
    ({"n": 1, "o": {}}, "t.o: expected at least 1 keys, found 0"),
    ({"n": 1, "o": {"a": 1, "b": 2, "c": 3}}, "t.o: expected at most 2 keys, found 3"),
    ({"n": 1, "o": {"a": 1, "long": 2}}, "t.o key 'long': expected at most 3 characters, "
                                         "found 4"),
    ({"n": 1, "never": 0}, "t.never: not allowed here, found 0"),
    ({"n": 1, "t": 5}, "t.t: expected string or null, found integer 5"),
    ({"n": 1, "e": "b"}, "t: expected key 's', found keys ['e', 'n']"),
])
def test_each_keyword_says_where_what_was_expected_and_what_was_found(value, message):
    assert json_schema.Validator(SCHEMA, "t").first_violation(value, "t") == message


def test_valid_values_pass():
    ok = {"n": 3, "x": 0.5, "s": "ab", "e": "b", "c": True, "l": ["00ff"], "o": {"a": 1},
          "t": None}
    assert json_schema.Validator(SCHEMA, "t").first_violation(ok, "t") is None


def test_own_keywords_are_named_before_a_condition_they_also_break():
    """fastjsonschema checks allOf first; the validator keeps the old order, so a typo'd
    key is named rather than the key a condition then misses."""
    err = code_of("job", protocol.encode(job_doc(artifacts={"weights": {"sha256": SHA,
                                                                        "size": 1}})))
    assert "unexpected key 'weights'" in err.message


@pytest.mark.parametrize("schema, needle", [
    ({"type": "object", "dependentRequired": {}}, "unsupported schema keywords"),
    ({"properties": {"a": {"$ref": "#/$defs/x", "maxLength": 3}}}, "beside a $ref"),
    ({"properties": {"a": {"$ref": "other.json#/x"}}}, "only local $refs"),
    ({"properties": {"a": {"const": 1}}}, "needs a type"),
    ({"properties": {"a": {"enum": ["x", False]}}}, "needs a type"),
    ({"properties": {"a": {"type": "string", "pattern": "^a[$]b$"}}}, "only as its end anchor"),
    ({"type": "array", "items": [{"type": "string"}]}, "prefixItems"),
    ({"$defs": {"a": {"$id": "urn:x", "type": "string"}}}, "at the root only"),
    ({"properties": {"a": 5}}, "expected a schema object or boolean"),
])
def test_keywords_the_library_would_read_differently_are_refused(schema, needle):
    with pytest.raises(ValueError) as exc:
        json_schema.Validator(schema, "x")
    assert needle in str(exc.value)


def test_an_escaped_dollar_and_a_described_ref_are_fine():
    json_schema.check_keywords({"properties": {
        "a": {"type": "string", "pattern": "^a\\$b$"},
        "b": {"$ref": "#/$defs/x", "description": "annotations may stand beside a $ref"}},
        "$defs": {"x": {"type": "string"}}}, "x")


@pytest.mark.parametrize("kind, field, value", [
    ("job", "job_id", "abc\n"),
    ("job", "device", "nano-07\n"),
    ("job", "model_name", "resnet\n"),
    ("job", "artifacts", {"model": {"sha256": SHA + "\n", "size": 1}}),
])
def test_dollar_anchored_patterns_refuse_a_trailing_newline(kind, field, value):
    err = code_of(kind, protocol.encode(job_doc(**{field: value})))
    assert err.code == "bad_message" and "expected a string matching" in err.message


@pytest.mark.parametrize("kind, msg, needle", [
    ("job", job_doc(protocol=True), "job.protocol: expected integer, found boolean True"),
    ("command_reply", {"protocol": 1, "device": "d", "command": "cancel", "ok": 0},
     "command_reply.ok: expected boolean"),
])
def test_booleans_are_not_numbers(kind, msg, needle):
    with pytest.raises(AgentError) as exc:
        protocol.validate(kind, msg)
    assert exc.value.code == "bad_message" and needle in exc.value.message


def test_an_integral_number_decodes_as_an_int():
    """JSON Schema calls 1.0 an integer; decode makes it one, so integer fields are ints."""
    doc = job_doc()
    doc["artifacts"]["model"]["size"] = 1234.0
    text = json.dumps(doc).encode("utf-8")
    assert b"1234.0" in text
    size = protocol.decode("job", text)["artifacts"]["model"]["size"]
    assert size == 1234 and type(size) is int


def test_each_kind_compiles_once_whatever_the_threads(monkeypatch):
    made = []
    real = json_schema.Validator

    def counting(schema, where):
        made.append(where)
        return real(schema, where)

    monkeypatch.setattr(protocol, "Validator", counting)
    monkeypatch.setattr(protocol, "_VALIDATORS", {})
    start = threading.Barrier(8)
    errors = []

    def check():
        start.wait()
        try:
            protocol.validate("job", job_doc())
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=check) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and made == ["job"]


def test_every_schema_file_compiles():
    for kind in protocol.MESSAGE_KINDS:
        assert protocol._validator(kind) is protocol._validator(kind)


def test_a_bad_key_compiles_its_propertynames_schema_once():
    """The library rebuilds the failing definition at each error: hostile keys must not grow
    a cache of compiled key validators."""
    validator = json_schema.Validator(SCHEMA, "t")
    for i in range(50):
        err = validator.first_violation({"n": 1, "o": {"k" * (4 + i): 1}}, "t")
        assert err.startswith("t.o key 'kkkk") and "expected at most 3 characters" in err
    assert len(validator._key_validators) == 1
