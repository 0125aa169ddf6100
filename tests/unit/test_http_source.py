"""Artifacts over HTTP: the service's store (agent.fleet.transfer.http_source, a real loopback HTTP
server) and a device's BlockFetcher with a URL (agent.wire.http_fetch): Range requests into the
same transfer and bitmap as MQTT blocks, so a download resumes; blocks checked against the
signed per-block hashes; a source answering junk or nothing hands the artifact back to MQTT
blocks."""

import time
import urllib.request

from agent.fleet.transfer.http_source import HttpSource
from tests.unit import test_transfer
from tests.unit.test_transfer import BS, blob, serve
from tests.unit.test_transfer_block_hashes import serve_with_hashes

env = test_transfer.env  # the in-memory broker fixture


def wait_http(net, sha, timeout=20):
    deadline = time.monotonic() + timeout
    while not net.fetcher.http_completed:
        assert time.monotonic() < deadline, net.fetcher.progress(sha)
        time.sleep(0.05)
    return net.fetcher.http_completed


def test_range_requests_are_served_from_the_store(env, tmp_path):
    data = blob(3 * BS + 5)
    sha = serve(env, tmp_path, data)
    http = HttpSource("127.0.0.1", 0, env.server.files).start()
    try:
        url = "http://127.0.0.1:{}/artifacts/{}".format(http.port, sha)
        req = urllib.request.Request(url, headers={"Range": "bytes=1024-2047"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 206 and resp.read() == data[1024:2048]
            assert resp.headers["Content-Range"] == "bytes 1024-2047/{}".format(len(data))
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200 and resp.read() == data
    finally:
        http.stop()


def test_a_device_fetches_over_http_resuming_and_checking_hashes(env, tmp_path):
    data = blob(40 * BS + 9)
    sha, blocks = serve_with_hashes(env, tmp_path, data)
    http = HttpSource("127.0.0.1", 0, env.server.files).start()
    try:
        # Half of it came over MQTT before (a restart): HTTP asks only for the rest.
        transfer = env.store.begin(sha, len(data), BS)
        for i in range(0, 20):
            assert transfer.write_block(i, data[i * BS:(i + 1) * BS])
        transfer.close()
        url = "http://127.0.0.1:{}/artifacts/{}".format(http.port, sha)
        assert env.fetcher.want(sha, len(data), "j1", blocks=blocks, url=url) is None
        for _ in range(20):  # the hash list comes over MQTT blocks first
            env.pump()
        done = wait_http(env, sha)
        assert done == [(sha, env.store.path(sha))]
        with open(env.store.path(sha), "rb") as f:
            assert f.read() == data
        assert [r for r in env.requests if r["sha256"] == sha] == []  # no MQTT block asked
    finally:
        http.stop()


def test_a_junk_or_dead_source_hands_over_to_mqtt_blocks(env, tmp_path):
    data = blob(6 * BS)
    sha, blocks = serve_with_hashes(env, tmp_path, data)
    (tmp_path / "junk").write_bytes(b"\x01" * len(data))
    http = HttpSource("127.0.0.1", 0, lambda: {sha: (str(tmp_path / "junk"), len(data))})
    http.start()
    try:
        url = "http://127.0.0.1:{}/artifacts/{}".format(http.port, sha)
        assert env.fetcher.want(sha, len(data), "j1", blocks=blocks, url=url) is None
        deadline = time.monotonic() + 20
        while not env.completed:
            env.pump()
            env.clock.now += 6.0
            env.fetcher.tick()
            time.sleep(0.05)
            assert time.monotonic() < deadline
        with open(env.store.path(sha), "rb") as f:
            assert f.read() == data
        assert [r for r in env.requests if r["sha256"] == sha]  # MQTT took over
    finally:
        http.stop()
    # Nobody listening at all: the same.
    data2 = blob(2 * BS, seed=5)
    sha2 = serve(env, tmp_path, data2, name="other.bin")
    env.completed.clear()
    assert env.fetcher.want(sha2, len(data2), "j2", url="http://127.0.0.1:9/none") is None
    deadline = time.monotonic() + 20
    while not env.completed:
        env.pump()
        env.clock.now += 6.0
        env.fetcher.tick()
        time.sleep(0.05)
        assert time.monotonic() < deadline
    assert env.completed[-1][0] == sha2
