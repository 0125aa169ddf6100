"""Per-block hashes from the signed manifest (issue 10, 5b): an attacker on an open broker who
answers every block request first, with right-sized junk, no longer poisons the file: each
junk block is dropped and asked again, the genuine one is kept. The hash list itself is an
artifact (content-addressed); a poisoned copy of it is fetched again, not fatal."""

import hashlib

from agent.errors import AgentError
from agent.wire import protocol
from agent.wire.device.transfer import block_digests
from tests.unit.wire import test_transfer
from tests.unit.wire.test_transfer import BS, T, blob, serve

env = test_transfer.env  # the in-memory broker fixture


def attack_then_serve(net, junk_for):
    """Deliver everything; before the server answers a request, junk for each block asked."""
    while net.queue:
        topic, payload = net.queue.popleft()
        info = T.parse(topic)
        if info.kind == "artifact_request":
            msg = protocol.decode("artifact_request", payload)
            want = protocol.bitmap_decode(msg["want"], msg["blocks"])
            for i in protocol.bitmap_indices(want, msg["blocks"]):
                if junk_for(msg["sha256"]):
                    bad = b"\x00" * protocol.block_length(msg["size"], msg["block_size"], i)
                    try:
                        net.fetcher.handle_block(T.block("dev", msg["sha256"], i), bad)
                    except AgentError as exc:
                        assert exc.code in ("unknown_artifact", "hash_mismatch"), exc
                        net.rejected.append((msg["sha256"], i, exc.code))
            net.server.handle_request(topic, payload)
        elif info.kind == "block":
            done = net.fetcher.handle_block(topic, payload)
            if done:
                net.completed.append(done)


def serve_with_hashes(env, tmp_path, data):
    sha = serve(env, tmp_path, data)
    digests = block_digests(str(tmp_path / "model.onnx"), BS)
    (tmp_path / "model.blocks").write_bytes(digests)
    list_sha = env.server.add_file(str(tmp_path / "model.blocks"))
    assert list_sha == hashlib.sha256(digests).hexdigest()
    env.rejected = []
    return sha, {"block_size": BS, "sha256": list_sha}


def run_to_completion(env, junk_for):
    rounds = 0
    while not env.completed:
        attack_then_serve(env, junk_for)
        env.clock.now += 6.0
        env.fetcher.tick()
        rounds += 1
        assert rounds < 50


def test_junk_blocks_answered_first_are_dropped_and_asked_again(env, tmp_path):
    data = blob(20 * BS + 77)
    sha, blocks = serve_with_hashes(env, tmp_path, data)
    assert env.fetcher.want(sha, len(data), "j1", blocks=blocks) is None
    run_to_completion(env, lambda s: s == sha)
    assert env.completed == [(sha, env.store.path(sha))]
    with open(env.store.path(sha), "rb") as f:
        assert f.read() == data
    assert len([r for r in env.rejected if r[0] == sha]) == 21  # every junk block dropped
    assert env.fetcher.bad_blocks == 21
    assert env.fetcher.active() == []


def test_a_poisoned_hash_list_is_fetched_again(env, tmp_path):
    data = blob(5 * BS)
    sha, blocks = serve_with_hashes(env, tmp_path, data)
    attacked = {"left": 1}

    def junk_for(s):  # the list's first answer only
        if s == blocks["sha256"] and attacked["left"]:
            attacked["left"] -= 1
            return True
        return False

    assert env.fetcher.want(sha, len(data), "j1", blocks=blocks) is None
    run_to_completion(env, junk_for)
    with open(env.store.path(sha), "rb") as f:
        assert f.read() == data
    assert env.completed[-1][0] == sha


def test_without_hashes_the_transfer_is_as_before(env, tmp_path):
    data = blob(4 * BS)
    sha, _ = serve_with_hashes(env, tmp_path, data)
    assert env.fetcher.want(sha, len(data), "j1") is None
    run_to_completion(env, lambda s: False)
    assert env.completed == [(sha, env.store.path(sha))]


def test_a_hash_list_poisoned_on_every_mqtt_answer_for_a_while_does_not_fail_the_job(
        env, tmp_path):
    """Junk completing the list 20 times (more than MAX_LIST_TRIES): junk from the broker,
    where anyone may answer, never counts towards failing the job."""
    from agent.wire.device.transfer import MAX_LIST_TRIES

    data = blob(5 * BS)
    sha, blocks = serve_with_hashes(env, tmp_path, data)
    assert env.fetcher.want(sha, len(data), "j1", blocks=blocks) is None
    for _ in range(4 * MAX_LIST_TRIES):  # the list is one block of 5 x 32 bytes
        assert env.fetcher.handle_block(T.block("dev", blocks["sha256"], 0), b"\1" * 160) \
            is None
    run_to_completion(env, lambda s: False)
    with open(env.store.path(sha), "rb") as f:
        assert f.read() == data


def test_the_hash_list_comes_from_the_trusted_http_source_when_the_job_names_one(
        env, tmp_path):
    """With the service's URL the list is fetched over HTTP like the artifact: junk on the
    broker answering every block request changes nothing."""
    from agent.fleet.transfer.http_source import HttpSource
    from tests.unit.fleet.test_http_source import wait_http

    data = blob(6 * BS)
    sha, blocks = serve_with_hashes(env, tmp_path, data)
    http = HttpSource("127.0.0.1", 0, env.server.files).start()
    try:
        url = "http://127.0.0.1:{}/artifacts/{}".format(http.port, sha)
        assert env.fetcher.want(sha, len(data), "j1", blocks=blocks, url=url) is None
        attack_then_serve(env, lambda s: True)  # nothing asked over MQTT
        done = wait_http(env, sha)
        assert done == [(sha, env.store.path(sha))]
        with open(env.store.path(sha), "rb") as f:
            assert f.read() == data
        assert not [r for r in env.requests if r["sha256"] in (sha, blocks["sha256"])]
    finally:
        http.stop()
