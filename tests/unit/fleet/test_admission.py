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


def test_an_admitted_identity_is_sticky_an_impostor_changes_nothing(store, tmp_path):
    dev = Device(tmp_path, "cam-1")
    g = gate(store, "open")
    assert g.check(*dev.birth())
    assert [d["device"] for d in store.devices()] == []  # the service writes it, not the gate
    store.upsert_devices({"cam-1": {"online": True, "boot": 1}})
    impostor = Device(tmp_path, "cam-1-new", boot=1)
    impostor.name = "cam-1"
    impostor.signer = device_identity.ReportSigner(impostor.key, "cam-1", 1)
    for policy, keys in (("manual", None), ("open", None),
                         ("keys", {impostor.key.key_id: impostor.key.raw_public})):
        g2 = gate(store, policy, keys)
        assert not g2.check(*impostor.birth())
        row = store.device_keys()["cam-1"]
        assert (row["state"], row["key_id"]) == ("admitted", dev.key.key_id)
        assert [d["device"] for d in store.devices()] == ["cam-1"]
        assert g2.check(*dev.job_status("IN_PROGRESS", 5 + len(policy)))
        assert g2.counters["impostor"] == 1
        # The forged SUCCEEDED of issue 33 item 4, signed by the impostor's key: dropped.
        assert not g2.check(*dev.job_status("SUCCEEDED", 99, signer=impostor.signer))
    view = admission.identity_view(store, "cam-1")
    assert view["impostor_events"] >= 1 and view["last_impostor"]["key_id"] == impostor.key.key_id
    # The operator re-keys a re-flashed device; a rotation is a birth signed by the old key.
    admission.rekey(store, "cam-1", impostor.key.public_base64)
    g3 = gate(store, "manual")
    assert g3.check(*impostor.birth()) and not g3.check(*dev.job_status("SUCCEEDED", 99))
    rotated = device_identity.create_device_key(str(tmp_path / "rot.key"))
    msg = status_messages.status_message("cam-1", True, 1, platform={
        "identity": rotated.identity()}, ts=2.0)
    assert g3.check(*impostor.event(T.status("cam-1"), protocol.encode(msg)))
    assert store.device_keys()["cam-1"]["key_id"] == rotated.key_id


def test_accept_pins_a_key_the_operator_saw(store, tmp_path):
    a = Device(tmp_path, "cam-2")
    b = Device(tmp_path, "cam-2b")
    b.name, b.signer = "cam-2", device_identity.ReportSigner(b.key, "cam-2", 1)
    g = gate(store)
    assert not g.check(*a.birth()) and not g.check(*b.birth())
    with pytest.raises(admission.AgentError) as exc:
        admission.accept(store, "cam-2")
    assert exc.value.code == "admission_key_ambiguous"
    assert a.key.key_id in exc.value.message and b.key.key_id in exc.value.message
    with pytest.raises(admission.AgentError) as exc:
        admission.accept(store, "cam-2", seen_key_id="0123456789abcdef")
    assert exc.value.code == "admission_key_changed"
    assert admission.accept(store, "cam-2", seen_key_id=a.key.key_id)["key_id"] == a.key.key_id
    one = Device(tmp_path, "cam-3")
    assert not g.check(*one.birth())
    assert admission.accept(store, "cam-3")["key_id"] == one.key.key_id


def test_admission_keys_bind_a_key_to_its_device(store, tmp_path):
    a, b, c = Device(tmp_path, "a"), Device(tmp_path, "b"), Device(tmp_path, "c")
    path = tmp_path / "keys"
    path.write_text("# bound, then unbound\na {}\n{}\n".format(
        a.key.public_base64, b.key.public_base64))
    keys, bound = admission.load_keys_bindings(str(path))
    assert bound == {a.key.key_id: "a"} and set(keys) == {a.key.key_id, b.key.key_id}
    g = admission.Admission(store, "keys", keys, bound=bound)
    steal = device_identity.ReportSigner(a.key, "x", 1)
    a_as_x = Device(tmp_path, "x", key=a.key)
    a_as_x.signer = steal
    assert not g.check(*a_as_x.birth())  # a bound key takes no other id
    assert g.check(*a.birth())
    b_as_c = Device(tmp_path, "c2", key=b.key)
    b_as_c.name, b_as_c.signer = "c", device_identity.ReportSigner(b.key, "c", 1)
    assert g.check(*b_as_c.birth())  # the unbound key's first claim ...
    b_as_d = Device(tmp_path, "d", key=b.key)
    assert not g.check(*b_as_d.birth())  # ... its only one
    assert g.counters["key_bound_elsewhere"] == 2 and "x" not in store.device_keys(
        "admitted") and c.name == "c"


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


def test_eviction_spares_listed_and_viewed_devices_and_a_key_is_rate_limited(store, tmp_path):
    listed, viewed = Device(tmp_path, "listed"), Device(tmp_path, "viewed")
    g = admission.Admission(store, "manual", {listed.key.key_id: listed.key.raw_public},
                            max_pending=3)
    assert not g.check(*listed.birth()) and not g.check(*viewed.birth())
    admission.identity_events.mark_viewed(store, "viewed")
    g.refresh(force=True)
    for i in range(6):
        assert not g.check(*Device(tmp_path, "f{}".format(i)).birth())
    assert sorted(store.device_keys("pending")) == ["f5", "listed", "viewed"]
    one = Device(tmp_path, "one")
    for i in range(admission.PENDING_PER_KEY + 5):
        d = Device(tmp_path, "k{}".format(i), key=one.key)
        assert not g.check(*d.birth())
    assert g.counters["pending_rate_limited"] == 5
    # All keys together: births for ids not admitted beyond PENDING_BURST are dropped unread.
    g.flood = admission.identity_events.KeyBuckets(60, 2)
    before = g.counters["pending_rate_limited"]
    for i in range(5):
        assert not g.check(*Device(tmp_path, "r{}".format(i)).birth())
    assert g.counters["pending_rate_limited"] - before == 3
    assert "r4" not in store.device_keys()


def test_a_replayed_will_is_dropped(store, tmp_path):
    dev = Device(tmp_path, "cam-9")
    g = gate(store, "open")

    def status(online, session):
        ident = dict(dev.key.identity(), session=session)
        msg = status_messages.status_message("cam-9", online, 1, platform={"identity": ident},
                                             ts=3.0)
        payload = protocol.encode(msg)
        props = dev.signer.properties(T.status("cam-9"), payload, will=not online)
        return T.parse(T.status("cam-9")), Event("message", topic=T.status("cam-9"),
                                                  payload=payload, user_properties=props)

    assert g.check(*status(True, "s1"))
    will1 = status(False, "s1")
    assert g.check(*will1)  # the connection's own Will
    assert g.check(*status(True, "s2"))  # reconnected: a new session
    assert not g.check(*will1) and g.counters["will_replayed"] == 1
    assert not g.check(*status(False, "s1"))
    assert g.check(*status(False, "s2"))


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
