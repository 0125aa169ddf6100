"""Engine uploads to the fleet service (agent.fleet.sharing.ShareBoard behind a real loopback
``HttpSource``, a real SQLite store): only a one-time token the service issued is taken, once;
sizes are bounded; a body that ends early is dropped; a stored engine is hashed, lands in the
content-addressed store with its per-block hash list and is served like any artifact."""

import hashlib
import os
import urllib.error
import urllib.request

import pytest

from agent.fleet.http_source import HttpSource
from agent.fleet.sharing import ShareBoard
from agent.fleet.store import Store
from agent.wire.block_server import BlockServer, sha256_file
from agent.wire.topics import Topics


@pytest.fixture
def board(tmp_path):
    store = Store("sqlite:///" + str(tmp_path / "fleet.db"))
    server = BlockServer(lambda *a, **k: None, Topics())
    shares = ShareBoard(store, str(tmp_path / "store"), server.add_file, max_bytes=1 << 20)
    http = HttpSource("127.0.0.1", 0, server.files, shares=shares).start()
    yield shares, store, server, "http://127.0.0.1:{}".format(http.port)
    http.stop()
    store.close()


def put(url, data):
    req = urllib.request.Request(url, data=data, method="PUT")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except urllib.error.URLError:  # refused before the body was sent: the server closed
        return None, ""


def test_an_upload_is_stored_served_and_reported_once(board):
    shares, store, server, base = board
    token = shares.token("ro", "dev-a")
    data = os.urandom(300000)
    sha = hashlib.sha256(data).hexdigest()
    assert put("{}/shares/{}".format(base, token), data) == (201, sha)
    assert put("{}/shares/{}".format(base, token), data)[0] == 404  # used
    [(rid, device, ref)] = shares.arrived()
    assert (rid, device, ref["sha256"], ref["size"]) == ("ro", "dev-a", sha, len(data))
    stored = store.artifacts()
    assert sha in stored and ref["blocks"]["sha256"] in stored
    assert sha256_file(stored[sha]["path"]) == sha and sha in server.files()
    with urllib.request.urlopen("{}/artifacts/{}".format(base, sha), timeout=10) as resp:
        assert resp.read() == data
    assert shares.arrived() == []


def test_unknown_tokens_and_oversized_bodies_are_refused(board):
    shares, store, _server, base = board
    assert put("{}/shares/{}".format(base, "0" * 32), b"x")[0] == 404
    assert put("{}/shares/../../etc".format(base), b"x")[0] == 404
    token = shares.token("ro", "dev-a")
    # Refused from its Content-Length, unread (the client may see the connection close).
    assert put("{}/shares/{}".format(base, token), b"x" * ((1 << 20) + 1))[0] in (413, None)
    assert shares.arrived() == [] and store.artifacts() == {}


def test_a_body_that_ends_early_is_dropped(board):
    import socket

    shares, store, _server, base = board
    token = shares.token("ro", "dev-a")
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall("PUT /shares/{} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
                     .format(token).encode() + b"y" * 10)
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(64).startswith(b"HTTP/1.0 400")
    assert shares.arrived() == [] and store.artifacts() == {}
    assert not os.listdir(os.path.join(shares.directory, "tmp"))
