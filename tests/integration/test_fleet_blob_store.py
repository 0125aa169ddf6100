"""The registry owns its bytes (agent.fleet.database.blobs), with a real Mosquitto, real agents
(onnxruntime), ``fleet serve`` and the operator's CLI:

- versions pushed from a folder under a home directory that is then deleted still deploy to a
  re-imaged device (fresh state directory, same device key) after a service restart, on SQLite
  and on PostgreSQL; one pushed on the service's host (``--db``: into the store the database
  names), one through the service's HTTP endpoint with the operator's token (refused without
  it and with a wrong one); the two share their files, and the older version's blobs are not
  re-pointed;
- a corrupted blob is never served: the deployment's device shows ``artifact_unavailable``
  with the blob and the version, ``fleet models verify`` lists it (exit 1); pushing the
  version again restores the bytes and the device converges.
"""

import hashlib
import http.client
import json
import os
import re
import shutil
import time

import pytest

from agent.errors import AgentError
from agent.fleet.database import blobs, store_schema
from agent.fleet.database.store import Store
from agent.fleet.deployments import deployments
from tests.integration.postgres import postgres  # noqa: F401 - fixture
from tests.integration.test_fleet_deployments import jobs_of, wait_converged
from tests.integration.test_fleet_rollout import wait_status
from tests.integration.test_fleet_service import FP16, Service, fleet_cli, wait_registered

TOKEN = "operator-token-0123456789abcdef"


def cli(args, db, env=None, ok=True):
    out = fleet_cli(args + ["--db", db], timeout=180, env=env)
    if ok:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def copy_example(folder):
    os.makedirs(folder)
    for name in ("model.onnx", "inputs.json", "golden.json"):
        shutil.copy(os.path.join(FP16, name), os.path.join(folder, name))
    return ["--inputs", os.path.join(folder, "inputs.json"), "--golden",
            os.path.join(folder, "golden.json"), "--precision", "fp32"]


def http_url(service, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        found = re.findall(r"also at (http://127\.0\.0\.1:\d+)/artifacts", service.tail(200000))
        if found:
            return found[-1]
        assert time.monotonic() < deadline, service.tail()
        time.sleep(0.2)


def states(db, dep):
    store = Store(db)
    try:
        return {d["device"]: (d["state"], d["reason"]) for d in
                deployments.device_states(store, dep)}
    finally:
        store.close()


def raw_put(base, sha, body, auth=None):
    host, port = base.split("//", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        headers = {"Content-Length": str(len(body))}
        if auth:
            headers["Authorization"] = auth
        conn.request("PUT", "/registry/blobs/" + sha, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_pushed_versions_outlive_their_folder(kind, request, mosquitto, agent_factory,
                                              tmp_path):
    if kind == "sqlite":
        db, store_args = "sqlite:///" + str(tmp_path / "fleet.db"), []
        root = str(tmp_path / "fleet-artifacts")
    else:
        db = request.getfixturevalue("postgres").url
        root = str(tmp_path / "service-store")
        store_args = ["--store", root]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    wrong_file = tmp_path / "wrong"
    wrong_file.write_text("not-the-operator-token-at-all\n")
    agent = agent_factory("bs-a", extra_config="labels:\n  site: w3\n").start()
    wait_status(mosquitto, ["bs-a"], agents=[agent], timeout=120)
    service = Service(mosquitto, db, tmp_path)
    service.args += store_args + ["--http", "127.0.0.1:0", "--dashboard-token-file",
                                  str(token_file)]
    service.start()
    try:
        wait_registered(db, ["bs-a"], service, timeout=90)
        base = http_url(service)
        # A pusher's home and folder, deleted afterwards.
        home = tmp_path / "home"
        folder = str(home / "models" / "det")
        common = copy_example(folder)
        env = dict(os.environ, HOME=str(home))
        env.pop("XDG_STATE_HOME", None)  # the pusher's state directory: under that home
        model = os.path.join(folder, "model.onnx")
        # @1 on the service's host: into the store the database names (no --store here).
        cli(["models", "push", model, "--name", "det", "--version", "1"] + common, db, env)
        # @2 through the service, with the operator's token; refused without and with another.
        push2 = ["models", "push", model, "--name", "det", "--version", "2", "--server", base]
        wrong = fleet_cli(push2 + common + ["--token-file", str(wrong_file)], env=env,
                          timeout=120)
        assert wrong.returncode != 0 and "unauthorized" in wrong.stderr, wrong.stderr
        sha = _sha(model)
        status, doc = raw_put(base, sha, b"x")
        assert status == 401 and doc["error"]["code"] == "unauthorized", doc
        status, doc = raw_put(base, sha, b"x", "Bearer " + TOKEN)  # the right token, bad bytes
        assert status == 400 and doc["error"]["code"] == "hash_mismatch", doc
        out = fleet_cli(push2 + common + ["--token-file", str(token_file), "--json"], env=env,
                        timeout=120)
        assert out.returncode == 0, out.stderr + service.tail()
        assert json.loads(out.stdout)["added"] is True
        # Both versions' blobs are in the service's store, counted once per reference, and
        # nothing names the pusher's folder.
        store = Store(db)
        try:
            assert blobs.recorded(store) == root
            assert os.path.isfile(blobs.path_of(root, sha))
            assert {u["version"] for u in blobs.users(store, sha)} == {"1", "2"}
            assert not store.db.query("SELECT 1 FROM artifacts WHERE path LIKE ?",
                                      ("%" + str(home) + "%",))
        finally:
            store.close()
        # Nothing of the registry landed in the pusher's home (its state directory included).
        written = [os.path.join(d, f) for d, _s, fs in os.walk(str(home)) for f in fs]
        assert all(w.startswith(folder + os.sep) for w in written), written
        shutil.rmtree(str(home))
        verify = cli(["models", "verify"], db)
        assert "all sound" in verify.stdout, verify.stdout

        cli(["deploy", "det@1", "--to", "site=w3", "--id", "d1", "--timeout", "300"], db)
        wait_converged(db, "d1", ["bs-a"], service)
        # The service restarts; the device is re-imaged (its state directory wiped, same key).
        assert service.stop() == 0
        assert agent.stop() == 0
        shutil.rmtree(agent.state_dir)
        service.start()
        agent.start()
        deadline = time.monotonic() + 180
        while not jobs_of(agent):
            assert time.monotonic() < deadline, service.tail() + agent.log_tail()
            time.sleep(0.5)
        wait_converged(db, "d1", ["bs-a"], service)
        assert agent.alive(), agent.log_tail()
    finally:
        service.stop()


def _sha(path):
    from agent.fsio import sha256_file

    return sha256_file(path)


def test_a_corrupted_blob_is_a_reason_not_a_silence(mosquitto, agent_factory, tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    folder = str(tmp_path / "push")
    common = copy_example(folder)
    model = os.path.join(folder, "model.onnx")
    cli(["models", "push", model, "--name", "det", "--version", "1"] + common, db)
    sha = _sha(model)
    path = blobs.path_of(str(tmp_path / "fleet-artifacts"), sha)
    with open(path, "r+b") as f:  # one byte changed in place: same size
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 0xFF]))
    verify = cli(["models", "verify", "--json"], db, ok=False)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    problems = json.loads(verify.stdout)["problems"]
    assert [(p["sha256"], p["versions"]) for p in problems] == [(sha, ["det@1"])], problems
    assert "hash mismatch" in problems[0]["message"]

    agent = agent_factory("bs-c", extra_config="labels:\n  site: w3\n").start()
    wait_status(mosquitto, ["bs-c"], agents=[agent], timeout=120)
    service = Service(mosquitto, db, tmp_path).start()
    try:
        wait_registered(db, ["bs-c"], service, timeout=90)
        cli(["deploy", "det@1", "--to", "site=w3", "--id", "dc", "--timeout", "300"], db)
        deadline = time.monotonic() + 60
        while states(db, "dc").get("bs-c", (None, None))[0] != "failed":
            assert time.monotonic() < deadline, service.tail()
            time.sleep(0.3)
        state, reason = states(db, "dc")["bs-c"]
        assert reason.startswith("artifact_unavailable: blob {}".format(sha[:16])), reason
        assert "model of det@1" in reason and "hash mismatch" in reason, reason
        shown = cli(["deployments", "show", "dc"], db).stdout
        assert "artifact_unavailable: blob {}".format(sha[:16]) in shown, shown
        assert "hash mismatch: its bytes hash to" in shown, shown  # the deployment's reason
        store = Store(db)
        try:
            from agent.fleet.web import metrics

            exposed = metrics.exposition(store)[0].decode()
        finally:
            store.close()
        assert 'deployment="dc",reason="artifact_unavailable"} 1.0' in exposed, exposed
        assert not jobs_of(agent)  # nothing was sent: the bytes were never served
        # Pushed again from the files: the bytes are restored, the device converges.
        cli(["models", "push", model, "--name", "det", "--version", "1"] + common, db)
        assert "all sound" in cli(["models", "verify"], db).stdout
        wait_converged(db, "dc", ["bs-c"], service)
        store = Store(db)
        try:
            assert deployments.get(store, "dc")["reason"] is None  # cleared with the bytes back
        finally:
            store.close()
    finally:
        service.stop()


def _db_url(kind, request, tmp_path):
    if kind == "sqlite":
        return "sqlite:///" + str(tmp_path / "fleet.db")
    return request.getfixturevalue("postgres").url


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_upgrade_imports_path_recorded_versions(kind, request, tmp_path):
    """A database of the release before (revision 0004) whose versions name files on the
    pusher's machine: those still there are copied into the store, the one gone is reported;
    the upgraded schema is the declared one (tests/integration/test_fleet_migrations.py)."""
    from agent.fleet.database import migrate
    from agent.fleet.deployments import registry

    url = _db_url(kind, request, tmp_path)
    migrate.upgrade(url, target="0004")
    pushed = tmp_path / "pusher"
    pushed.mkdir()
    (pushed / "a.onnx").write_bytes(b"model a")
    (pushed / "b.onnx").write_bytes(b"model b")
    sha_a, sha_b = _sha(str(pushed / "a.onnx")), _sha(str(pushed / "b.onnx"))
    from agent.fleet.database.db import Db

    db = Db(url)  # at revision 0004: below what a Store opens
    try:
        for version, sha in (("1", sha_a), ("2", sha_b), ("3", sha_a)):
            rec = {"artifacts": {"model": {"sha256": sha, "size": 7, "name": "m.onnx"}},
                   "defaults": {}, "notes": ""}
            db.execute("INSERT INTO model_versions (name, version, digest, record, "
                             "created) VALUES (?, ?, ?, ?, 1.0)",
                             ("det", version, registry.digest(rec), json.dumps(rec)))
        for sha, name in ((sha_a, "a.onnx"), (sha_b, "b.onnx")):
            db.execute("INSERT INTO artifacts (sha256, size, name, path, added) VALUES "
                       "(?, 7, 'model', ?, 1.0)", (sha, str(pushed / name)))
    finally:
        db.close()
    (pushed / "b.onnx").unlink()  # gone from the pusher's machine before the upgrade
    root = str(tmp_path / "store")
    before, after = migrate.upgrade(url, blob_store=root)
    assert (before, after) == ("0004", store_schema.HEAD)
    shutil.rmtree(str(pushed))
    store = Store(url)
    try:
        assert blobs.recorded(store) == root
        rows = blobs.rows(store)
        assert rows[sha_a]["problem"] is None and os.path.isfile(blobs.path_of(root, sha_a))
        assert rows[sha_b]["problem"].startswith("missing"), rows[sha_b]
        assert blobs.refcounts(store) == {sha_a: 2, sha_b: 1}
        assert [u["version"] for u in blobs.users(store, sha_a)] == ["1", "3"]
        problems = blobs.verify(store, root)
        assert [(p["sha256"], p["versions"]) for p in problems] == [(sha_b, ["det@2"])]
        assert blobs.servable(store, root, sha_a, full=True) == blobs.path_of(root, sha_a)
        with pytest.raises(AgentError) as exc:
            blobs.servable(store, root, sha_b)
        assert exc.value.code == "artifact_unavailable" and "model of det@2" in \
            exc.value.message
        # rm of @1 keeps the blob @3 still uses; rm of @3 collects it.
        registry.remove(store, "det", "1")
        assert os.path.isfile(blobs.path_of(root, sha_a))
        registry.remove(store, "det", "3")
        assert not os.path.exists(blobs.path_of(root, sha_a)) and sha_a not in blobs.rows(store)
    finally:
        store.close()


def test_blob_writes_are_checked_atomic_and_immutable(tmp_path):
    import io

    from agent.fleet.deployments import registry

    url = "sqlite:///" + str(tmp_path / "fleet.db")
    store = Store(url)
    try:
        root = blobs.directory(store, None, record=True)
        assert root == str(tmp_path / "fleet-artifacts") and blobs.recorded(store) == root
        with pytest.raises(AgentError) as exc:  # the database decides, not a later --store
            blobs.directory(store, str(tmp_path / "elsewhere"))
        assert exc.value.code == "bad_argument"
        data = b"0123456789" * 1000
        sha = hashlib.sha256(data).hexdigest()
        with pytest.raises(AgentError) as exc:
            blobs.receive(root, io.BytesIO(data[:-1] + b"x"), len(data), sha)
        assert exc.value.code == "hash_mismatch"
        with pytest.raises(AgentError) as exc:
            blobs.receive(root, io.BytesIO(data[:5]), len(data), sha)
        assert exc.value.code == "hash_mismatch"  # the body ended early
        with pytest.raises(AgentError) as exc:
            blobs.receive(root, io.BytesIO(data), len(data), sha, limit=100)
        assert exc.value.code == "blob_too_large"
        assert not os.path.exists(blobs.path_of(root, sha))
        assert os.listdir(os.path.join(root, sha[:2])) == []  # no temporary file left
        path = blobs.receive(root, io.BytesIO(data), len(data), sha)
        inode = os.stat(path).st_ino
        blobs.receive(root, io.BytesIO(data), len(data), sha)  # the same bytes again: kept
        assert os.stat(path).st_ino == inode
        # A version without its blobs in the store is refused; with them, counted.
        rec = {"artifacts": {"model": {"sha256": "e" * 64, "size": 3}}, "defaults": {},
               "notes": ""}
        with pytest.raises(AgentError) as exc:
            registry.push(store, root, "det", "1", rec)
        assert exc.value.code == "bad_argument" and "expected blob eeee" in exc.value.message
        rec["artifacts"]["model"] = {"sha256": sha, "size": len(data)}
        assert registry.push(store, root, "det", "1", rec)
        assert not registry.push(store, root, "det", "1", rec)
        assert blobs.refcounts(store) == {sha: 1} and blobs.verify(store, root) == []
    finally:
        store.close()


def test_the_upload_endpoint_is_bounded_and_authenticated(tmp_path):
    """The registry's endpoint on a real HttpSource (the service's --http server): no token
    configured, a wrong one, a body over the bound, a bad record, a version before its blobs,
    then a push that works and a HEAD that finds the blob."""
    from agent.fleet.deployments.uploads import MAX_BLOB_BYTES, MAX_RECORD_BYTES, Uploads
    from agent.fleet.transfer.http_source import HttpSource

    url = "sqlite:///" + str(tmp_path / "fleet.db")
    Store(url).close()
    root = str(tmp_path / "store")

    def request(base, method, path, body=b"", auth="Bearer " + TOKEN, length=None):
        host, port = base.split("//", 1)[1].split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=30)
        try:
            headers = {"Content-Length": str(len(body) if length is None else length)}
            if auth:
                headers["Authorization"] = auth
            conn.putrequest(method, path)
            for k, v in headers.items():
                conn.putheader(k, v)
            conn.endheaders(body if method != "HEAD" else None)
            resp = conn.getresponse()
            data = resp.read()
            json_body = resp.getheader("Content-Type") == "application/json"
            return resp.status, (json.loads(data) if json_body else {})
        finally:
            conn.close()

    data = b"weights" * 100
    sha = hashlib.sha256(data).hexdigest()
    record = {"name": "det", "version": "7", "record": {
        "artifacts": {"model": {"sha256": sha, "size": len(data), "name": "m.onnx"}},
        "defaults": {"precision": "fp16"}, "notes": "x"}}
    closed = HttpSource("127.0.0.1", 0, lambda: {}, uploads=Uploads(url, root, None)).start()
    src = HttpSource("127.0.0.1", 0, lambda: {}, uploads=Uploads(url, root, TOKEN)).start()
    try:
        base = "http://127.0.0.1:{}".format(closed.port)
        status, doc = request(base, "PUT", "/registry/blobs/" + sha, data)
        assert status == 403 and doc["error"]["code"] == "unauthorized"
        base = "http://127.0.0.1:{}".format(src.port)
        for auth in (None, "Bearer wrong-token", "Basic " + TOKEN):
            status, doc = request(base, "PUT", "/registry/blobs/" + sha, data, auth=auth)
            assert status == 401 and doc["error"]["code"] == "unauthorized", auth
        assert request(base, "HEAD", "/registry/blobs/" + sha)[0] == 404
        status, doc = request(base, "PUT", "/registry/blobs/" + sha, b"",
                              length=MAX_BLOB_BYTES + 1)
        assert status == 413 and doc["error"]["code"] == "blob_too_large"
        status, doc = request(base, "POST", "/registry/models", b"", length=MAX_RECORD_BYTES + 1)
        assert status == 413
        bad = json.dumps(dict(record, record={"artifacts": {"../x": {"sha256": sha,
                                                                    "size": 1}}})).encode()
        status, doc = request(base, "POST", "/registry/models", bad)
        assert status == 400 and "role" in doc["error"]["message"], doc
        body = json.dumps(record).encode()
        status, doc = request(base, "POST", "/registry/models", body)  # its blob not yet there
        assert status == 400 and "expected blob" in doc["error"]["message"], doc
        assert request(base, "PUT", "/registry/blobs/" + sha, data)[0] == 201
        assert request(base, "HEAD", "/registry/blobs/" + sha)[0] == 404  # not a blob yet
        status, doc = request(base, "POST", "/registry/models", body)
        assert status == 201 and doc["added"] is True, doc
        assert request(base, "HEAD", "/registry/blobs/" + sha)[0] == 200
        assert request(base, "POST", "/registry/models", body)[1]["added"] is False
        other = json.dumps(dict(record, record=dict(record["record"], notes="y"))).encode()
        status, doc = request(base, "POST", "/registry/models", other)
        assert status == 409 and doc["error"]["code"] == "model_version_exists"
        assert request(base, "GET", "/registry/models")[0] == 404  # only what is routed
    finally:
        src.stop()
        closed.stop()
    store = Store(url)
    try:
        assert blobs.users(store, sha) == [{"name": "det", "version": "7", "role": "model"}]
    finally:
        store.close()


def test_the_runner_sends_nothing_a_blob_cannot_back(store, tmp_path):
    """The deployment runner over SQLite and PostgreSQL: a version whose blob is gone sends no
    rollout; its devices are failed with ``artifact_unavailable`` naming the blob and the
    version, the deployment's reason has the whole message; the bytes pushed again, the next
    look sends the wave and clears the reason."""
    import io

    from agent.fleet.deployments import registry
    from agent.fleet.deployments.deployment_runner import BLOB_RECHECK_S, DeploymentRunner
    from tests.integration.test_fleet_deployments_store import Clock, status

    root = blobs.directory(store, str(tmp_path / "store"), record=True)
    data = b"a model" * 50
    sha = hashlib.sha256(data).hexdigest()
    blobs.receive(root, io.BytesIO(data), len(data), sha)
    rec = {"artifacts": {"model": {"sha256": sha, "size": len(data), "name": "m.onnx"}},
           "defaults": {"precision": "fp16"}, "notes": ""}
    assert registry.push(store, root, "det", "5", rec)
    os.unlink(blobs.path_of(root, sha))  # lost from the store's disk
    clock = Clock()
    runner = DeploymentRunner(store, "svc-1", clock=clock)
    runner.blob_root = root
    store.upsert_devices({d: status(d, site="w3") for d in "ab"})
    spec = {"precision": "fp16", "model_name": "det", "model_version": "5",
            "artifacts": rec["artifacts"], "timeout": 600.0,
            "policy": {"success_threshold": 1.0}}
    deployments.insert(store, "d5", "det", "5", "site=w3", spec)
    runner.tick()
    assert deployments.rollouts_of(store, "d5") == []
    reasons = {d["device"]: (d["state"], d["reason"]) for d in
               deployments.device_states(store, "d5")}
    want = "artifact_unavailable: blob {} (model of det@5) missing".format(sha[:16])
    assert reasons == {"a": ("failed", want), "b": ("failed", want)}, reasons
    dep = deployments.get(store, "d5")
    assert dep["state"] == "pending" and "no file" in dep["reason"], dep
    # counted by the reason's code (a bounded label set for /metrics); the rows keep it all
    assert deployments.summary(store, ["d5"])["d5"]["failed_by"] == {"artifact_unavailable": 2}
    blobs.receive(root, io.BytesIO(data), len(data), sha)  # pushed again: restored
    runner.tick()
    assert deployments.rollouts_of(store, "d5") == []  # looked at again after the recheck
    clock.t += BLOB_RECHECK_S
    runner.tick()
    assert deployments.rollouts_of(store, "d5") == ["d5-w"]
    dep = deployments.get(store, "d5")
    assert dep["state"] == "rolling" and dep["reason"] is None, dep
    assert {d["state"] for d in deployments.device_states(store, "d5")} == {"in_progress"}
