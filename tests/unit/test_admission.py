"""Device identity and admission without a broker (agent.wire.device_identity,
agent.fleet.admission.admission over a real SQLite store): messages are built and signed as a daemon
signs them, and go through the gate a controller puts in front of everything it reads.
The attacks of issue 23: a forged SUCCEEDED (unsigned, or signed by another key) is dropped;
a replayed older signed message is dropped; a new key for a known id goes back to pending;
an unknown device never enters the registry; the pending list is bounded."""

import json

import pytest

from agent.fleet.admission import admission
from agent.fleet.database.store import Store
from agent.wire import device_identity, protocol, status_messages
from agent.wire.mqtt_types import Event
from agent.wire.topics import Topics

T = Topics()


@pytest.fixture
def store(tmp_path):
    s = Store("sqlite:///" + str(tmp_path / "fleet.db"))
    yield s
    s.close()


class Device(object):
    """What a daemon publishes: its birth (with platform.identity) and job statuses, each
    signed with its key for its boot (ReportSigner), as MQTT events the controller sees."""

    def __init__(self, tmp_path, name, boot=1, key=None):
        self.name = name
        self.key = key or device_identity.create_device_key(str(tmp_path / (name + ".key")))
        self.signer = device_identity.ReportSigner(self.key, name, boot)
        self.boot = boot

    def event(self, topic, payload, signer=None):
        props = (signer or self.signer).properties(topic, payload)
        return T.parse(topic), Event("message", topic=topic, payload=payload,
                                     user_properties=props)

    def birth(self):
        msg = status_messages.status_message(self.name, True, self.boot, agent_version="x",
                                             platform={"board": "orin",
                                                       "identity": self.key.identity()},
                                             ts=1.0)
        return self.event(T.status(self.name), protocol.encode(msg))

    def job_status(self, state, version, signer=None):
        payload = json.dumps({"protocol": 1, "job_id": "ro", "device": self.name,
                              "state": state, "version": version}).encode()
        return self.event(T.job_status(self.name, "ro"), payload, signer)


def gate(store, policy="manual", keys=None):
    return admission.Admission(store, policy, keys or {})


def test_manual_admission_pending_accept_then_only_the_pinned_key_counts(store, tmp_path):
    dev = Device(tmp_path, "cam-1")
    g = gate(store)
    assert not g.check(*dev.birth())  # waits: pending, not in the registry
    assert not g.check(*dev.job_status("IN_PROGRESS", 1))
    assert [d["device"] for d in store.devices()] == []
    pending = store.device_keys()["cam-1"]
    assert (pending["state"], pending["pending_key_id"]) == ("pending", dev.key.key_id)
    admission.accept(store, "cam-1")
    g.refresh(force=True)
    assert [d["device"] for d in store.devices()] == ["cam-1"]  # its birth, kept while pending
    assert g.check(*dev.job_status("IN_PROGRESS", 2))
    # The forged SUCCEEDED of issue 23: unsigned, or signed by a key of the attacker's.
    info, ev = dev.job_status("SUCCEEDED", 99)
    ev.user_properties = []
    assert not g.check(info, ev)
    attacker = Device(tmp_path, "cam-1x")
    forged = device_identity.ReportSigner(attacker.key, "cam-1", dev.boot)
    assert not g.check(*dev.job_status("SUCCEEDED", 99, signer=forged))
    # A message of another device's topic, moved here: the signature covers the topic.
    info, ev = dev.job_status("SUCCEEDED", 3)
    moved = T.job_status("cam-2", "ro")
    assert not g.check(T.parse(moved), Event("message", topic=moved, payload=ev.payload,
                                             user_properties=ev.user_properties))
    assert g.counters["bad_signature"] >= 2 and g.counters["dropped"] >= 3


def test_a_replayed_signed_message_is_dropped(store, tmp_path):
    dev = Device(tmp_path, "cam-1")
    g = gate(store, "keys", {dev.key.key_id: dev.key.raw_public})
    assert g.check(*dev.birth())  # in the pre-provisioned list: admitted at once
    old = dev.job_status("IN_PROGRESS", 1)
    assert g.check(*old)
    assert g.check(*dev.job_status("SUCCEEDED", 2))
    assert not g.check(*old)  # the same signed bytes again, later: refused
    assert g.counters["replayed"] == 1
    assert g.check(*dev.job_status("SUCCEEDED", 2))  # same version re-sent: a new seq


def test_keys_policy_refuses_keys_not_listed(store, tmp_path):
    listed, other = Device(tmp_path, "a"), Device(tmp_path, "b")
    g = gate(store, "keys", {listed.key.key_id: listed.key.raw_public})
    assert g.check(*listed.birth()) and not g.check(*other.birth())
    assert store.device_keys()["b"]["state"] == "pending"


def test_a_reflashed_device_goes_back_to_pending(store, tmp_path):
    dev = Device(tmp_path, "cam-1")
    g = gate(store, "open")
    assert g.check(*dev.birth())
    assert [d["device"] for d in store.devices()] == []  # the service writes it, not the gate
    store.upsert_devices({"cam-1": {"online": True, "boot": 1}})
    flashed = Device(tmp_path, "cam-1-new", boot=1)
    flashed.name = "cam-1"
    flashed.signer = device_identity.ReportSigner(flashed.key, "cam-1", 1)
    g2 = gate(store, "manual")
    assert not g2.check(*flashed.birth())
    row = store.device_keys()["cam-1"]
    assert (row["state"], row["pending_key_id"]) == ("pending", flashed.key.key_id)
    assert store.devices() == []  # no longer targeted by --all or a selector
    assert not g2.check(*dev.job_status("IN_PROGRESS", 5))


def test_unsigned_devices_are_dropped_unless_legacy(store, tmp_path):
    store.upsert_devices({"old-1": {"online": True, "boot": 3}})  # heard before admission
    g = gate(store)
    assert store.device_keys()["old-1"]["state"] == "legacy"
    unsigned = json.dumps({"protocol": 1, "job_id": "ro", "device": "old-1",
                           "state": "SUCCEEDED", "version": 1}).encode()
    topic = T.job_status("old-1", "ro")
    assert g.check(T.parse(topic), Event("message", topic=topic, payload=unsigned))
    topic = T.job_status("new-1", "ro")
    assert not g.check(T.parse(topic), Event("message", topic=topic, payload=unsigned))
    # The legacy device upgraded: its first key waits (served as before meanwhile) ...
    up = Device(tmp_path, "old-1", boot=4)
    assert g.check(*up.birth())
    row = store.device_keys()["old-1"]
    assert (row["state"], row["pending_key_id"]) == ("legacy", up.key.key_id)
    # ... until accepted; or pinned at once while the operator's window is open.
    store.set_legacy_window(2e9)
    g.refresh(force=True)
    assert g.check(*up.birth())
    assert store.device_keys()["old-1"]["state"] == "admitted"
    info, ev = up.job_status("SUCCEEDED", 9)
    ev.user_properties = []
    assert not g.check(info, ev)  # from now on only what its key signed


def test_the_pending_list_is_bounded(store, tmp_path):
    g = admission.Admission(store, "manual", max_pending=3)
    for i in range(5):
        assert not g.check(*Device(tmp_path, "d{}".format(i)).birth())
    assert sorted(store.device_keys("pending")) == ["d2", "d3", "d4"]
    assert g.counters["pending_evicted"] == 2


def test_the_will_is_signed_for_its_boot(tmp_path):
    dev = Device(tmp_path, "cam-1")
    payload = b'{"online": false}'
    topic = T.status("cam-1")
    props = dev.signer.properties(topic, payload, will=True)
    sig = device_identity.verify_report(dev.key.raw_public, "cam-1", topic, payload, props)
    assert sig.will and sig.boot == 1


def test_a_refresh_reads_what_changed_and_drops_what_was_deleted(store, tmp_path, monkeypatch):
    # Another process (fleet devices accept / forget) writes the rows; a refresh reads the rows
    # written since the last one, and each FULL_REFRESH_S drops the rows deleted meanwhile.
    clock = [1000.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: clock[0])
    gate = admission.Admission(store, "manual")
    admitted = []
    gate.on_admitted = admitted.append
    store.put_device_key("d1", {"state": "admitted", "key_id": "k1", "public_key": "x"})
    store.put_device_key("d2", {"state": "pending", "pending_key_id": "k2"})
    clock[0] += admission.REFRESH_S
    gate.refresh()
    assert set(gate.rows) == {"d1", "d2"}
    store.put_device_key("d2", {"state": "admitted", "key_id": "k2", "public_key": "y"})
    clock[0] += admission.REFRESH_S
    gate.refresh()
    assert gate.rows["d2"]["state"] == "admitted" and admitted == ["d2"]
    store.db.execute("DELETE FROM device_keys WHERE device_id = ?", ("d1",))
    clock[0] += admission.REFRESH_S
    gate.refresh()
    assert "d1" in gate.rows  # deletions: at the next full pass
    clock[0] += admission.FULL_REFRESH_S
    gate.refresh()
    assert set(gate.rows) == {"d2"}
