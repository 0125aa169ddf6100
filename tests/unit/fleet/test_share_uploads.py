"""Engine uploads to the fleet service (agent.fleet.transfer.sharing.ShareBoard behind a real
loopback ``HttpSource``, a real SQLite store): only the engine its builder signed with its pinned
device key is taken (issue 23: anyone who reads the upload URL from the retained job document
could upload first); a token is bound to the builder and the rollout, dies with the rollout,
and is never used up by a refused request; sizes are bounded; the container's format is
checked before anything is stored; a stored engine is hashed, lands in the content-addressed
store with its per-block hash list and its builder's proof, and is served like any
artifact."""

import hashlib
import os
import urllib.error
import urllib.request

import pytest

from agent.engines.share import MAGIC
from agent.fleet.database.store import Store
from agent.fleet.transfer.http_source import HttpSource
from agent.fleet.transfer.sharing import ShareBoard
from agent.wire import device_identity
from agent.wire.block_server import BlockServer, sha256_file
from agent.wire.topics import Topics

CLASS = {"version": 2, "board": "orin", "gpu": "ga10b"}


@pytest.fixture
def key(tmp_path):
    return device_identity.create_device_key(str(tmp_path / "builder.key"))


@pytest.fixture
def board(tmp_path, key):
    store = Store("sqlite:///" + str(tmp_path / "fleet.db"))
    server = BlockServer(lambda *a, **k: None, Topics())
    pinned = {"dev-a": (key.raw_public, CLASS)}
    shares = ShareBoard(store, str(tmp_path / "store"), server.add_file, max_bytes=1 << 20,
                        builder_key=pinned.get)
    http = HttpSource("127.0.0.1", 0, server.files, shares=shares).start()
    yield shares, store, server, "http://127.0.0.1:{}".format(http.port)
    http.stop()
    store.close()


def container(n=300000):
    return MAGIC + b'{"engine_key": "k"}\n' + os.urandom(n)


def signed(key, data, job_id="ro", device="dev-a", engine_class=CLASS, size=None):
    sha = hashlib.sha256(data).hexdigest()
    sig = device_identity.sign_engine(key, device_identity.engine_statement(
        device, job_id, sha, len(data) if size is None else size, engine_class))
    return {"X-Content-Sha256": sha, "X-Engine-Signature": sig}


def put(url, data, headers=None, length=None):
    req = urllib.request.Request(url, data=data, method="PUT", headers=dict(headers or {}))
    if length is not None:
        req.add_header("Content-Length", str(length))
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (urllib.error.URLError, ConnectionError):  # refused before the body was sent
        return None, ""


def test_the_signed_engine_is_stored_served_and_reported_once(board, key):
    shares, store, server, base = board
    token = shares.token("ro", "dev-a")
    data = container()
    sha = hashlib.sha256(data).hexdigest()
    assert put("{}/shares/{}".format(base, token), data, signed(key, data)) == (201, sha)
    [(rid, device, ref)] = shares.arrived()
    assert (rid, device, ref["sha256"], ref["size"]) == ("ro", "dev-a", sha, len(data))
    builder = ref["builder"]
    assert device_identity.verify_engine(
        device_identity.public_key_of({"alg": "ed25519", "public_key": builder["public_key"]}),
        device_identity.engine_statement("dev-a", "ro", sha, len(data), CLASS), builder["sig"])
    stored = store.artifacts()
    assert sha in stored and ref["blocks"]["sha256"] in stored
    assert sha256_file(stored[sha]["path"]) == sha and sha in server.files()
    with urllib.request.urlopen("{}/artifacts/{}".format(base, sha), timeout=10) as resp:
        assert resp.read() == data
    assert shares.arrived() == []


def test_a_trojan_uploaded_first_is_refused_and_the_builder_still_uploads(board, key,
                                                                         tmp_path):
    """The attack of issue 23: the URL read from the retained job document, an engine
    uploaded before the builder's. Unsigned, signed by another key, or the builder's
    signature of another engine: refused, nothing stored, the token kept for the builder."""
    shares, store, _server, base = board
    token = shares.token("ro", "dev-a")
    url = "{}/shares/{}".format(base, token)
    genuine, trojan = container(), container()
    other = device_identity.create_device_key(str(tmp_path / "attacker.key"))
    assert put(url, trojan)[0] == 403
    assert put(url, trojan, signed(other, trojan))[0] == 403
    lying = dict(signed(key, genuine), **{"X-Content-Sha256": hashlib.sha256(
        trojan).hexdigest()})
    assert put(url, trojan, lying)[0] == 403
    # the builder's signature and sha256 of the genuine engine, with the trojan's bytes
    assert put(url, trojan, signed(key, genuine))[0] == 400
    assert shares.arrived() == [] and store.artifacts() == {}
    assert shares.refused == 4
    assert put(url, genuine, signed(key, genuine))[0] == 201


def test_random_bytes_oversized_bodies_and_other_rollouts_never_use_the_token(board, key):
    shares, store, _server, base = board
    assert put("{}/shares/{}".format(base, "0" * 32), b"x")[0] == 404
    assert put("{}/shares/../../etc".format(base), b"x")[0] == 404
    token = shares.token("ro", "dev-a")
    url = "{}/shares/{}".format(base, token)
    # Refused from its Content-Length, unread (the client may see the connection close).
    big = b"x" * ((1 << 20) + 1)
    assert put(url, big, signed(key, big))[0] in (413, None)
    noise = os.urandom(200000)  # signed by the builder, but not a container
    assert put(url, noise, signed(key, noise))[0] == 400
    assert shares.arrived() == [] and store.artifacts() == {}
    assert not os.path.exists(shares.directory)  # refused before anything was written
    data = container()
    wrong_job = signed(key, data, job_id="another-rollout")
    assert put(url, data, wrong_job)[0] == 403
    assert shares.expects(token)
    assert put(url, data, signed(key, data))[0] == 201


def test_tokens_die_with_their_rollout(board, key):
    shares, store, _server, base = board
    token = shares.token("ro", "dev-a")
    assert shares.token("ro", "dev-a") == token  # a document sent again: the same URL
    shares.revoke("ro")  # fleet rollouts cancel, or the rollout finished
    data = container()
    assert put("{}/shares/{}".format(base, token), data, signed(key, data))[0] == 404
    assert shares.arrived() == [] and store.artifacts() == {}


def test_a_body_that_ends_early_is_dropped(board, key):
    import socket

    shares, store, _server, base = board
    token = shares.token("ro", "dev-a")
    port = int(base.rsplit(":", 1)[1])
    data = container(2000)
    headers = "".join("{}: {}\r\n".format(k, v) for k, v in signed(key, data).items())
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall("PUT /shares/{} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n{}\r\n"
                     .format(token, len(data), headers).encode() + data[:100])
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(64).startswith(b"HTTP/1.0 400")
    assert shares.arrived() == [] and store.artifacts() == {}
    assert not os.listdir(os.path.join(shares.directory, "tmp"))
    assert shares.expects(token)


def test_two_uploads_at_most_and_none_from_a_builder_no_longer_designated(board, key):
    """A stolen key racing the builder does not use its URL up (the builder's signed report
    picks its own upload, tests/unit/fleet/test_fleet_sharing.py); a third upload is refused, and so
    is any from a device that is not a designated builder."""
    shares, _store, _server, base = board
    url = "{}/shares/{}".format(base, shares.token("ro", "dev-a"))
    first, second = container(), container()
    assert put(url, first, signed(key, first))[0] == 201
    assert put(url, second, signed(key, second))[0] == 201
    third = container()
    assert put(url, third, signed(key, third))[0] == 404
    assert [r["sha256"] for _, _, r in shares.arrived()] == [
        hashlib.sha256(first).hexdigest(), hashlib.sha256(second).hexdigest()]
    shares.designated = lambda device: False
    url = "{}/shares/{}".format(base, shares.token("ro2", "dev-a"))
    assert put(url, first, signed(key, first, job_id="ro2"))[0] == 403
    assert shares.arrived() == []
