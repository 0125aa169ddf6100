"""Device identity over a real Mosquitto and a real daemon: the signature a daemon puts in
the MQTT v5 user properties of its publishes survives the broker's retained store (a
controller that subscribes later verifies the birth) and the Will (pre-signed at connect for
that boot); the birth announces the key and whether the device requires signed jobs; a
configured key that cannot be read stops the daemon with its code."""

import json
import os
import queue
import subprocess
import sys
import time
import uuid

from agent.wire import device_identity, protocol
from agent.wire.mqtt import MESSAGE, MqttClient
from agent.wire.topics import Topics


def listen(broker, topic, want, timeout=30.0):
    """The first message on ``topic`` for which ``want(msg, event)`` holds."""
    events = queue.Queue()
    client = MqttClient("obs-" + uuid.uuid4().hex[:6], broker.host, broker.port,
                        clean_start=True, session_expiry=0, events=events)
    client.subscribe(topic, 1)
    client.start()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                ev = events.get(timeout=0.5)
            except queue.Empty:
                continue
            if ev.kind == MESSAGE and ev.payload:
                msg = protocol.decode("status", ev.payload)
                if want(msg, ev):
                    return msg, ev
    finally:
        client.stop()
    raise AssertionError("nothing on " + topic)


def test_retained_birth_and_will_keep_their_signatures(mosquitto, agent_factory):
    agent = agent_factory("signed-1").start()
    key = device_identity.load_device_key(agent.key_path)
    topic = Topics().status("signed-1")
    try:
        listen(mosquitto, topic, lambda m, e: m.get("online"))  # the birth is out
        # Subscribed after the birth was retained: delivered from the broker's store.
        birth, ev = listen(mosquitto, topic, lambda m, e: m.get("online"))
        assert ev.retain
        platform = birth["platform"]
        assert platform["identity"]["key_id"] == key.key_id
        assert platform["requires_signed_jobs"] is False  # the fixture's allow_unsigned lab
        sig = device_identity.verify_report(key.raw_public, "signed-1", topic, ev.payload,
                                            ev.user_properties)
        assert not sig.will
    finally:
        agent.kill()  # no DISCONNECT: the broker publishes the Will
    will, ev = listen(mosquitto, topic, lambda m, e: not m.get("online"))
    sig = device_identity.verify_report(key.raw_public, "signed-1", topic, ev.payload,
                                        ev.user_properties)
    assert sig.will and sig.boot == birth["boot"]


def test_an_unreadable_configured_key_stops_the_daemon(mosquitto, agent_factory, tmp_path):
    agent = agent_factory("nokey-1", extra_config="", security=(
        "  allow_unsigned: false\n  device_key: {}\n".format(tmp_path / "missing.key")))
    agent.start()
    assert agent.proc.wait(60) != 0
    assert "device_key_unreadable" in agent.log_tail()


def test_keygen_device_makes_a_key_pair(tmp_path):
    path = tmp_path / "etc" / "device.key"
    out = subprocess.run([sys.executable, "-m", "agent", "keygen", "--device", str(path),
                          "--json"], stdout=subprocess.PIPE, check=True)
    assert b"key_id" in out.stdout
    assert (path.stat().st_mode & 0o777) == 0o600
    public = json.loads(out.stdout)["public_key"]  # the file it wrote, by its real name
    assert public == str(tmp_path / "etc" / "device.pub") and os.path.isfile(public)
    again = subprocess.run([sys.executable, "-m", "agent", "keygen", "--device", str(path)],
                           stderr=subprocess.PIPE)
    assert again.returncode != 0  # never overwritten: a new key is a new identity
