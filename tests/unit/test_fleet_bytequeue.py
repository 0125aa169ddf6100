"""The controller's MQTT event queue: bounded in bytes, never blocks its producer (paho's
network thread); over budget only block requests and telemetry are dropped (and counted)."""

import queue
import threading

import pytest

from agent.fleet.transfer.bytequeue import ByteQueue
from agent.wire.mqtt import MESSAGE
from agent.wire.mqtt_types import Event


def msg(topic, size):
    return Event(MESSAGE, topic=topic, payload=b"x" * size)


def test_over_budget_requests_and_telemetry_are_dropped_statuses_never():
    q = ByteQueue(max_bytes=10000)
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
    q = ByteQueue(max_bytes=1)
    got = []
    t = threading.Thread(target=lambda: got.append(q.get(timeout=5)))
    t.start()
    q.put(msg("p/devices/a/status", 100))  # over budget, kept, no wait
    t.join(5)
    assert got and got[0].topic == "p/devices/a/status"


def status(state):
    return '{{"job_id":"j","state":"{}","version":1}}'.format(state).encode()


def test_a_superseded_job_status_is_coalesced_the_newest_kept_in_order():
    q = ByteQueue(hold_s=0)
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
    q = ByteQueue(hold_s=0.2)
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

    q = ByteQueue()
    q.put(msg("p/devices/a/jobs/j/status", MAX_PAYLOAD + 1))  # decode would refuse it
    q.put(msg("p/devices/a/status", MAX_PAYLOAD))
    assert q.dropped == 1 and q.qsize() == 1


def test_retained_births_and_models_over_their_budget_are_left_at_the_broker():
    q = ByteQueue(max_bytes=1 << 20, reread_bytes=10000)
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
