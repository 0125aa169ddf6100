"""Block transfer between a BlockServer and a BlockFetcher wired back to back in memory (the
MQTT broker is replaced by a queue; integration tests run the same classes over Mosquitto)."""

import collections
import hashlib
import os
import random

import pytest

from agent.device.journal.store import Journal
from agent.errors import AgentError
from agent.wire import protocol
from agent.wire.device.artifacts import ArtifactStore
from agent.wire.device.transfer import BlockFetcher, BlockServer
from agent.wire.topics import Topics

BS = 1024
T = Topics()


class Clock(object):
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Loopback(object):
    """A broker in a deque: publish() enqueues, pump() delivers; ``drop(topic)`` may lose
    messages on the way, as a broker restart or a full queue would."""

    def __init__(self):
        self.queue = collections.deque()
        self.drop = lambda topic: False
        self.requests = []  # decoded requests the server saw
        self.server = None
        self.fetcher = None
        self.completed = []

    def publish(self, topic, payload, qos, retain, properties=None):
        assert isinstance(payload, bytes) and qos == 1 and retain is False
        if not self.drop(topic):
            self.queue.append((topic, payload))

    def pump(self):
        while self.queue:
            topic, payload = self.queue.popleft()
            kind = T.parse(topic).kind
            if kind == "artifact_request":
                self.requests.append(protocol.decode("artifact_request", payload))
                self.server.handle_request(topic, payload)
            elif kind == "block":
                done = self.fetcher.handle_block(topic, payload)
                if done:
                    self.completed.append(done)


def blob(size, seed=1):
    return random.Random(seed).getrandbits(8 * size).to_bytes(size, "little")


def requested(requests, sha):
    out = []
    for r in requests:
        if r["sha256"] == sha:
            out += protocol.bitmap_indices(protocol.bitmap_decode(r["want"], r["blocks"]),
                                           r["blocks"])
    return out


@pytest.fixture
def env(tmp_path):
    clock = Clock()
    state = str(tmp_path / "device")
    journal = Journal(os.path.join(state, "journal.db"))
    store = ArtifactStore(state, journal, reserve_bytes=0)
    net = Loopback()
    net.server = BlockServer(net.publish, T, max_blocks_per_request=64)
    net.fetcher = BlockFetcher(store, net.publish, T, "dev", block_size=BS, window=8,
                               timeout_s=5.0, max_timeout_s=20.0, clock=clock)
    net.clock, net.store, net.journal, net.state = clock, store, journal, state
    yield net
    journal.close()


def serve(net, tmp_path, data, name="model.onnx"):
    path = tmp_path / name
    path.write_bytes(data)
    return net.server.add_file(str(path))


def test_moves_a_file_with_dropped_blocks(env, tmp_path):
    data = blob(50 * BS + 321)
    sha = serve(env, tmp_path, data)
    assert sha == hashlib.sha256(data).hexdigest()
    rng = random.Random(7)
    dropped = []

    def drop(topic):
        if "/block/" in topic and rng.random() < 0.2:
            dropped.append(topic)
            return True
        return False

    env.drop = drop
    assert env.fetcher.want(sha, len(data), job_id="j1") is None
    rounds = 0
    while not env.completed:
        env.pump()
        env.clock.now += 6.0  # past the request timeout: re-request what is still missing
        env.fetcher.tick()
        rounds += 1
        assert rounds < 100
    assert env.completed == [(sha, env.store.path(sha))]
    with open(env.store.path(sha), "rb") as f:
        assert f.read() == data
    # the window bounds what is in flight, and only missing blocks are asked for again
    assert all(protocol.bitmap_count(protocol.bitmap_decode(r["want"], r["blocks"]),
                                     r["blocks"]) <= 8 for r in env.requests)
    assert env.requests[0]["job_id"] == "j1"
    asked = requested(env.requests, sha)
    assert set(asked) == set(range(51))
    assert dropped and len(asked) == 51 + len(dropped)  # each re-request replaced a loss
    assert env.fetcher.active() == [] and env.journal.transfers() == []


def test_present_artifacts_are_never_requested(env, tmp_path):
    data = blob(3 * BS)
    sha = serve(env, tmp_path, data)
    env.store.put_file(str(tmp_path / "model.onnx"))
    assert env.fetcher.want(sha, len(data)) == env.store.path(sha)
    assert not env.queue and env.requests == []
    # a late duplicate block of a stored artifact is ignored quietly
    assert env.fetcher.on_block(sha, 0, data[:BS]) is None


def test_pipelining_without_losses_needs_no_timeouts(env, tmp_path):
    data = blob(40 * BS)
    sha = serve(env, tmp_path, data)
    env.fetcher.want(sha, len(data))
    env.pump()
    assert env.completed and env.server.blocks_sent == 40
    assert len(env.requests) >= 40 // 8


def test_resume_after_restart_requests_only_what_is_missing(env, tmp_path):
    data = blob(30 * BS + 1, seed=3)
    sha = serve(env, tmp_path, data)
    env.drop = lambda topic: "/block/" in topic and int(topic.rsplit("/", 1)[1]) >= 12
    env.fetcher.want(sha, len(data))
    env.pump()
    env.fetcher.close()  # the agent stops (bitmap persisted)
    env.journal.close()
    received_before = 12
    # a new process: new journal, store and fetcher over the same state directory
    journal = Journal(os.path.join(env.state, "journal.db"))
    store = ArtifactStore(env.state, journal, reserve_bytes=0)
    env.fetcher = BlockFetcher(store, env.publish, T, "dev", block_size=4 * BS, window=8,
                               clock=env.clock)
    env.requests.clear()
    env.drop = lambda topic: False
    env.fetcher.want(sha, len(data))
    assert env.fetcher.progress(sha) == (received_before, 31)  # the old block size is kept
    env.pump()
    assert env.completed and sorted(requested(env.requests, sha)) == list(range(12, 31))
    with open(store.path(sha), "rb") as f:
        assert f.read() == data
    journal.close()


def test_reconnect_re_requests_in_flight_blocks(env, tmp_path):
    data = blob(10 * BS)
    sha = serve(env, tmp_path, data)
    env.drop = lambda topic: True  # the broker goes away
    env.fetcher.want(sha, len(data))
    env.drop = lambda topic: False
    env.fetcher.on_reconnect()
    env.pump()
    assert env.completed


def test_timeouts_back_off_while_nothing_arrives(env, tmp_path):
    data = blob(4 * BS)
    sha = serve(env, tmp_path, data)
    env.drop = lambda topic: True  # the controller is offline
    sent = []
    real = env.publish
    env.fetcher._publish = lambda *a: (sent.append(env.clock.now), real(*a))
    env.fetcher.want(sha, len(data))
    for _ in range(120):
        env.clock.now += 1.0
        env.fetcher.tick()
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert gaps[:3] == [5.0, 10.0, 20.0] and set(gaps[3:]) == {20.0}


def test_by_default_the_back_off_stops_at_a_few_seconds(env, tmp_path):
    """An interrupted download (the controller gone a while) is asked for again every 8 s at
    most, not every 60 s: it resumes within seconds of the controller's return."""
    from agent.wire.device.transfer import MAX_BACKOFF_S

    data = blob(4 * BS)
    sha = serve(env, tmp_path, data)
    env.fetcher = BlockFetcher(env.store, env.publish, T, "dev", block_size=BS, window=8,
                               timeout_s=1.0, clock=env.clock)
    env.drop = lambda topic: True
    sent = []
    real = env.publish
    env.fetcher._publish = lambda *a: (sent.append(env.clock.now), real(*a))
    env.fetcher.want(sha, len(data))
    for _ in range(120):
        env.clock.now += 1.0
        env.fetcher.tick()
    gaps = [b - a for a, b in zip(sent, sent[1:])]
    assert gaps[:4] == [1.0, 2.0, 4.0, MAX_BACKOFF_S] and set(gaps[4:]) == {MAX_BACKOFF_S}


def test_hash_mismatch_from_a_wrong_file(env, tmp_path):
    data = blob(5 * BS, seed=1)
    wrong = tmp_path / "wrong.bin"
    wrong.write_bytes(blob(5 * BS, seed=2))
    sha = hashlib.sha256(data).hexdigest()
    env.server.add_file(str(wrong), sha256=sha)  # a controller serving the wrong bytes
    env.fetcher.want(sha, len(data))
    with pytest.raises(AgentError) as info:
        env.pump()
    assert info.value.code == "hash_mismatch"
    assert not env.store.has(sha) and env.fetcher.active() == []
    assert os.listdir(os.path.join(env.state, "artifacts", "partial")) == []


def test_bad_blocks(env, tmp_path):
    data = blob(3 * BS)
    sha = serve(env, tmp_path, data)
    other = "e" * 64
    with pytest.raises(AgentError) as info:
        env.fetcher.handle_block(T.block("dev", other, 0), b"x" * BS)
    assert info.value.code == "unknown_artifact"
    env.drop = lambda topic: True
    env.fetcher.want(sha, len(data))
    for topic, payload in ((T.block("dev", sha, 3), b"x" * BS),
                           (T.block("dev", sha, 0), b"x" * 10)):
        with pytest.raises(AgentError) as info:
            env.fetcher.handle_block(topic, payload)
        assert info.value.code == "unknown_artifact"
    assert env.fetcher.active() == [sha]  # the transfer goes on
    for topic in (T.block("other", sha, 0), T.status("dev")):
        with pytest.raises(AgentError) as info:
            env.fetcher.handle_block(topic, data[:BS])
        assert info.value.code == "bad_message"
    with pytest.raises(AgentError) as info:
        env.fetcher.handle_block(T.block("dev", sha, 0), bytes(protocol.MAX_BLOCK_SIZE + 1))
    assert info.value.code == "message_too_large"


def test_server_rejects_bad_requests(env, tmp_path):
    data = blob(20 * BS)
    sha = serve(env, tmp_path, data)
    topic = T.artifact_request("dev", sha)
    good = protocol.request_message(sha, len(data), BS, protocol.bitmap_new(20, fill=True))
    cases = [
        (T.artifact_request("dev", "e" * 64),
         protocol.request_message("e" * 64, len(data), BS, protocol.bitmap_new(20)),
         "unknown_artifact"),
        (topic, protocol.request_message(sha, len(data) + 1, BS, protocol.bitmap_new(21)),
         "unknown_artifact"),
        (topic, dict(good, blocks=19), "bad_message"),
        (topic, dict(good, sha256="e" * 64), "bad_message"),
        (topic, dict(good, want="!!"), "bad_message"),
        (T.status("dev"), good, "bad_message"),
    ]
    for t, msg, code in cases:
        with pytest.raises(AgentError) as info:
            env.server.handle_request(t, protocol.encode(msg))
        assert info.value.code == code
    with pytest.raises(AgentError) as info:
        env.server.handle_request(topic, b"{" * 10)
    assert info.value.code == "bad_message"
    with pytest.raises(AgentError) as info:
        env.server.handle_request(topic, b" " * (300 * 1024))
    assert info.value.code == "message_too_large"
    # one request is answered with at most max_blocks_per_request blocks
    env.server.max_blocks_per_request = 5
    assert env.server.handle_request(topic, protocol.encode(good)) == 5
    assert [T.parse(t).block for t, _ in env.queue] == [0, 1, 2, 3, 4]


def test_disk_full_is_reported_by_want(env, tmp_path):
    data = blob(8 * BS)
    sha = serve(env, tmp_path, data)
    env.store.reserve_bytes = 1 << 62
    with pytest.raises(AgentError) as info:
        env.fetcher.want(sha, len(data))
    assert info.value.code == "disk_full"
    assert env.fetcher.active() == [] and not env.queue
