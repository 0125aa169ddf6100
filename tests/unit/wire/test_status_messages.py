import pytest

from agent.errors import AgentError
from agent.wire import protocol, status_messages
from agent.wire.topics import Topics, reply_topic
from tests.unit.wire_samples import SHA, code_of

T = Topics()


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
