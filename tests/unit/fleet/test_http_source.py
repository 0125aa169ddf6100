"""Artifacts over HTTP: the service's store (agent.fleet.transfer.http_source, a real loopback HTTP
server) and a device's BlockFetcher with a URL (agent.wire.device.http_fetch): Range requests
into the same transfer and bitmap as MQTT blocks, so a download resumes; blocks checked against the
signed per-block hashes; a source answering junk or nothing hands the artifact back to MQTT
blocks."""

import time
import urllib.request

from agent.fleet.transfer.http_source import HttpSource
from tests.unit.wire import test_transfer
from tests.unit.wire.test_transfer import BS, blob, serve
from tests.unit.wire.test_transfer_block_hashes import serve_with_hashes

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


def test_a_busy_server_is_asked_again_before_mqtt_takes_over(env, tmp_path, monkeypatch):
    """The server's connections from this address are all taken (devices behind one NAT
    address): 503 with Retry-After; the device asks again a second later and gets it over
    HTTP, no MQTT block asked."""
    import socket

    from agent.fleet.transfer import http_bounds

    monkeypatch.setattr(http_bounds, "PER_CLIENT", 1)
    data = blob(6 * BS)
    sha = serve(env, tmp_path, data)
    http = HttpSource("127.0.0.1", 0, env.server.files).start()
    held = socket.create_connection(("127.0.0.1", http.port), timeout=5)
    try:
        held.sendall(b"GET /artifacts/")  # the address's one connection, half-sent
        deadline = time.monotonic() + 10
        while http.httpd.busy < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        url = "http://127.0.0.1:{}/artifacts/{}".format(http.port, sha)
        assert env.fetcher.want(sha, len(data), "j1", url=url) is None
        deadline = time.monotonic() + 10
        while http.httpd.refused_client < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        held.close()  # the slot comes back
        done = wait_http(env, sha)
        assert done == [(sha, env.store.path(sha))]
        assert [r for r in env.requests if r["sha256"] == sha] == []
    finally:
        held.close()
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


def _until(predicate, what, timeout=20):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_https_verified_with_the_device_ca_and_refused_without_it(env, tmp_path, caplog):
    """``--http-tls-cert/--http-tls-key``: the same store over HTTPS (TLS 1.2+). A device
    with the CA fetches over HTTPS; one without it refuses the server (``server_untrusted``,
    MQTT blocks take over) and the server logs the failed handshake in one line; a plain HTTP
    request on the HTTPS port is one line too; an engine upload without the CA is not sent."""
    import logging
    import ssl
    import sys
    import urllib.error

    from agent.engines import share as engine_share
    from agent.fleet.transfer.http_bounds import server_tls_context
    from tests.integration.pki import Pki

    caplog.set_level(logging.INFO)
    pki = Pki(tmp_path / "pki")
    cert, key = pki.server("fleet-http")
    data = blob(6 * BS)
    sha, blocks = serve_with_hashes(env, tmp_path, data)
    http = HttpSource("127.0.0.1", 0, env.server.files, tls=server_tls_context(cert, key))
    http.start()
    try:
        assert http.scheme == "https"
        url = "https://127.0.0.1:{}/artifacts/{}".format(http.port, sha)
        ctx = ssl.create_default_context(cafile=pki.ca_file)
        req = urllib.request.Request(url, headers={"Range": "bytes=0-9"})
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            assert resp.status == 206 and resp.read() == data[:10]
        assert http.httpd.tls.minimum_version == ssl.TLSVersion.TLSv1_2
        before = http.httpd.handshake_failures
        try:  # plain HTTP on the HTTPS port
            urllib.request.urlopen(url.replace("https://", "http://"), timeout=10)
        except (urllib.error.URLError, OSError, ValueError):
            pass
        _until(lambda: http.httpd.handshake_failures > before, "no handshake failure counted")

        # A device without the CA: refused, MQTT blocks take over.
        before = http.httpd.handshake_failures
        env.fetcher.http_ca_file = None
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
        refused = [r.getMessage() for r in caplog.records if "server_untrusted" in
                   r.getMessage()]
        # one line each for the hash list and the artifact (both fetched over HTTP first)
        assert len(refused) == 2 and "CERTIFICATE_VERIFY_FAILED" in refused[0], refused
        assert "the system's CAs" in refused[0] and "transfer.http_ca_file" in refused[0]
        _until(lambda: http.httpd.handshake_failures > before, "no handshake failure counted")
        lines = [r.getMessage() for r in caplog.records if "TLS handshake failed" in
                 r.getMessage()]
        assert any("HTTP_REQUEST" in ln and "https:// URL" in ln for ln in lines), lines
        assert any("does not trust this certificate" in ln for ln in lines), lines
        assert all(r.exc_info is None for r in caplog.records)  # lines, not tracebacks

        # The engine upload: without the CA nothing is sent; with it the server answers
        # (404 here: no upload is expected at this URL).
        engine = tmp_path / "engine"
        engine.write_bytes(b"engine bytes " * 100)
        signer = [sys.executable, "-c", "print('c2lnbmF0dXJl')"]
        share_url = "https://127.0.0.1:{}/shares/{}".format(http.port, "0" * 32)
        work = tmp_path / "work"
        work.mkdir()
        out = engine_share.offer(share_url, "k" * 64, str(engine), {}, "dev-1", str(work),
                                 signer=signer, job_id="j1")
        assert out["offered"] is False and out["code"] == "server_untrusted", out
        assert "[server_untrusted]" in out["reason"], out
        out = engine_share.offer(share_url, "k" * 64, str(engine), {}, "dev-1", str(work),
                                 signer=signer, job_id="j1", ca_file=pki.ca_file)
        assert out["offered"] is False and "code" not in out and "404" in out["reason"], out
    finally:
        http.stop()
