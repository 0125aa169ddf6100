"""The roll call's wire part (agent.wire.rollcall): buckets, topics and what an entry must be."""

import collections

from agent.wire import rollcall


def test_the_buckets_spread_10000_devices_into_pages_of_any_queue():
    counts = collections.Counter(rollcall.bucket("sim-{:05d}".format(i)) for i in range(10000))
    assert len(counts) == 256
    assert max(counts.values()) < 80  # 39 on average: 1/16 of the fleet is 625 entries
    firsts = collections.Counter(h1 for h1, _ in counts.elements())
    assert max(firsts.values()) < 1000


def test_an_entry_names_its_device_under_its_own_bucket():
    topic = rollcall.topic("jetson-agent", "dev1")
    h1, h2 = rollcall.bucket("dev1")
    assert topic == "jetson-agent/rollcall/{}/{}/dev1".format(h1, h2)
    assert rollcall.parse_entry("jetson-agent", topic, rollcall.encode_marker("dev1", 3)) == (
        "dev1", 3)
    assert rollcall.page_filter("p/q", "a") == "p/q/rollcall/a/+/+"
    assert rollcall.page_filter("p/q", "a", "0") == "p/q/rollcall/a/0/+"


def test_anything_else_on_a_roll_call_topic_is_ignored():
    good = rollcall.topic("jetson-agent", "dev1")
    h1, h2 = rollcall.bucket("dev1")
    wrong_bucket = "jetson-agent/rollcall/{}/{}/dev1".format(h1, "0" if h2 != "0" else "1")
    cases = [
        (wrong_bucket, rollcall.encode_marker("dev1", 1)),
        (good, rollcall.encode_marker("dev2", 1)),  # another device's entry
        (good, b'{"device": "dev1", "boot": -1}'),
        (good, b'{"device": "dev1", "boot": true}'),
        (good, b'{"device": "dev1"}'),
        (good, b"not json"),
        (good, b"[]"),
        (good, b""),
        (good, b" " * 600 + b'{"device": "dev1", "boot": 1}'),
        ("jetson-agent/rollcall/mark/x", b"token"),
        ("other/rollcall/{}/{}/dev1".format(h1, h2), rollcall.encode_marker("dev1", 1)),
        ("jetson-agent/rollcall/{}/{}/bad id".format(h1, h2), b'{"device": "bad id"}'),
    ]
    for topic, payload in cases:
        assert rollcall.parse_entry("jetson-agent", topic, payload) is None, (topic, payload)
