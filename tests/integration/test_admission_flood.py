"""A flood of pending ids through the admission gate itself (agent.fleet.admission.admission over
a real SQLite store): births signed as a daemon signs them, each made-up id with its own key
(the per-key rate limit does not help here), all of them read (the gate's limit of births
for ids not admitted, ``PENDING_RATE`` a second, lifted: as an attacker staying under it for
half an hour would), interleaved with an admitted device's job
statuses, as a rollout's would be. The listed device and the one an operator looked at are
never evicted; the pending list stays within its bound; the admitted device's messages pass
the gate about as fast as without the flood; the log gets a few lines, not one per id.
The same flood through a broker, smaller: tests/integration/faults/test_faults_sticky.py.

20,000 ids (20 times the pending bound) in the suite; ``JETSON_AGENT_FLOOD=100000`` gives the
100,000 of docs/benchmarks.md.
"""

import json
import logging
import os
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from agent.fleet.admission import admission, identity_events
from agent.fleet.database.store import Store
from agent.wire import device_identity, protocol, status_messages
from agent.wire.mqtt_types import Event
from agent.wire.topics import Topics

T = Topics()
FLOOD = int(os.environ.get("JETSON_AGENT_FLOOD", "20000"))
EVERY = 50  # an admitted device's message after this many flood births


def signed_birth(device, key):
    body = protocol.encode(status_messages.status_message(
        device, True, 1, "9.9", {"board": "Bogus", "identity": key.identity()}, [], ts=1.0))
    props = device_identity.ReportSigner(key, device, 1).properties(T.status(device), body)
    return T.parse(T.status(device)), Event("message", topic=T.status(device), payload=body,
                                            user_properties=props)


def new_key():
    return device_identity.DeviceKey(Ed25519PrivateKey.generate())


@pytest.mark.slow
def test_a_flood_of_pending_ids_does_not_evict_a_listed_device(tmp_path, caplog):
    store = Store("sqlite:///" + str(tmp_path / "fleet.db"))
    listed, viewed, admitted = new_key(), new_key(), new_key()
    gate = admission.Admission(store, "manual", {listed.key_id: listed.raw_public},
                               bound={listed.key_id: "listed-1"})
    assert not gate.check(*signed_birth("listed-1", listed))
    assert not gate.check(*signed_birth("viewed-1", viewed))
    identity_events.mark_viewed(store, "viewed-1")
    store.put_device_key("cam-ok", {"state": "admitted", "key_id": admitted.key_id,
                                    "public_key": admitted.public_base64})
    gate.refresh(force=True)
    gate.flood = identity_events.KeyBuckets(10 ** 9, 10 ** 9)  # every birth read
    signer = device_identity.ReportSigner(admitted, "cam-ok", 1)
    topic = T.job_status("cam-ok", "ro-1")

    def rollout_message(version):
        payload = json.dumps({"protocol": 1, "job_id": "ro-1", "device": "cam-ok",
                              "state": "IN_PROGRESS", "version": version}).encode()
        ev = Event("message", topic=topic, payload=payload,
                   user_properties=signer.properties(topic, payload))
        t0 = time.perf_counter()
        assert gate.check(T.parse(topic), ev)
        return time.perf_counter() - t0

    quiet = sorted(rollout_message(v) for v in range(1, 2001))
    caplog.set_level(logging.INFO, logger="agent.fleet")
    flooded = []
    t0 = time.monotonic()
    for i in range(FLOOD):
        assert not gate.check(*signed_birth("flood-{:06d}".format(i), new_key()))
        if i % EVERY == 0:
            flooded.append(rollout_message(2001 + i // EVERY))
    took = time.monotonic() - t0
    flooded.sort()
    pending = store.device_keys("pending")
    assert "listed-1" in pending and "viewed-1" in pending
    assert len(pending) <= admission.MAX_PENDING
    assert gate.counters["pending_evicted"] >= FLOOD - admission.MAX_PENDING
    median_quiet, median_flood = quiet[len(quiet) // 2], flooded[len(flooded) // 2]
    # The goal (1.5x) is in docs/benchmarks.md; here only an unbounded slowdown fails.
    assert median_flood <= 3 * median_quiet, (median_quiet, median_flood)
    lines = [r for r in caplog.records if r.name == "agent.fleet"]
    assert len(lines) < 200, len(lines)  # rate-limited: not one line per id
    print("{} pending ids in {:.1f} s ({:.0f} us each); an admitted device's message through "
          "the gate: median {:.1f} us quiet, {:.1f} us during the flood ({:.2f}x); {} log "
          "lines; evicted {}".format(
              FLOOD, took, took / FLOOD * 1e6, median_quiet * 1e6, median_flood * 1e6,
              median_flood / median_quiet, len(lines), gate.counters["pending_evicted"]))
    store.close()
