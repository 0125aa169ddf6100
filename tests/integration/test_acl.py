"""Per-device access with the shipped Mosquitto configuration (systemd/mosquitto/): each device
reads only its own job, block and command topics and writes only its own status topics.

A real Mosquitto runs jetson-fleet.conf (TLS listener) in its documented password variant
(users made with ``mosquitto_passwd -b``) with jetson-fleet.acl unchanged. Denied publishes are
dropped by the broker (MQTT 3.1.1 has no way to say so; MQTT 5 answers "not authorized"): the
controller, allowed to read everything, checks that none of them got through. Denied reads:
device A subscribes to device B's topics and receives nothing while B does.
"""

import os
import queue
import threading
import time
import uuid

import pytest

from agent.errors import AgentError
from agent.wire import protocol, rollcall
from agent.wire.mqtt import CONNECT_FAILED, MESSAGE, MqttClient
from agent.wire.mqtt_types import TlsOptions, Will
from agent.wire.topics import Topics
from tests.integration.conftest import MOSQUITTO
from tests.integration.pki import FleetBroker, Pki, write_passwords

USERS = {"dev-a": "pw-a", "dev-b": "pw-b", "controller": "pw-ctl"}
T = Topics()
DEV = T.prefix + "/devices/"


class Client(object):
    """An agent.wire.mqtt client that records every message it receives."""

    def __init__(self, broker, user, password=None, mqtt="v5", will=None, subscribe=()):
        self.user = user
        self.client = MqttClient("{}-{}".format(user, uuid.uuid4().hex[:6]), broker.host,
                                 broker.port, protocol=mqtt, username=user,
                                 password=USERS.get(user) if password is None else password,
                                 tls=TlsOptions(ca_file=broker.pki.ca_file), will=will,
                                 clean_start=True, session_expiry=0, reconnect_min=0.2,
                                 reconnect_max=1.0, events=queue.Queue())
        self.messages = []
        self.lock = threading.Lock()
        for topic in subscribe:
            self.client.subscribe(topic, 1)
        self.client.start()
        self._stop = False
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self):
        while not self._stop:
            try:
                ev = self.client.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if ev.kind == MESSAGE:
                with self.lock:
                    self.messages.append((ev.topic, ev.payload))

    def topics(self):
        with self.lock:
            return [t for t, _ in self.messages]

    def publish(self, topic, payload, retain=False):
        return self.client.publish(topic, payload, qos=1, retain=retain)

    def close(self):
        self._stop = True
        self.client.stop()
        self.thread.join(2)


def wait_until(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what)


@pytest.fixture
def fleet_broker(tmp_path):
    if not os.path.exists(MOSQUITTO):
        pytest.skip("mosquitto is not installed")
    pki = Pki(tmp_path / "pki")
    passwords = write_passwords(tmp_path / "passwd", USERS)
    broker = FleetBroker(tmp_path / "broker", pki, passwords=passwords).start()
    yield broker
    broker.stop(kill=False)


def test_a_device_reads_and_writes_only_its_own_topics(fleet_broker):
    clients = []
    try:
        ctl = Client(fleet_broker, "controller", subscribe=[T.prefix + "/#"])
        a = Client(fleet_broker, "dev-a", subscribe=[
            DEV + "dev-b/jobs/+", T.prefix + "/devices/dev-b/artifacts/+/block/+",
            T.commands("dev-b"), T.status("dev-b"), DEV + "dev-b/jobs/+/status",
            T.prefix + "/#", DEV + "dev-a/jobs/+"])
        b = Client(fleet_broker, "dev-b", mqtt="v3.1.1",
                   subscribe=[DEV + "dev-b/jobs/+", T.prefix + "/devices/dev-b/artifacts/+/block/+",
                              T.commands("dev-b")])
        clients += [ctl, a, b]
        for c in clients:
            c.client.wait_connected(10)
        time.sleep(0.5)  # subscriptions acknowledged

        sha = "ab" * 32
        # The controller writes B's job, a block and a command, and A's job.
        for topic, payload in ((T.job("dev-b", "job-b"), b"job for b"),
                               (T.block("dev-b", sha, 0), b"block for b"),
                               (T.commands("dev-b"), b"command for b"),
                               (T.job("dev-a", "job-a"), b"job for a")):
            assert ctl.publish(topic, payload).wait(5)
        wait_until(lambda: len(b.messages) == 3 and len(a.messages) >= 1, 10,
                   "B's three messages and A's job")
        # A forges what B would send, and what the controller would send to B.
        forged = [T.status("dev-b"), T.job_status("dev-b", "job-b"),
                  T.artifact_request("dev-b", sha), T.telemetry("dev-b"),
                  T.command_reply("dev-b"), T.job("dev-b", "forged"), T.block("dev-b", sha, 1),
                  T.commands("dev-b"), T.job("dev-a", "self-made")]
        handles = [a.publish(topic, b"forged by a") for topic in forged]
        # ...and writes its own status, which is allowed.
        own = a.publish(T.status("dev-a"), b"a is online", retain=True)
        assert own.wait(5) and own.ok
        for h in handles:
            assert h.wait(5)
            assert not h.ok and "authori" in h.reason.lower(), (h.topic, h.reason)
        wait_until(lambda: T.status("dev-a") in ctl.topics(), 10, "A's own status")
        time.sleep(0.5)

        got_a = set(a.topics())  # (overlapping subscriptions: one copy per matching filter)
        assert got_a == {T.job("dev-a", "job-a")}, got_a  # nothing of B's, no forgery
        assert sorted(b.topics()) == sorted([T.job("dev-b", "job-b"), T.block("dev-b", sha, 0),
                                             T.commands("dev-b")])
        assert all(p != b"forged by a" for _, p in ctl.messages + b.messages)
        assert T.status("dev-a") in ctl.topics()
    finally:
        for c in clients:
            c.close()


def test_a_device_reads_its_birth_acks_and_the_call_and_forges_neither(fleet_broker):
    """Issue 37: the controller's acknowledgement reaches its device only; the retained call
    reaches every device; a device writes neither."""
    ack_a, ack_b = rollcall.ack_topic(T.prefix, "dev-a"), rollcall.ack_topic(T.prefix, "dev-b")
    call = rollcall.call_topic(T.prefix)
    clients = []
    try:
        ctl = Client(fleet_broker, "controller", subscribe=[T.prefix + "/rollcall/#"])
        a = Client(fleet_broker, "dev-a", subscribe=[ack_a, ack_b, call])
        clients += [ctl, a]
        for c in clients:
            c.client.wait_connected(10)
        time.sleep(0.5)  # subscriptions acknowledged
        for topic in (ack_a, ack_b, call):
            assert ctl.publish(topic, b"from the controller").wait(5)
        forged = [a.publish(topic, b"forged by a") for topic in (ack_a, ack_b, call)]
        for h in forged:
            assert h.wait(5)
            assert not h.ok and "authori" in h.reason.lower(), (h.topic, h.reason)
        wait_until(lambda: len(a.messages) == 2, 10, "A's ack and the call")
        time.sleep(0.3)
        assert sorted(a.topics()) == sorted([ack_a, call])
        assert all(p == b"from the controller" for _, p in a.messages + ctl.messages)
    finally:
        for c in clients:
            c.close()


def test_a_device_cannot_write_with_mqtt311_either(fleet_broker):
    """MQTT 3.1.1 publishes look acknowledged, but the broker drops them."""
    ctl = Client(fleet_broker, "controller", subscribe=[T.prefix + "/#"])
    a = Client(fleet_broker, "dev-a", mqtt="v3.1.1")
    try:
        ctl.client.wait_connected(10)
        a.client.wait_connected(10)
        time.sleep(0.3)
        forged = a.publish(T.status("dev-b"), b"b is offline (says a)", retain=True)
        assert forged.wait(5) and forged.ok  # PUBACK, no way to say "denied" in 3.1.1
        assert a.publish(T.status("dev-a"), b"own", retain=True).wait(5)
        wait_until(lambda: T.status("dev-a") in ctl.topics(), 10, "A's own status")
        time.sleep(0.3)
        assert T.status("dev-b") not in ctl.topics()
    finally:
        a.close()
        ctl.close()
    # Nothing was retained on B's status either: a new subscriber sees nothing there.
    late = Client(fleet_broker, "controller", subscribe=[T.status("dev-b"), T.status("dev-a")])
    try:
        late.client.wait_connected(10)
        wait_until(lambda: T.status("dev-a") in late.topics(), 10, "A's retained status")
        time.sleep(0.3)
        assert T.status("dev-b") not in late.topics()
    finally:
        late.close()


def test_a_will_on_another_devices_status_is_not_published(fleet_broker):
    """Mosquitto accepts the connection and drops the Will when it would send it; the same
    abrupt disconnect with a Will on the device's own status delivers that one."""
    ctl = Client(fleet_broker, "controller", subscribe=[T.prefix + "/devices/+/status"])
    ctl.client.wait_connected(10)
    time.sleep(0.3)
    honest = Client(fleet_broker, "dev-a", will=Will(T.status("dev-a"), b"a died"))
    sneaky = Client(fleet_broker, "dev-a", will=Will(T.status("dev-b"), b"b died (says a)"))
    try:
        for c in (honest, sneaky):
            c.client.wait_connected(10)
            c._stop = True
            c.client.drop_connection()  # no DISCONNECT: the broker sends the Will
        wait_until(lambda: T.status("dev-a") in ctl.topics(), 10, "A's own Will")
        time.sleep(0.5)
        assert T.status("dev-b") not in ctl.topics()
    finally:
        honest.close()
        sneaky.close()
        ctl.close()


@pytest.mark.parametrize("user, password", [("dev-a", "wrong"), ("nobody", "x"), (None, None)])
def test_unknown_users_and_anonymous_clients_are_refused(fleet_broker, user, password):
    c = MqttClient("x-" + uuid.uuid4().hex[:6], fleet_broker.host, fleet_broker.port,
                   username=user, password=password,
                   tls=TlsOptions(ca_file=fleet_broker.pki.ca_file), reconnect_min=0.2,
                   reconnect_max=0.5, events=queue.Queue())
    c.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and c.events.get(timeout=5).kind != CONNECT_FAILED:
            pass
        with pytest.raises(AgentError) as exc:
            c.wait_connected(0.1)
        assert exc.value.code == "broker_unreachable"
        assert "authori" in exc.value.message.lower() or "password" in exc.value.message.lower()
    finally:
        c.stop()


def test_a_real_agent_works_under_the_acl(fleet_broker, tmp_path, digits_files):
    """Everything the protocol needs is granted: birth and Will, job documents, block
    requests and blocks, job statuses, telemetry, commands and replies. The password comes
    from a credentials file ($CREDENTIALS_DIRECTORY, as systemd's LoadCredential= gives it)."""
    from agent.wire import job_signer
    from tests.integration.conftest import AgentProcess
    from tests.integration.controller import Controller

    keys = job_signer.generate_keypair(str(tmp_path / "keys"), "fleet")
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "mqtt-password").write_text(USERS["dev-a"] + "\n")
    workdir = tmp_path / "agent"
    workdir.mkdir()
    agent = AgentProcess(
        fleet_broker, workdir, "dev-a",
        security="  trusted_keys: [{}]\n".format(keys["public_key"]),
        broker_extra="  username: dev-a\n  password_file: mqtt-password\n  tls:\n"
                     "    ca_file: {}\n".format(fleet_broker.pki.ca_file),
        extra_config="telemetry_interval: 0.5\n")
    agent.start(env_extra={"CREDENTIALS_DIRECTORY": str(creds)})
    signer = job_signer.Signer(keys["private_key"], str(tmp_path / "seq.json"))
    ctl = Controller(fleet_broker, device="dev-a", signer=signer, username="controller",
                     password=USERS["controller"],
                     tls=TlsOptions(ca_file=fleet_broker.pki.ca_file))
    try:
        ctl.wait_online("dev-a", timeout=30)
        files = {role: ctl.add_artifact(digits_files[role])
                 for role in ("model", "inputs", "goldens")}
        ctl.send_job({"job_id": "under-acl", "kind": "deploy", "artifacts": files,
                      "plan": {"precision": "fp32"}, "gate": {"atol": 1e-4, "rtol": 1e-4},
                      "bench": {"iterations": 5, "warmup": 0}})
        final = ctl.wait_state("under-acl", protocol.TERMINAL_STATES, 60)
        assert final["state"] == "SUCCEEDED", (final, agent.log_tail())
        assert ctl.requests and ctl.blocks_sent  # block requests went through
        assert ctl.diag()["ok"]
        ctl.wait_for(lambda: ctl.telemetry, 10, "telemetry")
        assert not ctl.errors
        # An abrupt end: the broker publishes the device's Will on its own status.
        agent.kill()
        ctl.wait_for(lambda: ctl.device_status and ctl.device_status[-1]["online"] is False,
                     60, "the Will")
        assert ctl.device_status[-1]["reason"] == "connection_lost"
    finally:
        ctl.close()
        agent.kill()
    assert "not authori" not in agent.log_tail(100000).lower()


@pytest.fixture
def cert_broker(tmp_path):
    """The shipped config in its certificate variant: the CN is the user name."""
    if not os.path.exists(MOSQUITTO):
        pytest.skip("mosquitto is not installed")
    pki = Pki(tmp_path / "pki")
    broker = FleetBroker(tmp_path / "cert-broker", pki).start()
    yield broker
    broker.stop(kill=False)


LOADED_S = 60.0  # waits for something that must happen: long, they end when it does


def _persistent(broker, client_id, cn, subscribe=()):
    """A client with a persistent session, as the daemon connects, under certificate ``cn``."""
    cert, key = broker.pki.client(cn)
    c = MqttClient(client_id, broker.host, broker.port, clean_start=False, session_expiry=300,
                   tls=TlsOptions(ca_file=broker.pki.ca_file, cert_file=cert, key_file=key),
                   reconnect_min=0.2, reconnect_max=0.5, events=queue.Queue())
    for topic in subscribe:
        c.subscribe(topic, 1)
    c.start()
    return c


def _events(c, kind, timeout, first=False):
    """The events of ``kind`` seen within ``timeout`` s (``first``: return at the first)."""
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ev = c.events.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            break
        if ev.kind == kind:
            seen.append(ev)
            if first:
                break
    return seen


def test_a_device_can_take_neither_another_devices_client_id_nor_its_session(cert_broker):
    """The shipped config binds the client id to the certificate (use_username_as_clientid):
    device B connecting with device A's client id gets a session of its own, so it neither
    knocks A off nor resumes A's session and the jobs queued in it."""
    from agent.wire.mqtt import CONNECTED, DISCONNECTED, SUBSCRIBED

    job_topic = T.job("dev-a", "queued-for-a")
    a = _persistent(cert_broker, "dev-a", "dev-a", subscribe=[DEV + "dev-a/jobs/+"])
    clients = [a]
    try:
        assert _events(a, SUBSCRIBED, LOADED_S, first=True)
        a.stop()  # A is away; its session keeps its subscription and queues its jobs
        cert, key = cert_broker.pki.client("controller")
        ctl = MqttClient("ctl-" + uuid.uuid4().hex[:6], cert_broker.host, cert_broker.port,
                         tls=TlsOptions(ca_file=cert_broker.pki.ca_file, cert_file=cert,
                                        key_file=key), events=queue.Queue())
        ctl.start()
        clients.append(ctl)
        ctl.wait_connected(LOADED_S)
        assert ctl.publish(job_topic, b"job for a", qos=1).wait(LOADED_S)
        # B, with A's client id: a fresh session, nothing of A's.
        b = _persistent(cert_broker, "dev-a", "dev-b")
        clients.append(b)
        b.wait_connected(LOADED_S)
        connected = _events(b, CONNECTED, LOADED_S, first=True)
        assert connected and not connected[0].session_present
        assert not _events(b, MESSAGE, 1.0)
        # A comes back: its session (and the queued job) is intact; B is still connected.
        a2 = _persistent(cert_broker, "dev-a", "dev-a", subscribe=[DEV + "dev-a/jobs/+"])
        clients.append(a2)
        a2.wait_connected(LOADED_S)
        got = []
        deadline = time.monotonic() + LOADED_S
        while not got and time.monotonic() < deadline:
            try:
                ev = a2.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if ev.kind == CONNECTED:
                assert ev.session_present
            elif ev.kind == MESSAGE:
                got.append(ev)
        assert [(e.topic, e.payload) for e in got] == [(job_topic, b"job for a")]
        # B connects again with A's id while A is connected: A stays connected. (The first B
        # goes first: two live clients under B's certificate share B's client id and would
        # take it from each other, whatever A does.)
        b.stop()
        b2 = _persistent(cert_broker, "dev-a", "dev-b")
        clients.append(b2)
        b2.wait_connected(LOADED_S)
        assert _events(b2, CONNECTED, LOADED_S, first=True)
        assert not _events(a2, DISCONNECTED, 1.5) and a2.connected and b2.connected
    finally:
        for c in clients:
            c.stop()
