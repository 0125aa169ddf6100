"""The job-rate token bucket, and that wire values never become file paths."""

import pytest

from agent.device.journal.store import Journal
from agent.errors import AgentError
from agent.wire import protocol
from agent.wire.device.artifacts import ArtifactStore
from agent.wire.device.limits import TokenBucket
from agent.wire.topics import Topics


def test_bucket_allows_a_burst_then_the_rate():
    now = [0.0]
    bucket = TokenBucket(rate=2.0, burst=3, clock=lambda: now[0])
    assert [bucket.take() for _ in range(4)] == [True, True, True, False]
    assert bucket.retry_after() == pytest.approx(0.5)
    now[0] += 0.5
    assert bucket.take() and not bucket.take()
    now[0] += 100  # refills up to the burst, not beyond
    assert sum(bucket.take() for _ in range(10)) == 3


def test_rate_zero_disables_the_limit_and_bad_values_are_refused():
    bucket = TokenBucket(rate=0, burst=1)
    assert all(bucket.take() for _ in range(1000)) and bucket.retry_after() == 0
    with pytest.raises(ValueError):
        TokenBucket(rate=-1, burst=1)
    with pytest.raises(ValueError):
        TokenBucket(rate=1, burst=0)


def test_a_clock_going_backwards_does_not_mint_tokens():
    now = [10.0]
    bucket = TokenBucket(rate=1.0, burst=1, clock=lambda: now[0])
    assert bucket.take()
    now[0] = 5.0
    assert not bucket.take()
    now[0] = 6.0
    assert bucket.take()


BAD_SHAS = ["../" * 21 + "a", "../../etc/passwd", "/" + "a" * 63, "A" * 64, "a" * 63,
            "a" * 65, "a" * 63 + "\n", "a" * 62 + "/.", "", "..", "a" * 63 + "\0"]


@pytest.mark.parametrize("value", BAD_SHAS)
def test_artifact_names_are_content_hashes_only(tmp_path, value):
    """No value from the wire becomes a path: the store refuses anything but 64 lowercase
    hex digits before it touches the file system."""
    with Journal(str(tmp_path / "j.sqlite3")) as journal:
        store = ArtifactStore(str(tmp_path / "state"), journal)
        for call in (store.has, store.path, store.partial_path, store.touch,
                     lambda s: store.begin(s, 10)):
            try:
                call(value)
            except AgentError as exc:
                assert exc.code == "bad_message"
            else:
                assert call is store.touch  # touch ignores what it cannot touch
    assert not protocol.valid_sha256(value)


@pytest.mark.parametrize("value", ["..", ".", "a/b", "../x", "-x", ".hidden", "x" * 65, "a\0",
                                   "a\n", ""])
def test_job_and_device_ids_cannot_name_a_path(value):
    """Job ids name the job's work directory: the id pattern rules out '/', '..' and
    leading dots."""
    assert not protocol.valid_id(value)
    with pytest.raises(AgentError):
        protocol.check_id("job id", value)


def test_topics_with_path_like_levels_are_refused():
    topics = Topics()
    for topic in ("jetson-agent/devices/dev1/artifacts/../../x/block/0",
                  "jetson-agent/devices/dev1/artifacts/{}/block/-1".format("a" * 64),
                  "jetson-agent/devices/../jobs/x", "jetson-agent/devices/dev1/jobs/.."):
        with pytest.raises(AgentError) as exc:
            topics.parse(topic)
        assert exc.value.code == "bad_message"


def test_the_event_queue_is_bounded_by_bytes():
    import queue
    import threading

    from agent.wire.device.limits import BlockingByteQueue

    class Ev(object):
        def __init__(self, n):
            self.payload = b"x" * n

    q = BlockingByteQueue(max_bytes=10000, max_items=100)
    q.put(Ev(6000))
    with pytest.raises(queue.Full):
        q.put(Ev(6000), timeout=0.05)  # over the bytes, not the count
    q.put(Ev(100))  # small ones still fit
    got = []
    t = threading.Thread(target=lambda: got.append(q.put(Ev(6000))))
    t.start()  # blocks (back-pressure) until the consumer drains
    assert q.get().payload == b"x" * 6000
    t.join(5)
    assert not t.is_alive() and q.qsize() == 2
    q.get(), q.get()
    assert q.bytes == 0
    q.put(Ev(50000))  # larger than the bound: still accepted into an empty queue
    assert q.get_nowait().payload and q.empty()
