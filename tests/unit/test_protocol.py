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
from agent.wire import job_semantics, json_schema, protocol, status_messages
from agent.wire.topics import Topics, reply_topic

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHA = "0123456789abcdef" * 4
T = Topics()


def job_doc(**extra):
    doc = {
        "protocol": 1,
        "job_id": "deploy-42",
        "kind": "deploy",
        "device": "nano-07",
        "created": 1717171717.0,
        "timeout_s": 3600,
        "artifacts": {"model": {"sha256": SHA, "size": 1234, "name": "m.onnx"},
                      "calibration": {"sha256": "f" * 64, "size": 99}},
        "plan": {"precision": "int8", "layer_precisions": {"Softmax:0": "float32"},
                 "precision_constraints": "obey",
                 "calibration": {"algorithm": "minmax", "batch_size": 4},
                 "shapes": {"x": [[1, 3], [4, 3], [8, 3]]}},
        "fallback": ["fp16", "fp32"],
        "gate": {"atol": 0.01, "rtol": 0.001, "check_error_stat": "elemwise", "min_top1": 0.99},
        "bench": {"iterations": 100, "warmup": 10},
    }
    doc.update(extra)
    return doc


def code_of(kind, payload, **kw):
    with pytest.raises(AgentError) as info:
        protocol.decode(kind, payload, **kw)
    return info.value


# ----------------------------------------------------------------------------- topics

def test_topics_round_trip():
    cases = [
        (T.status("nano-07"), ("status", "nano-07", None, None, None)),
        (T.telemetry("d"), ("telemetry", "d", None, None, None)),
        (T.commands("d"), ("command", "d", None, None, None)),
        (T.command_reply("d"), ("command_reply", "d", None, None, None)),
        (T.job("d", "j.1"), ("job", "d", "j.1", None, None)),
        (T.job_status("d", "j_2"), ("job_status", "d", "j_2", None, None)),
        (T.artifact_request("d", SHA), ("artifact_request", "d", None, SHA, None)),
        (T.block("d", SHA, 0), ("block", "d", None, SHA, 0)),
        (T.block("d", SHA, 1048575), ("block", "d", None, SHA, 1048575)),
    ]
    for topic, expected in cases:
        assert tuple(T.parse(topic)) == expected
    assert T.job("d", "j") == "jetson-agent/devices/d/jobs/j"


def test_multi_level_prefix():
    topics = Topics("site-a/fleet")
    assert topics.parse(topics.job_status("d", "j")).job_id == "j"
    with pytest.raises(AgentError):
        topics.parse(T.status("d"))


@pytest.mark.parametrize("prefix", ["", "a//b", "a/+", "#", "$SYS", "a/b/"])
def test_bad_prefix_is_a_config_error(prefix):
    with pytest.raises(AgentError) as info:
        Topics(prefix)
    assert info.value.code == "bad_config"


@pytest.mark.parametrize("topic", [
    "other/devices/d/status",
    "jetson-agent/devices/d",
    "jetson-agent/devices/d/status/extra",
    "jetson-agent/devices/../status",
    "jetson-agent/devices/-rf/status",
    "jetson-agent/devices/" + "x" * 65 + "/status",
    "jetson-agent/devices/d/jobs/a b",
    "jetson-agent/devices/d/jobs/j/status/x",
    "jetson-agent/devices/d/artifacts/" + SHA.upper() + "/request",
    "jetson-agent/devices/d/artifacts/" + SHA[:-1] + "/request",
    "jetson-agent/devices/d/artifacts/" + SHA + "/block/01",
    "jetson-agent/devices/d/artifacts/" + SHA + "/block/-1",
    "jetson-agent/devices/d/artifacts/" + SHA + "/block/1048576",
    "jetson-agent/devices/d/artifacts/" + SHA + "/block/1e3",
    "jetson-agent/devices/d/artifacts/../../etc/passwd",
])
def test_bad_topics_are_rejected(topic):
    with pytest.raises(AgentError) as info:
        T.parse(topic)
    assert info.value.code == "bad_message"
    assert "expected" in info.value.message or "must" in info.value.message


def test_builders_validate_ids():
    for call in (lambda: T.job("d", "../x"), lambda: T.status("a/b"),
                 lambda: T.artifact_request("d", "abc"), lambda: T.block("d", SHA, -1)):
        with pytest.raises(AgentError):
            call()


def test_subscriptions():
    dev = T.device_subscriptions("d")
    assert ("jetson-agent/devices/d/jobs/+", 1) in dev
    assert ("jetson-agent/devices/d/artifacts/+/block/+", 1) in dev
    ctl = dict(T.controller_subscriptions(share_group="servers"))
    assert ctl["$share/servers/jetson-agent/devices/+/artifacts/+/request"] == 1
    assert "jetson-agent/devices/+/status" in ctl  # retained state is never shared
    assert not any("request" in f for f, _ in T.controller_subscriptions(serve_blocks=False))


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


def test_job_must_match_its_topic():
    doc = job_doc()
    job_semantics.check_job_topic(doc, "nano-07", "deploy-42")
    for device, job_id in (("other", "deploy-42"), ("nano-07", "other")):
        with pytest.raises(AgentError) as info:
            job_semantics.check_job_topic(doc, device, job_id)
        assert info.value.code == "bad_message"


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
        assert sch["properties"]["protocol"] == {"const": protocol.PROTOCOL_VERSION}


def test_plan_dict_builds_a_buildplan():
    plan = base.BuildPlan.from_dict(job_semantics.plan_dict(job_doc()))
    assert plan.precision == "int8"
    assert plan.layer_precisions == {"Softmax:0": "float32"}
    assert plan.calibration is not None and plan.calibration.algorithm == "minmax"
    assert plan.calibration.data is None
    assert plan.shapes == {"x": ((1, 3), (4, 3), (8, 3))}
    # int8 without calibration settings gets the defaults; fp16 gets none
    plan = base.BuildPlan.from_dict(job_semantics.plan_dict(job_doc(plan={"precision": "int8"})))
    assert plan.calibration is not None and plan.calibration.algorithm == "entropy2"
    assert job_semantics.plan_dict(job_doc(plan={"precision": "fp16"}))["calibration"] is None


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


def test_late_will_is_stale():
    will = status_messages.will_message("d", 3)
    protocol.validate("status", will)
    assert not status_messages.status_is_stale(None, will)
    assert not status_messages.status_is_stale(3, will)
    assert status_messages.status_is_stale(4, will)
    assert status_messages.status_is_stale(1, {"boot": "3"})


def test_builders_produce_valid_messages():
    status = status_messages.status_message(
        "d", True, 2, agent_version="0.1.0",
        platform={"board": "orin", "precisions": ["fp32", "fp16"], "cuda": "12.2"},
        active_engines=[{"model": SHA, "engine_key": "k", "precision": "int8",
                         "activated": 1.0, "job_id": None, "info": {}}], ts=5.0)
    protocol.validate("status", status)
    row = {"job_id": "j", "kind": "search", "state": "SUCCEEDED", "version": 4, "stage":
           "searching", "progress": {"done": 3, "of": 3}, "details": {"n": 3}, "error": None,
           "result": {"accuracy": {"passed": True, "sqnr_db": float("inf")},
                      "latency_ms": {"p99": 1.5}, "layers_kept": {"Add": "float32"}},
           "updated": 10.0}
    msg = status_messages.job_status_message("d", row)
    assert msg["statusDetails"] == {"n": "3", "stage": "searching"}
    decoded = protocol.decode("job_status", protocol.encode(msg))
    assert decoded["result"]["accuracy"]["sqnr_db"] is None
    failed = dict(row, state="FAILED", error={"code": "build_failed", "message": "x"})
    msg = status_messages.job_status_message("d", dict(failed, result=None))
    assert "result" not in msg and msg["statusDetails"]["error_code"] == "build_failed"
    protocol.validate("job_status", msg)
    pub = status_messages.job_status_publication(T, "d", failed)
    assert pub.topic == T.job_status("d", "j") and pub.qos == 1 and pub.retain
    with pytest.raises(AgentError):  # FAILED needs an error
        protocol.validate("job_status", dict(msg, error=None))


def test_commands_and_replies():
    cmd = protocol.decode("command", b'{"command":"cancel","job_id":"j","request_id":"r1",'
                          b'"correlation":"c"}')
    reply = status_messages.command_reply("d", cmd, True, result={"state": "CANCELED"})
    assert reply["request_id"] == "r1" and reply["correlation"] == "c"
    protocol.validate("command_reply", reply)
    bad = status_messages.command_reply("d", {"command": 5}, False,
                                        error=AgentError("unknown_job", "no job").to_dict())
    protocol.validate("command_reply", bad)
    assert code_of("command", b'{"command":"cancel"}').code == "bad_message"
    assert code_of("command", b'{"command":"reboot"}').code == "bad_message"
    assert reply_topic(T, "d", cmd) == T.command_reply("d")
    mine = T.command_reply("d") + "/r-18"
    assert reply_topic(T, "d", {"reply_to": mine}) == mine
    assert reply_topic(T, "d", {"reply_to": "ctl/r"}, mine) == mine
    assert T.parse(mine).kind == "command_reply"
    # Only the controller's reply topics: not another device's, not a job status, not elsewhere.
    for topic in ("ctl/#", "$SYS/x", "a/+/b", "x" * 300, "", "ctl/r", T.status("d"),
                  T.command_reply("e"), T.job_status("d", "j1"), mine + "/x",
                  T.command_reply("d") + "/"):
        with pytest.raises(AgentError):
            reply_topic(T, "d", {"reply_to": topic})


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
