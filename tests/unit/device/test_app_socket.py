"""The app socket (SO_PEERCRED checks, one bounded JSON line, rate limit, connection cap) and the
client library (current, watch, report_health, commit) against a real AF_UNIX socket and a
temporary models_dir."""

import json
import os
import queue
import re
import shutil
import socket
import tempfile

import pytest

from agent import client
from agent.device.app.server import AppSocket, groups_of, nesting_depth
from agent.errors import CODES, AgentError
from agent.wire.device.limits import TokenBuckets

NOBODY = 65534


def echo(request, peer):
    if request.get("name") == "boom":
        raise AgentError("bad_argument", "expected another name, found boom")
    return {"ok": True, "op": request["op"], "uid": peer["uid"], "request": request}


@pytest.fixture
def sock_dir():
    # Traversable by another uid (pytest's tmp_path is 0700 under root's folder).
    path = tempfile.mkdtemp(prefix="appsock-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def ask(path, payload, shut=False):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        try:
            s.sendall(payload)
        except BrokenPipeError:
            pass  # refused before reading: the refusal is there to read
        if shut:
            s.shutdown(socket.SHUT_WR)
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


def test_allowed_request_reaches_the_handler_and_the_socket_file_is_0660(sock_dir):
    path = os.path.join(sock_dir, "app.sock")
    open(path, "w").close()
    os.unlink(path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a stale socket from a killed daemon: replaced at start
    stale.close()
    with AppSocket(path, [], [os.getgid()], echo):
        st = os.stat(path)
        assert oct(st.st_mode & 0o777) == "0o660" and st.st_gid == os.getgid()
        reply = ask(path, b'{"op": "list"}\n')
        assert reply["ok"] and reply["uid"] == os.getuid()
        reply = ask(path, b'{"op": "commit", "name": "boom"}\n')
        assert reply == {"ok": False, "error": {"code": "bad_argument",
                                                "message": "expected another name, found boom"}}
    assert not os.path.exists(path)


def test_a_regular_file_in_the_way_is_not_removed(sock_dir):
    path = os.path.join(sock_dir, "app.sock")
    open(path, "w").close()
    with pytest.raises(AgentError) as info:
        AppSocket(path, [], [], echo).start()
    assert info.value.code == "bad_config" and os.path.isfile(path)


@pytest.mark.parametrize("payload, needle", [
    (b"x" * 5000, "at most 4096 bytes"),
    (b"[1, 2]\n", "expected a JSON object"),
    (b"{\"op\": \"reboot\"}\n", "expected op to be one of"),
    (b"{\"op\": \"health\", \"name\": \"det\", \"version\": \"v1\", \"ok\": \"yes\"}\n",
     "expected \"ok\": true or false"),
    (b"{\"op\": \"commit\"}\n", "expected a model name"),
    (b"{nope\n", "does not parse"),
    (b"\n", "empty"),
])
def test_bad_lines_are_refused(sock_dir, payload, needle):
    path = os.path.join(sock_dir, "app.sock")
    with AppSocket(path, [], [], echo):
        reply = ask(path, payload)
    assert reply["ok"] is False and reply["error"]["code"] == "bad_message"
    assert needle in reply["error"]["message"]


def test_half_sent_line_hits_the_read_deadline(sock_dir):
    path = os.path.join(sock_dir, "app.sock")
    with AppSocket(path, [], [], echo, read_timeout_s=0.3):
        reply = ask(path, b'{"op": "li')
    assert reply["error"]["code"] == "bad_message"
    assert "within 0.3 s, found 10 bytes" in reply["error"]["message"]


def test_rate_limit_per_uid_and_connection_cap(sock_dir):
    path = os.path.join(sock_dir, "app.sock")
    with AppSocket(path, [], [], echo, rate_per_s=0.001, burst=3):
        codes = [ask(path, b'{"op": "list"}\n').get("error", {}).get("code") for _ in range(5)]
    assert codes == [None, None, None, "rate_limited", "rate_limited"]
    with AppSocket(path, [], [], echo, max_concurrent=1, max_per_uid=2,
                   read_timeout_s=5) as app:
        holders = []
        for _ in range(3):  # three slow clients of one uid, each still sending its line
            holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            holder.connect(path)
            holder.sendall(b'{"op": ')
            holders.append(holder)
        # A sender holds no worker: the complete request is served at once.
        assert ask(path, b'{"op": "list"}\n')["ok"] is True
        # The uid's third and fourth connections pushed out its oldest ones (per-uid cap).
        for pushed in holders[:2]:
            reply = json.loads(pushed.makefile("rb").readline())
            assert reply["error"]["code"] == "rate_limited" and "at once" in \
                reply["error"]["message"]
        assert app.counts["served"] == 1 and app.counts["refused"] >= 2
        holders[2].close()


@pytest.mark.parametrize("payload", [
    b"[" * 100000,  # over the line limit: refused unread
    b'{"op": "list", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}\n",
    b'{"op": "list", "x": ' + b'{"a": ' * 600 + b"1" + b"}" * 600 + b"}\n",
])
def test_nested_or_oversized_json_gets_a_reply_and_the_socket_lives_on(sock_dir, payload,
                                                                        caplog):
    path = os.path.join(sock_dir, "app.sock")
    with AppSocket(path, [], [], echo):
        reply = ask(path, payload[:4096] + b"\n" if len(payload) < 100000 else payload)
        assert reply["ok"] is False and reply["error"]["code"] == "bad_message", reply
        assert ask(path, b'{"op": "list"}\n')["ok"] is True  # the socket serves on
    assert "Traceback" not in caplog.text and not [r for r in caplog.records
                                                   if r.levelname == "ERROR"]


def test_nesting_depth_ignores_brackets_in_strings():
    assert nesting_depth(b'{"a": "[[[{{{", "b": [1, {"c": "\\"]]"}]}') == 3
    assert nesting_depth(b"[" * 9 + b"]" * 9) == 9


@pytest.mark.skipif(os.getuid() != 0, reason="running a client as another uid needs root "
                    "(setuid); root and the service user may act on every name")
def test_names_restrict_what_an_app_may_act_on(sock_dir):
    path = os.path.join(sock_dir, "app.sock")
    with AppSocket(path, [NOBODY], [], echo, names_of=lambda peer: {"cls"}):
        os.chmod(path, 0o666)
        for op in ("commit", "rollback"):
            reply = as_other_user(path, NOBODY, NOBODY, {"op": op, "name": "det"})
            assert reply["error"]["code"] == "model_not_owned", reply
            assert "found 'det'" in reply["error"]["message"]
        assert as_other_user(path, NOBODY, NOBODY, {"op": "commit", "name": "cls"})["ok"]
        assert as_other_user(path, NOBODY, NOBODY, {"op": "list"})["ok"]
        assert ask(path, b'{"op": "commit", "name": "det"}\n')["ok"]  # root: every name


def test_token_buckets_refill_per_uid():
    now = [0.0]
    bucket = TokenBuckets(rate=2, burst=2, clock=lambda: now[0])
    assert [bucket.take(7) for _ in range(3)] == [True, True, False]
    now[0] = 0.5
    assert bucket.take(7) is True and bucket.take(7) is False
    assert bucket.take(8) is True  # per uid


def test_token_buckets_stay_bounded():
    bucket = TokenBuckets(rate=1, burst=1, max_keys=8)
    for uid in range(100):
        assert bucket.take(uid)
    assert len(bucket.buckets) <= 8


def as_other_user(path, uid, gid, request=None):
    """A forked child drops to uid/gid (no supplementary groups), asks, and pipes back the
    reply (only raw socket and os calls in the child: safe after fork)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        status = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(path)
            s.sendall(json.dumps(request or {"op": "list"}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            os.write(write_end, data)
            status = 0
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _pid, status = os.waitpid(pid, 0)
    assert status == 0, "the child failed"
    return json.loads(data)


@pytest.mark.skipif(os.getuid() != 0, reason="running a client as another uid needs root "
                    "(setuid); the same-uid path is covered above")
def test_peers_are_checked_by_uid_and_group(sock_dir):
    path = os.path.join(sock_dir, "app.sock")
    other_gid = 54321
    with AppSocket(path, [], [other_gid], echo, socket_gid=other_gid):
        os.chmod(path, 0o666)  # let the stranger reach the check itself
        refused = as_other_user(path, NOBODY, NOBODY)
        assert refused["error"]["code"] == "app_not_allowed"
        assert "found uid {} (gid {})".format(NOBODY, NOBODY) in refused["error"]["message"]
        allowed = as_other_user(path, NOBODY, other_gid)  # the app's group as primary gid
        assert allowed["ok"] is True and allowed["uid"] == NOBODY
    with AppSocket(path, [NOBODY], [], echo):
        os.chmod(path, 0o666)
        assert as_other_user(path, NOBODY, NOBODY)["ok"] is True


def test_groups_of_includes_the_primary_group():
    assert os.getgid() in groups_of(os.getuid(), os.getgid())
    assert groups_of(2 ** 31 - 7, 4242) == [4242]  # no passwd entry: the primary group only


# --- the client library -----------------------------------------------------------------

def deploy(models, name, version, k):
    folder = models / name / version
    folder.mkdir(parents=True)
    (folder / "model.engine").write_bytes(b"engine-" + version.encode())
    (folder / "meta.json").write_text(json.dumps({"name": name, "version": version, "k": k}))
    link = models / name / "current"
    tmp = models / name / ".current.tmp"
    os.symlink(version, str(tmp))
    os.replace(str(tmp), str(link))  # new link + rename, as the daemon switches


def test_current_resolves_link_engine_and_meta_together(tmp_path, monkeypatch):
    models = tmp_path / "models"
    deploy(models, "det", "v1", 1)
    found = client.current("det", str(models))
    assert found == client.Current("det", "v1", str(models / "det" / "v1" / "model.engine"),
                                   {"name": "det", "version": "v1", "k": 1})
    monkeypatch.setenv("JETSON_AGENT_MODELS_DIR", str(models))
    assert client.current("det").version == "v1"
    with pytest.raises(client.ClientError) as info:
        client.current("other")
    assert info.value.code == "file_not_found"
    with pytest.raises(client.ClientError) as info:
        client.current("../etc")
    assert info.value.code == "bad_model_name"


def test_watch_calls_back_on_each_switch(tmp_path):
    models = tmp_path / "models"
    deploy(models, "det", "v1", 1)
    seen = queue.Queue()
    with client.watch("det", seen.put, str(models), interval_s=0.02):
        deploy(models, "det", "v2", 2)
        switched = seen.get(timeout=10)
        assert (switched.version, switched.meta["k"]) == ("v2", 2)
        deploy(models, "det", "v3", 3)
        assert seen.get(timeout=10).version == "v3"
    assert seen.empty()


def test_health_and_commit_go_through_the_socket(sock_dir):
    path = os.path.join(sock_dir, "app.sock")
    with AppSocket(path, [], [], echo):
        reply = client.report_health("det", "v2", False, "outputs off", socket_path=path)
        assert reply["request"] == {"op": "health", "name": "det", "version": "v2", "ok": False,
                                    "detail": "outputs off"}
        assert client.commit("det", socket_path=path)["request"] == {"op": "commit",
                                                                     "name": "det"}
        with pytest.raises(client.ClientError) as info:
            client.commit("boom", socket_path=path)
        assert (info.value.code, info.value.message) == (
            "bad_argument", "expected another name, found boom")
        with pytest.raises(client.ClientError) as info:
            client.report_health("det", "..", True, socket_path=path)
        assert info.value.code == "bad_model_version"
    with pytest.raises(client.ClientError) as info:
        client.commit("det", socket_path=path)
    assert info.value.code == "agent_unreachable"


def test_every_code_the_client_raises_is_documented():
    with open(client.__file__) as f:
        used = set(re.findall(r'ClientError\("([a-z_]+)"', f.read()))
    assert used and used <= set(CODES), used - set(CODES)


def test_app_names_resolve_users_and_groups():
    from agent.device.app.requests import names_of

    assert names_of({}) is None  # not configured: every name
    lookup = names_of({"root": ["det"], "@0": ["cls"], "4242": ["seg"]})
    assert lookup({"uid": 0, "groups": [0]}) == {"det", "cls"}
    assert lookup({"uid": 4242, "groups": [7]}) == {"seg"}
    assert lookup({"uid": 77, "groups": [0, 7]}) == {"cls"}  # a member of group 0
    assert lookup({"uid": 77, "groups": [7]}) == set()  # given nothing: acts on nothing
