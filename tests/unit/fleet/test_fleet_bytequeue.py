"""The controller's MQTT event queue: bounded in bytes, never blocks its producer (paho's
network thread); over budget only block requests and telemetry are dropped (and counted)."""

import queue
import threading
import time

import pytest

from agent.fleet.transfer.bytequeue import SheddingByteQueue
from agent.wire.mqtt import MESSAGE
from agent.wire.mqtt_types import Event


def msg(topic, size):
    return Event(MESSAGE, topic=topic, payload=b"x" * size)


def test_over_budget_requests_and_telemetry_are_dropped_statuses_never():
    q = SheddingByteQueue(max_bytes=10000)
    q.put(msg("p/devices/a/artifacts/" + "0" * 64 + "/request", 9000), timeout=0.5)
    q.put(msg("p/devices/a/artifacts/" + "0" * 64 + "/request", 9000), timeout=0.5)
    q.put(msg("p/devices/a/telemetry", 5000))
    for i in range(50):  # statuses are kept whatever the budget
        q.put(msg("p/devices/d{}/jobs/j/status".format(i), 5000))
    assert q.dropped == 2 and q.qsize() == 51
    assert q.peak >= 50 * 5000
    topics = [q.get(timeout=0.1).topic for _ in range(51)]
    assert topics[0].endswith("/request") and topics[-1].endswith("d49/jobs/j/status")
    assert q.bytes == 0 and q.empty()
    with pytest.raises(queue.Empty):
        q.get(timeout=0.01)


def test_put_never_blocks_and_get_wakes_up():
    q = SheddingByteQueue(max_bytes=1)
    got = []
    t = threading.Thread(target=lambda: got.append(q.get(timeout=5)))
    t.start()
    q.put(msg("p/devices/a/status", 100))  # over budget, kept, no wait
    t.join(5)
    assert got and got[0].topic == "p/devices/a/status"


def status(state):
    return '{{"job_id":"j","state":"{}","version":1}}'.format(state).encode()


def test_a_superseded_job_status_is_coalesced_the_newest_kept_in_order():
    q = SheddingByteQueue(hold_s=0)
    st = "p/devices/a/jobs/j/status"
    q.put(Event(MESSAGE, topic=st, payload=status("QUEUED")))
    q.put(msg("p/devices/a/status", 10))  # a birth between: stays before the newer status
    q.put(Event(MESSAGE, topic=st, payload=status("IN_PROGRESS")))
    q.put(msg("p/devices/b/jobs/j/status", 10))
    q.put(Event(MESSAGE, topic=st, payload=status("SUCCEEDED")))
    q.put(Event(MESSAGE, topic=st, payload=b""))  # a cleared retained status: not a status
    assert q.coalesced == 2 and q.qsize() == 4
    got = [(e.topic, e.payload) for e in (q.get(timeout=0.1) for _ in range(4))]
    assert got == [("p/devices/a/status", b"x" * 10), ("p/devices/b/jobs/j/status", b"x" * 10),
                   (st, status("SUCCEEDED")), (st, b"")]
    assert q.bytes == 0 and q.empty()
    q.put(Event(MESSAGE, topic=st, payload=status("FAILED")))  # once read, the next is kept
    assert q.get(timeout=0.1).payload == status("FAILED") and q.coalesced == 2


def test_a_status_not_final_waits_hold_s_and_is_superseded_unread():
    q = SheddingByteQueue(hold_s=0.2)
    a, b = "p/devices/a/jobs/j/status", "p/devices/b/jobs/j/status"
    q.put(Event(MESSAGE, topic=a, payload=status("QUEUED")))
    q.put(Event(MESSAGE, topic=b, payload=status("IN_PROGRESS")))
    q.put(msg("p/devices/a/status", 10))
    assert q.get(timeout=0.01).topic == "p/devices/a/status"  # the two statuses wait
    with pytest.raises(queue.Empty):
        q.get_nowait()
    q.put(Event(MESSAGE, topic=a, payload=status("IN_PROGRESS")))
    q.put(Event(MESSAGE, topic=a, payload=status("SUCCEEDED")))  # final: out at once
    q.put(Event(MESSAGE, topic=b, payload=b""))  # a clear of b: stays behind b's status
    assert q.get(timeout=0.01).payload == status("SUCCEEDED")
    assert q.coalesced == 2 and q.qsize() == 2
    got = [(e.topic, e.payload) for e in (q.get(timeout=5) for _ in range(2))]
    assert got == [(b, status("IN_PROGRESS")), (b, b"")]
    assert q.bytes == 0 and q.empty()


def test_a_payload_larger_than_any_decodable_message_is_dropped_whatever_the_budget():
    from agent.fleet.transfer.bytequeue import MAX_PAYLOAD

    q = SheddingByteQueue()
    q.put(msg("p/devices/a/jobs/j/status", MAX_PAYLOAD + 1))  # decode would refuse it
    q.put(msg("p/devices/a/status", MAX_PAYLOAD))
    assert q.dropped == 1 and q.qsize() == 1


def test_retained_births_and_models_over_their_budget_are_left_at_the_broker():
    q = SheddingByteQueue(max_bytes=1 << 20, reread_bytes=10000)
    for i in range(10):  # a subscription's flood of retained births and models messages
        for kind in ("status", "models"):
            ev = msg("p/devices/d{}/{}".format(i, kind), 2000)
            ev.retain = True
            q.put(ev)
    live = msg("p/devices/d9/status", 2000)  # a live birth: always kept
    q.put(live)
    final = msg("p/devices/d9/jobs/j/status", 2000)  # a retained job status: always kept
    final.retain = True
    q.put(final)
    kept = [q.get(timeout=0.1) for _ in range(q.qsize())]
    assert q.reread_dropped == 16 and q.dropped == 16  # the roll call reads those again
    assert kept[-2:] == [live, final]
    assert len(kept) == 6


def test_devices_not_admitted_share_one_small_budget_admitted_ones_keep_theirs(caplog):
    """A flood of births for made-up ids fills only the shared budget of devices not
    admitted (the rest dropped, one warning); an admitted device's messages still go in,
    each admitted device within its own budget."""
    import logging

    caplog.set_level(logging.WARNING, logger="agent.fleet")
    q = SheddingByteQueue(trusted=lambda d: d.startswith("real"), untrusted_bytes=100000,
                  source_bytes=30000, hold_s=0, untrusted_rate=1e12)
    for i in range(1000):
        q.put(msg("p/devices/fake{}/status".format(i), 9000))
    assert q.untrusted_dropped == 1000 - 10 and q.qsize() == 10
    q.put(msg("p/devices/real1/status", 9000))
    q.put(msg("p/devices/real1/jobs/j/status", 9000))
    q.put(msg("p/devices/real2/status", 9000))
    assert q.qsize() == 13 and q.bytes < 100000 + 2 * 30000
    for i in range(5):  # an admitted device flooding: over its own budget, dropped
        q.put(msg("p/devices/real1/telemetry/x{}".format(i), 9000))
    assert q.source_dropped == 4
    assert len([r for r in caplog.records if "dropped" in r.getMessage()]) == 1
    while not q.empty():  # the budgets come back as messages are taken
        q.get(timeout=0.1)
    assert q.bytes == 0 and not q._sources
    q.put(msg("p/devices/fake0/status", 9000))
    assert q.qsize() == 1


def test_a_coalesced_status_returns_its_source_budget():
    q = SheddingByteQueue(trusted=lambda d: False, untrusted_bytes=20000, hold_s=0,
                  untrusted_rate=1e12)
    for _ in range(100):
        q.put(msg("p/devices/x/jobs/j/status", 9000))
    assert q.qsize() == 1 and q.untrusted_dropped == 0 and q.coalesced == 99


def test_devices_not_admitted_enter_at_most_their_rate():
    """A queue drained at once still lets devices not admitted in at ``untrusted_rate``
    bytes a second only (the work behind the queue is bounded too), admitted ones as before."""
    q = SheddingByteQueue(trusted=lambda d: d == "real", untrusted_bytes=100000, hold_s=0,
                  untrusted_rate=10000.0)
    taken = 0
    t0 = time.monotonic()
    for i in range(2000):
        q.put(msg("p/devices/fake{}/status".format(i), 9000))
        while not q.empty():
            q.get(timeout=0.1)
            taken += 1
    elapsed = time.monotonic() - t0
    assert taken <= 12 + elapsed * 10000 / 9000 + 1, (taken, elapsed)
    q.put(msg("p/devices/real/status", 9000))
    assert q.qsize() == 1
