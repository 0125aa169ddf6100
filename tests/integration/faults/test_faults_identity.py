"""The fault suite (``suite.py``): issue 23's attacks on device identity and admission, each on
an OPEN broker (anyone may publish and read anything) and on the shipped TLS+ACL broker
(systemd/mosquitto/, password variant: the attacker is a broker account of the fleet that was
never admitted, ``intruder``), with real daemons (their own device keys, admitted by the
pre-provisioned keys list) and a real ``fleet serve``.

- Engine sharing: the builder's upload URL, read from its retained job document (on the ACL
  broker the intruder reads nothing there: the URL is given to it, as a leak would), is used
  first by the attacker with a trojan container, unsigned and signed by its own key, and with
  50 MB of random bytes: all refused before anything is stored; the genuine builder's engine
  is the one adopted. A forged SUCCEEDED (99,999 QPS) for the builder and an adopter, signed by
  the attacker's key and unsigned, changes nothing: the rollout goes on and ends with the
  devices' real results. After ``fleet rollouts cancel`` the leaked upload URL is refused even
  with the builder's genuine signature.
- 20,000 bogus device ids (unsigned births and telemetry, signed births with random keys)
  leave 0 devices in the registry, the pending list within its bound, and ``/metrics`` within
  +10 % of its size, scraped in under 1 s.

- An unsigned rollout to a device that requires signed jobs fails at once with
  ``signing_required`` and the fix, on the shipped TLS+ACL broker (the open broker's case:
  test_faults_registry.py).

Elsewhere: 10,000 of 10,000 devices with the shipped broker's queue limits
(tests/integration/test_fleet_roll_call.py, simulated devices signing their births and
admitted by keys), the unsigned rollout failing fast with its reason on an open broker
(test_faults_registry.py), signed jobs forged, replayed or mis-targeted
(test_faults_forged.py).
"""

import hashlib
import http.client
import json
import os
import queue
import random
import re
import time
import uuid
from urllib.parse import urlsplit

import pytest

from agent.engines import share as engine_share
from agent.fleet.database.store import Store
from agent.wire import device_identity, protocol, status_messages
from agent.wire.mqtt import MESSAGE, MqttClient
from agent.wire.mqtt_types import TlsOptions
from agent.wire.topics import Topics
from tests.integration.conftest import MOSQUITTO, AgentProcess
from tests.integration.faults.suite import REPORT, fault, finish, read, started
from tests.integration.pki import FleetBroker, Pki, write_passwords
from tests.integration.test_fleet_service import (
    Service,
    fleet_cli,
    fp16_args,
    show,
    wait_registered,
    wait_rollout,
)

T = Topics()
SHARE_DEVICES = ["b-0", "b-1", "b-2"]  # b-0 sorts first: its class's builder
FLOOD_IDS = 20000
FLOOD_SIGNED = 2000  # of them, signed births with random keys (the pending list's bound: 200)
MAX_PENDING = 200


class Arena(object):
    """A broker (open, or the shipped TLS+ACL config), the arguments a fleet command needs to
    reach it, daemons on it, and the attacker's client."""

    def __init__(self, kind, tmp_path, open_broker=None):
        self.kind = kind
        self.dir = tmp_path
        if kind == "open":
            self.broker = open_broker
            self.cli = ["--broker", self.broker.url]
            self.users = {}
            return
        if not os.path.exists(MOSQUITTO):
            pytest.skip("mosquitto is not installed")
        self.users = {u: "pw-" + uuid.uuid4().hex[:8] for u in SHARE_DEVICES + [
            "f-0", "controller", "intruder"]}
        pki = Pki(tmp_path / "pki")
        passwords = write_passwords(tmp_path / "passwd", self.users)
        self.broker = FleetBroker(tmp_path / "broker", pki, passwords=passwords).start()
        self.cli = ["--broker", self.broker.url, "--ca-file", pki.ca_file, "--username",
                    "controller", "--password-file", self._secret("controller")]

    def _secret(self, user):
        path = self.dir / ("pw-" + user)
        path.write_text(self.users[user] + "\n")
        return str(path)

    def agent(self, device, security=None):
        extra = "" if self.kind == "open" else (
            "  username: {}\n  password_file: {}\n  tls:\n    ca_file: {}\n".format(
                device, self._secret(device), self.broker.pki.ca_file))
        workdir = self.dir / ("agent-" + device)
        workdir.mkdir(exist_ok=True)
        return AgentProcess(self.broker, workdir, device, broker_extra=extra, security=security)

    def client(self, user, subscribe=()):
        """An MQTT v5 client: anonymous on the open broker, ``user``'s account on the ACL one."""
        kw = {} if self.kind == "open" else {
            "username": user, "password": self.users[user],
            "tls": TlsOptions(ca_file=self.broker.pki.ca_file)}
        c = MqttClient("{}-{}".format(user, uuid.uuid4().hex[:6]), self.broker.host,
                       self.broker.port, clean_start=True, session_expiry=0,
                       events=queue.Queue(), **kw)
        for topic in subscribe:
            c.subscribe(topic, 1)
        c.start()
        c.wait_connected(10)
        return c

    def service(self, db, *extra):
        service = Service(self.broker, db, self.dir)
        service.args = service.args[:5] + self.cli + service.args[7:] + list(extra)
        return service.start()

    def close(self):
        if self.kind != "open":
            self.broker.stop(kill=False)


@pytest.fixture(params=["open", "acl"])
def arena(request, tmp_path):
    a = Arena(request.param, tmp_path, request.getfixturevalue("mosquitto")
              if request.param == "open" else None)
    yield a
    a.close()


def first_retained(arena, user, topic, timeout, wanted=lambda msg: True):
    """The first message on ``topic`` that ``user`` reads and ``wanted`` accepts, decoded
    (None: none within ``timeout``; the ACL may keep it from ``user``)."""
    c = arena.client(user, [topic])
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                ev = c.events.get(timeout=0.2)
            except queue.Empty:
                continue
            if ev.kind == MESSAGE and ev.payload:
                msg = json.loads(ev.payload)
                if wanted(msg):
                    return msg
        return None
    finally:
        c.stop()


def retained_doc(arena, user, device, job_id, timeout):
    """The job document retained for ``device`` as ``user`` reads it."""
    return first_retained(arena, user, T.job(device, job_id), timeout)


def put(url, headers, body=b"", length=None, chunk=1 << 20):
    """A PUT whose status is read as soon as the server answers: the body (``length`` bytes of
    ``body`` repeated) is sent only while the server reads it. -> (status, bytes sent)."""
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=15)
    length = len(body) if length is None else length
    conn.putrequest("PUT", u.path)
    for k, v in dict(headers, **{"Content-Length": str(length)}).items():
        conn.putheader(k, v)
    conn.endheaders()
    sent = 0
    conn.sock.settimeout(0.5)
    try:
        while sent < length:
            part = body[:min(chunk, length - sent)] if len(body) >= chunk or not sent else body
            conn.sock.sendall(part)
            sent += len(part)
    except (BrokenPipeError, ConnectionResetError, OSError):
        pass  # the server answered and closed: the rest is never read
    conn.sock.settimeout(15)
    try:
        resp = conn.getresponse()
        return resp.status, sent
    finally:
        conn.close()


def counters(db):
    store = Store(db)
    try:
        return store.admission_counters()
    finally:
        store.close()


def wait_counter(db, name, at_least, service, timeout=20):
    deadline = time.monotonic() + timeout
    while counters(db).get(name, 0) < at_least:
        assert time.monotonic() < deadline, (counters(db), service.tail())
        time.sleep(0.3)


def share_files(root):
    """Every file under the service's store directory (artifacts and share uploads)."""
    out = {}
    for dirpath, _, names in os.walk(str(root)):
        for n in names:
            p = os.path.join(dirpath, n)
            out[p] = os.path.getsize(p)
    return out


def forged_success(device, job_id, qps=99999.0):
    return protocol.encode({
        "protocol": 1, "job_id": job_id, "device": device, "kind": "deploy",
        "state": "SUCCEEDED", "version": 50, "ts": time.time(), "statusDetails": {},
        "result": {"throughput_qps": qps, "precision": "fp16", "emulated": True,
                   "share": {"mode": "built", "offered": True}}})


def test_a_trojan_upload_forged_results_and_a_leaked_token_change_nothing(arena, tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    agents = [started(arena.agent(d)) for d in SHARE_DEVICES]
    service = arena.service(db, "--http", "127.0.0.1:0", "--http-min-bytes", "1",
                            "--share-engines", "--share-wait", "120", "--builders", "b-0")
    attacker_key = device_identity.create_device_key(str(tmp_path / "attacker.key"))
    try:
        wait_registered(db, SHARE_DEVICES, service, timeout=60)
        builder = agents[0]
        assert builder.stop() == 0  # offline when the rollout starts: the attacker is first
        wait_offline(db, "b-0", service)
        out = fleet_cli(["rollout"] + fp16_args() + ["--devices"] + SHARE_DEVICES + [
            "--rollout-id", "ro-trojan", "--db", db, "--submit", "--detach"])
        assert out.returncode == 0, out.stderr
        doc = retained_doc(arena, "controller", "b-0", "ro-trojan", 30)
        assert doc and doc["share"]["offer"], service.tail()
        seen = retained_doc(arena, "intruder", "b-0", "ro-trojan", 1.0)
        assert (seen is not None) == (arena.kind == "open")  # the ACL keeps it from others
        offer = doc["share"]["offer"]
        stored_before = share_files(tmp_path / "store")

        # The trojan: a well-formed container, unsigned, then signed by the attacker's key.
        evil = tmp_path / "trojan.share"
        payload = tmp_path / "trojan-engine"
        payload.write_bytes(b"an engine that answers 1e6 when max(x) > 1000 " * 64)
        engine_share.write_container(str(evil), "0" * 64, str(payload), {}, "b-0")
        data = evil.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        statement = device_identity.engine_statement("b-0", "ro-trojan", sha, len(data), None)
        attempts = [
            {"X-Content-Sha256": sha},
            {"X-Content-Sha256": sha, "X-Engine-Signature": device_identity.sign_engine(
                attacker_key, statement)},
        ]
        for headers in attempts:
            assert put(offer, headers, data)[0] == 403
        noise = os.urandom(1 << 20)
        status, sent = put(offer, {"X-Content-Sha256": hashlib.sha256(noise).hexdigest(),
                                   "X-Engine-Signature": device_identity.sign_engine(
                                       attacker_key, statement)}, noise, length=50 << 20)
        assert status == 403, status
        fault("trojan_upload", len(attempts))
        fault("random_upload_50mb")
        assert share_files(tmp_path / "store") == stored_before  # nothing stored, not a byte

        # Forged results for the (offline) builder and a waiting adopter.
        attacker = arena.client("intruder")
        try:
            for dev in ("b-0", "b-1"):
                topic = T.job_status(dev, "ro-trojan")
                body = forged_success(dev, "ro-trojan")
                signer = device_identity.ReportSigner(attacker_key, dev, 999)
                attacker.publish(topic, body, retain=True,
                                 user_properties=signer.properties(topic, body)).wait(10)
                attacker.publish(topic, body, retain=True).wait(10)
        finally:
            attacker.stop()
        fault("forged_success", 4)
        if arena.kind == "open":  # they reach the service, which drops them
            # Two topics, two forgeries each: the newest on each is verified and dropped; the
            # older may be superseded while it waits in the event queue, dropped unread
            # (agent.fleet.transfer.bytequeue), so at least two are counted.
            wait_counter(db, "bad_signature", 2, service)
        report = show(db, "ro-trojan")
        rows = {r["device"]: r for r in report["devices"]}
        assert report["state"] not in ("succeeded", "failed", "aborted"), report
        assert rows["b-0"]["state"] == "QUEUED" and rows["b-1"]["state"] == "PENDING", rows
        assert all(r["throughput_qps"] is None for r in rows.values()), rows

        # The insider (issue 33): the builder's own key, stolen, signs a trojan it uploads
        # first. Stored (the signature is the builder's), never handed out: the builder's
        # signed report names its own engine.
        stolen = device_identity.load_device_key(builder.key_path)
        store = Store(db)
        try:
            cls = (store.device("b-0")["status"]["platform"] or {}).get("engine_class")
        finally:
            store.close()
        payload.write_bytes(b"an insider's engine that answers 1e6 on a trigger " * 64)
        engine_share.write_container(str(evil), "0" * 64, str(payload), {}, "b-0")
        inside = evil.read_bytes()
        inside_sha = hashlib.sha256(inside).hexdigest()
        assert put(offer, {"X-Content-Sha256": inside_sha,
                           "X-Engine-Signature": device_identity.sign_engine(
                               stolen, device_identity.engine_statement(
                                   "b-0", "ro-trojan", inside_sha, len(inside), cls))},
                   inside)[0] == 201
        fault("insider_upload")

        # The genuine builder comes: its engine, signed by its key, is the one adopted.
        started(builder)
        report = wait_rollout(db, "ro-trojan", lambda r: r["state"] in (
            "succeeded", "failed", "aborted"), service, timeout=240)
        rows = {r["device"]: r for r in report["devices"]}
        assert report["state"] == "succeeded", report
        assert {d: r["share"]["mode"] for d, r in rows.items()} == {
            "b-0": "built", "b-1": "adopted", "b-2": "adopted"}, rows
        assert all(r["throughput_qps"] and r["throughput_qps"] != 99999.0
                   for r in rows.values()), rows
        store = Store(db)
        try:
            assert sha not in store.artifacts()
            keys = {j["device"]: (j.get("result") or {}).get("engine_key")
                    for j in store.rollout_jobs("ro-trojan")}
            shares = {j["device"]: j.get("share") or {} for j in store.rollout_jobs("ro-trojan")}
        finally:
            store.close()
        assert [r["sha256"] for r in shares["b-0"]["refused"]] == [inside_sha], shares
        assert shares["b-1"]["engine"] == shares["b-2"]["engine"] != inside_sha, shares
        assert keys["b-0"] and keys["b-1"] == keys["b-2"] == keys["b-0"], keys

        # A leaked upload URL after `fleet rollouts cancel`: refused, even signed by the builder.
        assert builder.stop() == 0
        wait_offline(db, "b-0", service)
        out = fleet_cli(["rollout"] + fp16_args() + [
            "--devices", "b-0", "b-1", "--rollout-id", "ro-cancel", "--db", db, "--submit",
            "--detach"])
        assert out.returncode == 0, out.stderr
        doc = retained_doc(arena, "controller", "b-0", "ro-cancel", 30)
        assert doc and doc["share"]["offer"], service.tail()
        out = fleet_cli(["rollouts", "cancel", "ro-cancel", "--db", db])
        assert out.returncode == 0, out.stderr
        wait_rollout(db, "ro-cancel", lambda r: r["state"] in ("canceled", "cancelled",
                                                               "aborted"), service)
        key = device_identity.load_device_key(builder.key_path)
        store = Store(db)
        try:
            cls = (store.device("b-0")["status"]["platform"] or {}).get("engine_class")
        finally:
            store.close()
        statement = device_identity.engine_statement("b-0", "ro-cancel", sha, len(data), cls)
        status, _ = put(doc["share"]["offer"], {
            "X-Content-Sha256": sha, "X-Engine-Signature": device_identity.sign_engine(
                key, statement)}, data)
        fault("leaked_token")
        assert status == 404, status
        REPORT["jobs_refused"] += 1
        # Stopped cleanly above (exit 0): nothing for finish() to stop; its log still audited.
        builder._finished = True
        REPORT["unexpected_errors"] += read(builder.log).count("Traceback")
    finally:
        service.kill()
        for agent in agents:
            finish(agent)
    for agent in agents:
        agent.assert_store_sound()


def wait_offline(db, device, service, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        store = Store(db)
        try:
            row = store.device(device)
        finally:
            store.close()
        if row and row["status"].get("online") is False:
            return
        assert time.monotonic() < deadline, service.tail()
        time.sleep(0.2)


def _series(body):
    return [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]


def scrape(url):
    t0 = time.monotonic()
    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
        assert resp.status == 200
    finally:
        conn.close()
    return body, time.monotonic() - t0


def dashboard_url(service, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(r"dashboard on (http://\S+)", service.tail(100000))
        if m:
            return m.group(1)
        assert time.monotonic() < deadline, service.tail()
        time.sleep(0.2)


def test_20000_bogus_ids_leave_the_registry_and_metrics_alone(arena, tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    agent = started(arena.agent("f-0"))
    service = arena.service(db, "--dashboard", "127.0.0.1:0", "--max-pending", str(MAX_PENDING))
    try:
        wait_registered(db, ["f-0"], service, timeout=60)
        url = dashboard_url(service)
        # The baseline once the real device's telemetry is in (its series are part of it).
        deadline = time.monotonic() + 60
        while b"jetson_fleet_device_memory_used_ratio{" not in scrape(url)[0]:
            assert time.monotonic() < deadline, service.tail()
            time.sleep(0.2)
        base, _ = scrape(url)
        rng = random.Random(23)
        ids = ["bogus-{:08x}".format(rng.getrandbits(32)) for _ in range(FLOOD_IDS)]
        keys = [device_identity.create_device_key(str(tmp_path / "k{}.key".format(i)))
                for i in range(4)]  # signing keys of the signed births, a new key id each
        attacker = arena.client("intruder")
        t0 = time.monotonic()
        try:
            for n, dev in enumerate(ids):
                signed = n < FLOOD_SIGNED
                platform = {"board": "Bogus", "backend": "onnxruntime"}
                if signed:
                    platform["identity"] = keys[n % len(keys)].identity()
                msg = status_messages.status_message(dev, True, 1, "9.9", platform, [],
                                                     ts=time.time())
                body = protocol.encode(msg)
                props = device_identity.ReportSigner(keys[n % len(keys)], dev, 1).properties(
                    T.status(dev), body) if signed else None
                attacker.publish(T.status(dev), body, retain=False, user_properties=props)
                tele = protocol.encode({"device": dev, "ts": time.time(), "metrics": {
                    "temp_{:08x}_c".format(rng.getrandbits(32)): 1.0}})
                attacker.publish(T.telemetry(dev), tele, qos=0)
            # The sentinel: the intruder's own signed birth, last on this connection; once it
            # is pending, the service has read the flood (or the broker dropped it).
            own = device_identity.create_device_key(str(tmp_path / "intruder.key"))
            sentinel = protocol.encode(status_messages.status_message(
                "intruder", True, 1, "9.9", {"board": "Bogus", "identity": own.identity()}, [],
                ts=time.time()))
            signer = device_identity.ReportSigner(own, "intruder", 1)
            deadline = time.monotonic() + 120
            while not pending_has(db, "intruder"):
                assert time.monotonic() < deadline, (counters(db), service.tail())
                attacker.publish(T.status("intruder"), sentinel, user_properties=signer.properties(
                    T.status("intruder"), sentinel)).wait(30)
                for _ in range(10):
                    if pending_has(db, "intruder"):
                        break
                    time.sleep(0.2)
        finally:
            attacker.stop()
        took = time.monotonic() - t0
        fault("bogus_ids", FLOOD_IDS)
        store = Store(db)
        try:
            assert [d["device"] for d in store.devices()] == ["f-0"]
            assert store.pending_count() <= MAX_PENDING
        finally:
            store.close()
        body, scrape_s = scrape(url)
        assert len(body) <= 1.10 * len(base), (len(base), len(body))
        assert len(_series(body)) <= 1.10 * len(_series(base))
        assert scrape_s < 1.0, scrape_s
        out = fleet_cli(["devices", "--db", db, "--json"])
        assert [d["device"] for d in json.loads(out.stdout)] == ["f-0"]
        print("{} broker, {} bogus ids in {:.1f} s: registry 1 device, /metrics {} -> {} "
              "bytes, scrape {:.3f} s, admission {}".format(
                  arena.kind, FLOOD_IDS, took, len(base), len(body), scrape_s, counters(db)))
    finally:
        service.kill()
        finish(agent)


def pending_has(db, device):
    store = Store(db)
    try:
        return bool((store.device_keys().get(device) or {}).get("pending_key_id"))
    finally:
        store.close()


def retained_birth(arena, user, device, timeout):
    """``device``'s retained status as ``user`` reads it, once it says online."""
    status = first_retained(arena, user, T.status(device), timeout,
                            lambda msg: bool(msg.get("online")))
    if status is None:
        raise AssertionError("no online status of {} within {} s".format(device, timeout))
    return status


@pytest.mark.parametrize("arena", ["acl"], indirect=True)
def test_an_unsigned_rollout_fails_fast_on_the_acl_broker(arena, keys, tmp_path):
    """The shipped TLS+ACL broker: the controller account reads the device's birth
    (``requires_signed_jobs``) and an embedded ``fleet rollout`` without ``--signing-key``
    refuses at once, naming the fix, instead of QUEUED then TIMED_OUT at its deadline."""
    agent = started(arena.agent("f-0", security=keys["security"]))
    try:
        status = retained_birth(arena, "controller", "f-0", 60)
        assert status["platform"]["requires_signed_jobs"] is True, status
        db = "sqlite:///" + str(tmp_path / "fleet.db")
        t0 = time.monotonic()
        out = fleet_cli(["rollout"] + fp16_args() + arena.cli + [
            "--devices", "f-0", "--json", "-q", "--embedded", "--db", db], timeout=120)
        took = time.monotonic() - t0
        fault("unsigned_rollout_acl")
        assert out.returncode != 0, out.stdout[-2000:]
        assert "signing_required" in out.stderr and "--signing-key" in out.stderr, \
            out.stderr[-2000:]
        assert took < 60
        REPORT["jobs_refused"] += 1
        with agent.journal() as journal:  # nothing was sent: the device's journal is empty
            assert journal.jobs() == []
    finally:
        finish(agent)
