"""The fault suite: issue 33's attacks on an admitted identity, each on an OPEN broker (anyone
may publish) and on the shipped TLS+ACL broker, with a real daemon (its own key) and a real
``fleet serve``. On the ACL broker only the device's own account and the controller's may
write a device's status topic: the attacker there holds the controller's account (a leaked
credential, the strongest position short of the device's key), or the device's broker
password to knock its connection over.

- An impostor birth (retained, signed by the attacker's key and announcing it) under
  ``--admission manual``, ``keys`` and ``open``: the device stays admitted with its key and
  serving; the event is counted and shown by ``fleet devices show``. A key bound to a device
  id in --admission-keys admits no other id; an unbound one its first id only.
- ``fleet devices accept`` without ``--key`` for an id with two keys seen refuses and names
  both; a flood of signed births for made-up ids (distinct keys) fills the bounded pending
  list without evicting a pending device whose key is listed, nor one an operator looked at.
- A Will captured from a connection and replayed after the device reconnected (same boot)
  changes nothing.

The 100,000-id flood drives the admission component directly: tests/integration/
test_admission_flood.py.
"""

import json
import queue
import threading
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.fleet.database.store import Store
from agent.wire import device_identity, protocol, status_messages
from agent.wire.mqtt import MESSAGE, MqttClient
from agent.wire.mqtt_types import TlsOptions
from agent.wire.topics import Topics
from tests.integration.faults import test_faults_identity as identity_suite
from tests.integration.faults.suite import fault, finish, started
from tests.integration.faults.test_faults_identity import counters, pending_has
from tests.integration.test_fleet_service import (
    fleet_cli,
    fleet_main,
    fp16_args,
    wait_registered,
    wait_rollout,
)

T = Topics()
FLOOD_IDS = 20000
arena = identity_suite.arena  # the fixture: an open broker, then the shipped TLS+ACL one


def new_key():
    return device_identity.DeviceKey(Ed25519PrivateKey.generate())


def attacker(arena):
    """Who publishes the forgeries: anyone on the open broker; the controller's account on
    the ACL broker (the only other one that may write a device's status)."""
    return arena.client("intruder" if arena.kind == "open" else "controller")


def birth(device, key, online=True, session=None, boot=1):
    ident = key.identity()
    if session:
        ident["session"] = session
    msg = status_messages.status_message(device, online, boot, "9.9", {
        "board": "Impostor", "identity": ident}, [], ts=time.time())
    body = protocol.encode(msg)
    props = device_identity.ReportSigner(key, device, boot).properties(T.status(device), body)
    return body, props


def publish_birth(client, device, key, retain=True):
    body, props = birth(device, key)
    client.publish(T.status(device), body, retain=retain, user_properties=props).wait(10)


def key_row(db, device):
    store = Store(db)
    try:
        return store.device_keys().get(device) or {}
    finally:
        store.close()


def registry_row(db, device):
    store = Store(db)
    try:
        return store.device(device)
    finally:
        store.close()


def wait_for(what, service, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        assert time.monotonic() < deadline, service.tail(20000)
        time.sleep(0.3)


def reset_counters(db):
    store = Store(db)
    try:
        store.put_admission_counters("svc-1", {})
    finally:
        store.close()


def show(db, device):
    code, out, err = fleet_main(["devices", "show", device, "--db", db, "--json"])
    assert code == 0, err
    return json.loads(out)


def test_an_impostor_birth_leaves_the_device_admitted_and_serving(arena, tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    agent = started(arena.agent("f-0"))
    real = device_identity.load_device_key(agent.key_path)
    evil, unbound = new_key(), new_key()
    keys_file = tmp_path / "keys"
    keys_file.write_text("f-0 {}\n{}\n".format(real.public_base64, unbound.public_base64))
    service = None
    events = 0
    try:
        for policy in ("manual", "keys", "open"):
            reset_counters(db)  # this start's counts, not the last one's
            service = arena.service(db, "--admission", policy, "--admission-keys",
                                    str(keys_file))
            if policy == "manual":
                wait_for(lambda: pending_has(db, "f-0"), service)
                out = fleet_cli(["devices", "accept", "f-0", "--db", db])
                assert out.returncode == 0 and real.key_id in out.stdout, out.stderr
            wait_registered(db, ["f-0"], service, timeout=60)
            seen = registry_row(db, "f-0")["last_seen"]
            client = attacker(arena)
            try:
                publish_birth(client, "f-0", evil)  # retained: every later start reads it
                if policy == "keys":  # a listed key bound to f-0 (stolen) takes no other id
                    publish_birth(client, "thief", real)
                    publish_birth(client, "u-1", unbound)  # the unbound key's first id ...
                    publish_birth(client, "u-2", unbound)  # ... its only one
            finally:
                client.stop()
            fault("impostor_birth")
            wait_for(lambda: counters(db).get("impostor", 0) >= 1, service)
            row = key_row(db, "f-0")
            assert (row["state"], row["key_id"], row["pending_key_id"]) == (
                "admitted", real.key_id, None), row
            # Still served: its telemetry keeps coming in after the impostor's birth.
            wait_for(lambda seen=seen: (registry_row(db, "f-0")["last_seen"] or 0) > (
                seen or 0), service)
            assert registry_row(db, "f-0")["online"] is True
            view = show(db, "f-0")
            assert view["impostor_events"] > events and view["state"] == "admitted", view
            events = view["impostor_events"]
            assert view["last_impostor"]["key_id"] == evil.key_id, view
            if policy == "keys":
                wait_for(lambda: counters(db).get("key_bound_elsewhere", 0) >= 2, service)
                assert key_row(db, "u-1")["state"] == "admitted"
                assert key_row(db, "thief").get("state") in (None, "pending")
                assert key_row(db, "u-2").get("state") in (None, "pending")
                fault("bound_key_takeover", 2)
            service.kill()
            service = None
        assert key_row(db, "f-0")["key_id"] == real.key_id
        # Only an operator changes it (a re-flashed device): fleet devices rekey.
        out = fleet_cli(["devices", "rekey", "f-0", "--key", evil.public_base64, "--db", db])
        assert out.returncode == 0 and evil.key_id in out.stdout, out.stderr
        assert key_row(db, "f-0")["key_id"] == evil.key_id
    finally:
        if service is not None:
            service.kill()
        client = attacker(arena)
        try:  # the retained forgeries go (the shared open broker outlives the test)
            for dev in ("f-0", "thief", "u-1", "u-2"):
                client.publish(T.status(dev), b"", retain=True).wait(10)
        finally:
            client.stop()
        finish(agent)


def test_accept_needs_a_key_seen_and_a_pending_flood_spares_listed_devices(arena, tmp_path):
    """The intruder's account (its own id on the ACL broker) shows two keys for one id, then
    floods made-up ids (each signed by its own key; on the ACL broker they never pass the
    broker). b-0, whose key is listed, and b-1, which an operator looked at, wait in the
    bounded pending list throughout."""
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    listed = new_key()
    keys_file = tmp_path / "keys"
    keys_file.write_text("b-0 {}\n".format(listed.public_base64))
    service = arena.service(db, "--admission", "manual", "--admission-keys", str(keys_file),
                            "--max-pending", "40")
    service.wait_ready()
    intruder = arena.client("intruder")
    first, second, third = new_key(), new_key(), new_key()
    try:
        publish_birth(intruder, "intruder", first, retain=False)
        publish_birth(intruder, "intruder", second, retain=False)
        wait_for(lambda: len(show(db, "intruder")["keys_seen"]) == 2, service)
        out = fleet_cli(["devices", "accept", "intruder", "--db", db])
        assert out.returncode != 0, out.stdout
        assert "admission_key_ambiguous" in out.stderr, out.stderr
        assert first.key_id in out.stderr and second.key_id in out.stderr, out.stderr
        fault("accept_ambiguous")
        for user, key in (("b-0", listed), ("b-1", new_key())):
            own = arena.client(user)
            try:
                publish_birth(own, user, key, retain=False)
            finally:
                own.stop()
        wait_for(lambda: pending_has(db, "b-0") and pending_has(db, "b-1"), service)
        show(db, "b-1")  # an operator looks at it: kept
        for i in range(300):  # made-up ids, a key each (a key id adds 10 a minute at most)
            dev = "flood-{:04d}".format(i)
            body, props = birth(dev, new_key())
            intruder.publish(T.status(dev), body, qos=0, user_properties=props)

        def sentinel():  # after the flood, in order (again while the flood's limit drops it)
            publish_birth(intruder, "intruder", third, retain=False)
            return third.key_id in show(db, "intruder")["keys_seen"]

        wait_for(sentinel, service, 120)
        fault("pending_flood", 300)
        assert pending_has(db, "b-0") and pending_has(db, "b-1")
        store = Store(db)
        try:
            assert store.pending_count() <= 40
            flooded = [d for d in store.device_keys() if d.startswith("flood-")]
        finally:
            store.close()
        if arena.kind == "open":
            assert flooded
            wait_for(lambda: counters(db).get("pending_evicted", 0) >= 1, service)
        else:
            assert flooded == []  # the broker's ACL: an account writes its own id only
        out = fleet_cli(["devices", "accept", "intruder", "--db", db, "--key",
                         first.public_base64])
        assert out.returncode == 0 and first.key_id in out.stdout, out.stderr
    finally:
        intruder.stop()
        service.kill()


def test_a_replayed_will_changes_nothing(arena, tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    agent = started(arena.agent("f-0"))
    service = arena.service(db)
    try:
        wait_registered(db, ["f-0"], service, timeout=60)
        # The capture, while the service is down (on the ACL broker the spy holds the
        # controller's account, whose client id the broker enforces: one connection at once).
        service.kill()
        spy = arena.client("intruder" if arena.kind == "open" else "controller",
                           [T.status("f-0")])
        try:
            # Knock the device's connection over (its own account on the ACL broker, whose
            # client id the broker enforces), so the broker publishes its Will.
            kw = {} if arena.kind == "open" else {
                "username": "f-0", "password": arena.users["f-0"],
                "tls": TlsOptions(ca_file=arena.broker.pki.ca_file)}
            kick = MqttClient("f-0", arena.broker.host, arena.broker.port, clean_start=True,
                              session_expiry=0, events=queue.Queue(), **kw)
            kick.start()
            kick.wait_connected(10)
            kick.stop()
            will = wait_for(lambda: _next_status(spy, online=False), service)
            fault("will_captured")
            reborn = wait_for(lambda: _next_status(spy, online=True), service)
        finally:
            spy.stop()
        assert json.loads(will[0])["boot"] == json.loads(reborn[0])["boot"]  # same boot
        session = json.loads(reborn[0])["platform"]["identity"]["session"]
        assert session != json.loads(will[0])["platform"]["identity"]["session"]
        service = arena.service(db)
        wait_for(lambda: ((registry_row(db, "f-0")["status"].get("platform") or {}).get(
            "identity") or {}).get("session") == session, service)
        client = attacker(arena)  # on the ACL broker this knocks the service over a moment
        try:
            client.publish(T.status("f-0"), will[0], retain=True,
                           user_properties=will[1]).wait(10)
        finally:
            client.stop()
        fault("will_replayed")
        wait_for(lambda: counters(db).get("will_replayed", 0) >= 1, service)
        assert registry_row(db, "f-0")["online"] is True
        # The replayed Will is now the retained status: a service started later reads it
        # first, and still knows the current session (from the last status it kept).
        service.kill()
        reset_counters(db)
        service = arena.service(db)
        wait_for(lambda: counters(db).get("will_replayed", 0) >= 1, service)
        assert registry_row(db, "f-0")["online"] is True
    finally:
        service.kill()
        finish(agent)


def _next_status(client, online):
    """(payload, user properties) of the next status ``client`` reads with that ``online``."""
    try:
        ev = client.events.get(timeout=0.5)
    except queue.Empty:
        return None
    if ev.kind != MESSAGE or not ev.payload:
        return None
    if bool(json.loads(ev.payload).get("online")) != online:
        return None
    return ev.payload, list(ev.user_properties or [])




@pytest.mark.slow
@pytest.mark.parametrize("arena", ["open"], indirect=True)
def test_a_pending_flood_does_not_slow_an_unrelated_rollout(arena, tmp_path):
    """Open broker only (on the ACL broker an account writes its own id only): the same
    rollout to an admitted device, quiet and while 20,000 made-up ids, each signed by its
    own key, flood the pending list; the flooded one within 1.5x of the quiet one."""
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    agent = started(arena.agent("f-0"))
    service = arena.service(db)
    births = []
    for i in range(FLOOD_IDS):
        dev = "flood-{:05d}".format(i)
        births.append((T.status(dev),) + birth(dev, new_key()))
    intruder = arena.client("intruder")
    try:
        wait_registered(db, ["f-0"], service, timeout=60)

        def rollout(rid):
            t0 = time.monotonic()
            out = fleet_cli(["rollout"] + fp16_args() + [
                "--devices", "f-0", "--rollout-id", rid, "--db", db, "--submit", "--detach"])
            assert out.returncode == 0, out.stderr
            report = wait_rollout(db, rid, lambda r: r["state"] in (
                "succeeded", "failed", "aborted"), service, timeout=300)
            assert report["state"] == "succeeded", report
            return time.monotonic() - t0

        rollout("ro-warm")  # the engine built once: both measured rollouts hit the cache
        quiet = rollout("ro-quiet")
        done = threading.Event()

        def flood():
            for topic, body, props in births:
                if done.is_set():
                    return
                intruder.publish(topic, body, qos=0, user_properties=props)

        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        flooded = rollout("ro-flood")
        done.set()
        flooder.join(60)
        fault("pending_flood", FLOOD_IDS)
        print("rollout to an admitted device: {:.1f} s quiet, {:.1f} s during a flood of {} "
              "pending ids ({:.2f}x); admission {}".format(
                  quiet, flooded, FLOOD_IDS, flooded / quiet, counters(db)))
        # The goal (1.5x) is measured in docs/benchmarks.md; on a shared CI host a timed test
        # only catches the unbounded slowdown the flood once caused (10x and more).
        assert flooded <= 3 * quiet + 10.0, (quiet, flooded)
    finally:
        intruder.stop()
        service.kill()
        finish(agent)
