"""Artifact fan-out: devices fetching the same artifact listen on its shared block topic
(``{p}/artifacts/{sha}/block/N``) and say so in their requests; the server publishes each
block there once per window however many devices ask, the broker (here a loop in memory)
hands it to all of them. A device whose broker never delivers the shared topic (an ACL
without it) falls back to its own block topic after a request timeout."""

import collections
import os

from agent.device.journal.store import Journal
from agent.wire import protocol
from agent.wire.device.artifacts import ArtifactStore
from agent.wire.device.transfer import BlockFetcher, BlockServer
from tests.unit.wire.test_transfer import BS, Clock, T, blob


class Broker(object):
    def __init__(self):
        self.queue = collections.deque()
        self.subs = collections.defaultdict(set)  # device -> shared filters
        self.deaf = set()  # devices the shared topic never reaches
        self.published = []  # (topic, bytes) the server published
        self.server = None
        self.fetchers = {}
        self.completed = collections.defaultdict(list)

    def publish(self, topic, payload, qos, retain, properties=None):
        self.queue.append((topic, payload))

    def server_publish(self, topic, payload, qos, retain):
        self.published.append((topic, len(payload)))
        self.publish(topic, payload, qos, retain)

    def pump(self):
        while self.queue:
            topic, payload = self.queue.popleft()
            info = T.parse(topic)
            if info.kind == "artifact_request":
                self.server.handle_request(topic, payload)
                continue
            if info.device:
                targets = [info.device]
            else:
                flt = T.fanout_blocks(info.sha256)
                targets = [d for d, subs in self.subs.items()
                           if flt in subs and d not in self.deaf]
            for dev in targets:
                done = self.fetchers[dev].handle_block(topic, payload)
                if done:
                    self.completed[dev].append(done)


def make(tmp_path, broker, clock, dev):
    state = str(tmp_path / dev)
    journal = Journal(os.path.join(state, "journal.db"))
    store = ArtifactStore(state, journal, reserve_bytes=0)
    f = BlockFetcher(store, broker.publish, T, dev, block_size=BS, window=8, timeout_s=5.0,
                     max_timeout_s=20.0, clock=clock)
    f.subscribe = lambda topic, qos=1: broker.subs[dev].add(topic)
    f.unsubscribe = lambda topic: broker.subs[dev].discard(topic)
    broker.fetchers[dev] = f
    return f, journal


def run(broker, clock, devices, rounds=40):
    for _ in range(rounds):
        broker.pump()
        if all(broker.completed[d] for d in devices):
            return
        clock.now += 6.0
        for d in devices:
            broker.fetchers[d].tick()
    raise AssertionError({d: broker.fetchers[d].active() for d in devices})


def test_one_copy_per_window_for_every_device(tmp_path):
    clock = Clock()
    broker = Broker()
    broker.server = BlockServer(broker.server_publish, T, clock=clock)
    data = blob(30 * BS + 11)
    (tmp_path / "m.bin").write_bytes(data)
    sha = broker.server.add_file(str(tmp_path / "m.bin"))
    devices = ["d{}".format(i) for i in range(10)]
    journals = []
    for d in devices:
        f, j = make(tmp_path, broker, clock, d)
        journals.append(j)
        assert f.want(sha, len(data), "j1") is None
    run(broker, clock, devices)
    for d in devices:
        (got_sha, path), = broker.completed[d]
        with open(path, "rb") as f:
            assert got_sha == sha and f.read() == data
        assert broker.subs[d] == set()  # unsubscribed once complete
    blocks = protocol.block_count(len(data), BS)
    assert all("/devices/" not in t for t, _ in broker.published)
    assert len(broker.published) == blocks  # ten devices, each block published once
    assert broker.server.blocks_deduped == (len(devices) - 1) * blocks
    for j in journals:
        j.close()


def test_a_device_the_shared_topic_never_reaches_falls_back(tmp_path):
    clock = Clock()
    broker = Broker()
    broker.server = BlockServer(broker.server_publish, T, clock=clock)
    data = blob(5 * BS)
    (tmp_path / "m.bin").write_bytes(data)
    sha = broker.server.add_file(str(tmp_path / "m.bin"))
    f, journal = make(tmp_path, broker, clock, "deaf")
    broker.deaf.add("deaf")
    assert f.want(sha, len(data), "j1") is None
    run(broker, clock, ["deaf"])
    with open(broker.completed["deaf"][0][1], "rb") as fh:
        assert fh.read() == data
    assert any("/devices/deaf/" in t for t, _ in broker.published)
    journal.close()


def test_a_window_larger_than_a_request_goes_out_as_several_requests(tmp_path):
    clock = Clock()
    broker = Broker()
    broker.server = BlockServer(broker.server_publish, T, max_blocks_per_request=64,
                                clock=clock)
    data = blob(300 * BS)
    (tmp_path / "m.bin").write_bytes(data)
    sha = broker.server.add_file(str(tmp_path / "m.bin"))
    f, journal = make(tmp_path, broker, clock, "wide")
    f.window = 256
    assert f.want(sha, len(data), "j1") is None
    broker.pump()  # no timeout needed: every block asked for is answered
    assert broker.completed["wide"] and broker.completed["wide"][0][0] == sha
    journal.close()


def late_joiner(tmp_path):
    """A device ("first") fetches a 6-block artifact on the shared topic; 0.5 s later, inside
    the server's window, another ("late") asks for it. Returns (clock, broker, sha, data, the
    late fetcher, both journals)."""
    clock = Clock()
    broker = Broker()
    broker.server = BlockServer(broker.server_publish, T, clock=clock)
    data = blob(6 * BS)
    (tmp_path / "m.bin").write_bytes(data)
    sha = broker.server.add_file(str(tmp_path / "m.bin"))
    first, j1 = make(tmp_path, broker, clock, "first")
    assert first.want(sha, len(data), "j1") is None
    broker.pump()
    assert broker.completed["first"]
    clock.now += 0.5  # inside the 2 s window
    late, j2 = make(tmp_path, broker, clock, "late")
    assert late.want(sha, len(data), "j2") is None
    broker.pump()
    return clock, broker, sha, data, late, (j1, j2)


def test_a_device_joining_within_the_window_falls_back_after_a_short_wait(tmp_path):
    # The second stage of a rollout asks for blocks fanned out a moment before it listened:
    # the server does not send them again within its window (fan-out stays one copy), and the
    # device goes to its own topic after the short first timeout, not a full request timeout.
    from agent.wire.device.transfer import FANOUT_FIRST_TIMEOUT_S

    clock, broker, sha, data, late, (j1, j2) = late_joiner(tmp_path)
    assert not broker.completed["late"]  # deduplicated: one copy per window
    clock.now += FANOUT_FIRST_TIMEOUT_S
    late.tick()
    broker.pump()
    (got_sha, path), = broker.completed["late"]
    with open(path, "rb") as f:
        assert got_sha == sha and f.read() == data
    j1.close()
    j2.close()
