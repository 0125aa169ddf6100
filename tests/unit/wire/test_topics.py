import pytest

from agent.errors import AgentError
from agent.wire.topics import Topics
from tests.unit.wire_samples import SHA

T = Topics()


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
