import json
import math
import os
import random
import re

import numpy as np
import pytest

from agent.engines.backends import base
from agent.errors import AgentError
from agent.precision import compare
from agent.precision import search as agent_search
from agent.wire import json_schema, protocol
from tests.unit.wire_samples import SHA, code_of, job_doc

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


# ----------------------------------------------------------------------------- encode / decode

def test_encode_is_compact_and_json_safe():
    data = protocol.encode({"b": (1, 2), "a": float("nan"), "c": np.float32(1.5),
                            "d": np.arange(3), "e": float("inf"), "f": np.int64(7)})
    assert data == b'{"a":null,"b":[1,2],"c":1.5,"d":[0,1,2],"e":null,"f":7}'
    with pytest.raises(AgentError):
        protocol.encode({"x": object()})


def test_decode_valid_job():
    doc = job_doc()
    assert protocol.decode("job", protocol.encode(doc)) == doc


@pytest.mark.parametrize("payload, needle", [
    (b"", "invalid JSON"),
    (b"{", "invalid JSON"),
    (b"[1, 2]", "found array"),
    (b'"text"', "found string"),
    (b"\xff\xfe{}", "invalid UTF-8"),
    (b'{"job_id": "a", "job_id": "b"}', "duplicate key"),
    (b'{"x": NaN}', "NaN"),
    (b'{"x": -Infinity}', "Infinity"),
    (b'{"x": 1e400}', "out of range"),
    (b"[" * 50000 + b"]" * 50000, "nesting"),
    (b'{"a":' * 40 + b"1" + b"}" * 40, "nested at most"),
])
def test_decode_malformed(payload, needle):
    err = code_of("job", payload, max_bytes=1 << 20)
    assert err.code == "bad_message"
    assert needle in err.message


def test_decode_oversized():
    payload = protocol.encode(job_doc(artifacts={"model": {"sha256": SHA, "size": 1,
                                                           "name": "x" * 200}}))
    err = code_of("job", payload + b" " * (32 * 1024 - len(payload) + 1))
    assert err.code == "message_too_large"
    assert "32768" in err.message and str(32 * 1024 + 1) in err.message
    assert code_of("command", b"{}", max_bytes=1).code == "message_too_large"


def test_unknown_job_kind_is_its_own_code():
    err = code_of("job", protocol.encode(job_doc(kind="reboot")))
    assert err.code == "unknown_job_kind"
    assert "'reboot'" in err.message and "deploy" in err.message


@pytest.mark.parametrize("change, needle", [
    ({"plan": {"precision": "fp8"}}, "job.plan.precision: expected one of"),
    ({"plan": {"layer_precisions": {"a": "half"}}}, "job.plan.layer_precisions.a"),
    ({"timeout_s": -1}, "job.timeout_s: expected > 0"),
    ({"timeout_s": "60"}, "expected number, found string"),
    ({"job_id": "../../etc"}, "job.job_id: expected a string matching"),
    ({"artifacts": {"model": {"sha256": SHA, "size": 1, "path": "/etc/passwd"}}},
     "unexpected key 'path'"),
    ({"artifacts": {"weights": {"sha256": SHA, "size": 1}}}, "unexpected key 'weights'"),
    ({"artifacts": {"calibration": {"sha256": SHA, "size": 1}}}, "expected key 'model'"),
    ({"artifacts": {"model": {"sha256": SHA, "size": True}}}, "expected integer, found boolean"),
    ({"artifacts": {"model": {"sha256": SHA, "size": 1.5}}}, "expected integer, found number"),
    ({"plan": {"calibration": {"data": "/etc/shadow"}}}, "unexpected key 'data'"),
    ({"plan": {"shapes": {"x": [[1], [2]]}}}, "expected at least 3 items"),
    ({"gate": {"min_top1": 1.5}}, "expected <= 1"),
    ({"search": {"mode": "random"}}, "expected one of"),
    ({"protocol": 2}, "job.protocol: expected 1, found 2"),
    ({"extra": 1}, "unexpected key 'extra'"),
    ({"kind": "cancel"}, "expected key 'cancel'"),
    ({"kind": 5}, "job.kind: expected one of"),
])
def test_schema_violations_say_where_and_what(change, needle):
    err = code_of("job", protocol.encode(job_doc(**change)))
    assert err.code == "bad_message"
    assert needle in err.message, err.message


def test_pattern_anchoring_rejects_trailing_newline():
    err = code_of("job", protocol.encode(job_doc(job_id="abc\n")))
    assert err.code == "bad_message"


def test_validator_refuses_unknown_keywords(tmp_path, monkeypatch):
    with pytest.raises(ValueError):
        json_schema.check_keywords({"type": "object", "dependentRequired": {}}, "x")
    with pytest.raises(ValueError):
        json_schema.check_keywords({"properties": {"a": {"oneOf": []}}}, "x")


def test_fuzzed_payloads_only_raise_agent_errors():
    rng = random.Random(5)
    good = protocol.encode(job_doc())
    codes = set()
    for i in range(3000):
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            op = rng.random()
            pos = rng.randrange(len(data))
            if op < 0.4:
                data[pos] = rng.randrange(256)
            elif op < 0.7:
                del data[pos:pos + rng.randint(1, 20)]
            else:
                data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        if i % 10 == 0:
            data = bytearray(os.urandom(rng.randint(0, 64)))
        try:
            protocol.decode("job", bytes(data))
        except AgentError as exc:
            codes.add(exc.code)
    assert codes <= {"bad_message", "unknown_job_kind", "message_too_large"}
    assert "bad_message" in codes


# ----------------------------------------------------------------------------- the contract

def _doc_examples():
    """The JSON examples of docs/protocol.md, with placeholders made real."""
    with open(os.path.join(ROOT, "docs", "protocol.md")) as f:
        text = f.read()
    blocks = re.findall(r"```json\n(.*?)```", text, re.S)
    out = []
    for block in blocks:
        block = block.replace("<64 hex>", SHA).replace("<sha256>", SHA)
        block = block.replace("<key>", "k1").replace("<base64 bitmap>", "//////8=")
        decoder = json.JSONDecoder()
        pos = 0
        while block[pos:].strip():  # a block may hold several messages
            pos = len(block) - len(block[pos:].lstrip())
            msg, pos = decoder.raw_decode(block, pos)
            out.append(msg)
    return out


def _kind_of(example):
    if "models" in example:
        return "models"
    if "metrics" in example:
        return "telemetry"
    if "want" in example:
        return "artifact_request"
    if "ok" in example:
        return "command_reply"
    if "command" in example:
        return "command"
    if "online" in example:
        return "status"
    if "state" in example:
        return "job_status"
    return "job"


def test_documented_examples_validate_against_the_schema_files():
    examples = _doc_examples()
    kinds = {_kind_of(e) for e in examples}
    assert kinds == set(protocol.MESSAGE_KINDS)
    for example in examples:
        kind = _kind_of(example)
        protocol.validate(kind, example)
        assert protocol.decode(kind, protocol.encode(example)) == example
    request = [e for e in examples if _kind_of(e) == "artifact_request"][0]
    protocol.check_request(request)


def test_schema_files_agree_with_the_code():
    job = protocol.schema("job")
    defs = job["$defs"]
    assert tuple(job["properties"]["kind"]["enum"]) == protocol.JOB_KINDS
    assert tuple(job["properties"]["artifacts"]["properties"]) == protocol.ARTIFACT_ROLES
    assert tuple(defs["precision"]["enum"]) == base.PRECISIONS
    plan = defs["plan"]["properties"]
    assert tuple(plan["layer_precisions"]["additionalProperties"]["enum"]) == \
        base.LAYER_PRECISIONS
    assert tuple(plan["precision_constraints"]["enum"]) == base.CONSTRAINTS
    assert tuple(plan["calibration"]["properties"]["algorithm"]["enum"]) == \
        base.CALIB_ALGORITHMS
    assert tuple(job["properties"]["gate"]["properties"]["check_error_stat"]["enum"]) == \
        compare.ERROR_STATS
    search = job["properties"]["search"]["properties"]
    assert tuple(search["mode"]["enum"]) == agent_search.MODES
    assert tuple(search["direction"]["enum"]) == agent_search.DIRECTIONS
    status = protocol.schema("job_status")["properties"]
    assert tuple(status["state"]["enum"]) == protocol.STATES
    assert tuple(status["stage"]["enum"]) == protocol.STAGES
    assert tuple(protocol.schema("command")["properties"]["command"]["enum"]) == \
        protocol.COMMANDS
    for kind in protocol.MESSAGE_KINDS:
        sch = protocol.schema(kind)
        assert sch["$schema"].startswith("https://json-schema.org/draft/2020-12")
        assert sch["properties"]["protocol"] == {"type": "integer",
                                                 "const": protocol.PROTOCOL_VERSION}


# ----------------------------------------------------------------------------- states

def test_state_transitions():
    ok = protocol.next_state_ok
    assert ok(None, "QUEUED") and ok(None, "REJECTED") and not ok(None, "IN_PROGRESS")
    assert ok("QUEUED", "IN_PROGRESS") and ok("QUEUED", "CANCELED")
    assert ok("IN_PROGRESS", "IN_PROGRESS") and ok("IN_PROGRESS", "SUCCEEDED")
    assert not ok("QUEUED", "QUEUED") and not ok("QUEUED", "SUCCEEDED")
    for terminal in protocol.TERMINAL_STATES:
        assert protocol.is_terminal(terminal)
        assert not any(ok(terminal, s) for s in protocol.STATES)
    assert not ok("IN_PROGRESS", "PAUSED")


# ----------------------------------------------------------------------------- bitmaps

def test_bitmaps():
    blocks = 13
    bm = protocol.bitmap_from_indices([0, 5, 12], blocks)
    assert len(bm) == 2 and bm == bytes([0b00100001, 0b00010000])
    assert protocol.bitmap_indices(bm, blocks) == [0, 5, 12]
    assert protocol.bitmap_indices(bm, blocks, limit=2) == [0, 5]
    assert protocol.bitmap_count(bm, blocks) == 3
    full = protocol.bitmap_new(blocks, fill=True)
    assert protocol.bitmap_count(full, blocks) == 13 and full[-1] == 0b11111
    assert protocol.bitmap_decode(protocol.bitmap_encode(bm), blocks) == bm
    for text, needle in (("@@@", "base64"), (protocol.bitmap_encode(b"\x00"), "2 bytes"),
                         (protocol.bitmap_encode(b"\x00\x20"), "past the last")):
        with pytest.raises(AgentError) as info:
            protocol.bitmap_decode(text, blocks)
        assert info.value.code == "bad_message" and needle in info.value.message
    assert protocol.block_count(10, 4) == 3 and protocol.block_length(10, 4, 2) == 2
    assert protocol.block_length(10, 4, 3) == 0


def test_request_checks():
    msg = protocol.request_message(SHA, 10000, 1024, protocol.bitmap_from_indices([9], 10), "j")
    decoded = protocol.decode("artifact_request", protocol.encode(msg))
    assert protocol.bitmap_indices(protocol.check_request(decoded), 10) == [9]
    with pytest.raises(AgentError):
        protocol.check_request(dict(decoded, blocks=11))
    err = code_of("artifact_request", protocol.encode(dict(msg, block_size=100)))
    assert "block_size: expected >= 1024" in err.message


def test_numbers_are_finite_after_decode():
    msg = protocol.decode("telemetry", b'{"device":"d","ts":1.5,"metrics":{"t":[1e308]}}')
    assert math.isfinite(msg["metrics"]["t"][0])


def test_peek_kind_for_rejections():
    assert protocol.peek_kind(protocol.encode(job_doc(kind="reboot"))) == "reboot"
    assert protocol.peek_kind(b'{"kind": 5}') == ""
    assert protocol.peek_kind(b"\xff{") == ""
    assert protocol.peek_kind(b"[" * 100000) == ""
    assert protocol.peek_kind(b'{"kind": "' + b"x" * 100 + b'"}') == ""
