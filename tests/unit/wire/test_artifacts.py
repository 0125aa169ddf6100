import hashlib
import os
import random
import signal
import stat
import subprocess
import sys
import textwrap
import time

import pytest

from agent.device.journal.store import Journal
from agent.errors import AgentError
from agent.wire import protocol
from agent.wire.device.artifacts import ArtifactStore

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BS = 1024


def blob(size, seed=1):
    return random.Random(seed).getrandbits(8 * size).to_bytes(size, "little")


def sha(data):
    return hashlib.sha256(data).hexdigest()


def blocks_of(data, bs=BS):
    return [data[i:i + bs] for i in range(0, len(data), bs)]


class FakeStatvfs(object):
    """statvfs at the hardware boundary: a disk with ``free`` bytes available."""

    def __init__(self, free):
        self.free = free

    def __call__(self, path):
        return os.statvfs_result((4096, 4096, 1 << 20, self.free // 4096, self.free // 4096,
                                  0, 0, 0, 0, 255))


@pytest.fixture
def state(tmp_path):
    return str(tmp_path / "state")


@pytest.fixture
def journal(state):
    j = Journal(os.path.join(state, "journal.db"))
    yield j
    j.close()


def make_store(state, journal, **kw):
    kw.setdefault("reserve_bytes", 0)
    return ArtifactStore(state, journal, **kw)


def test_out_of_order_assembly(state, journal):
    data = blob(10 * BS + 77)
    store = make_store(state, journal, flush_every=3)
    digest = sha(data)
    assert not store.has(digest)
    t = store.begin(digest, len(data), BS)
    assert t.blocks == 11 and t.missing_indices() == list(range(11))
    order = list(range(11))
    random.Random(3).shuffle(order)
    for n, i in enumerate(order):
        assert t.write_block(i, blocks_of(data)[i])
        assert t.received() == n + 1
        assert t.write_block(i, blocks_of(data)[i])  # a duplicate is accepted, not rewritten
    assert t.complete() and t.missing_indices() == []
    path = t.finish()
    assert path == os.path.join(state, "artifacts", digest[:2], digest)
    with open(path, "rb") as f:
        assert f.read() == data
    assert not os.stat(path).st_mode & stat.S_IWUSR  # read-only in the store
    assert store.has(digest) and store.path(digest) == path
    assert journal.transfer_get(digest) is None
    assert os.listdir(os.path.join(state, "artifacts", "partial")) == []
    # an artifact already stored gives a complete transfer: nothing to fetch
    again = store.begin(digest, len(data), BS)
    assert again.complete() and again.missing_indices() == [] and again.finish() == path


def test_the_running_sha256_covers_what_is_on_disk(state, journal):
    # The sha256 is computed as blocks arrive: in order from the bytes in hand, blocks that came
    # early read back from the file once the gap fills. A block altered on disk after it was
    # written, ahead of the gap, is still caught at the end.
    data = blob(9 * BS + 3)
    store = make_store(state, journal)
    t = store.begin(sha(data), len(data), BS)
    for i in (5, 6, 8, 9):  # early, out of order
        assert t.write_block(i, blocks_of(data)[i])
    with open(store.partial_path(sha(data)), "r+b") as f:
        f.seek(6 * BS)
        f.write(b"\0")  # on disk, not what was received
    for i in (0, 1, 2, 3, 4, 7):
        assert t.write_block(i, blocks_of(data)[i])
    with pytest.raises(AgentError) as err:
        t.finish()
    assert err.value.code == "hash_mismatch"
    assert not store.has(sha(data))
    # the same blocks, untouched: accepted
    t = store.begin(sha(data), len(data), BS)
    for i in (9, 5, 0, 1, 8, 2, 3, 4, 7, 6):
        assert t.write_block(i, blocks_of(data)[i])
    with open(t.finish(), "rb") as f:
        assert f.read() == data


def test_missing_indices_follow_arrivals_in_any_order(state, journal):
    # The scan resumes past the blocks already in (a remembered cursor): it must still name
    # exactly the missing blocks, lowest first, whatever order they arrive in.
    data = blob(70 * BS + 5)
    t = make_store(state, journal).begin(sha(data), len(data), BS)
    order = list(range(t.blocks))
    random.Random(7).shuffle(order)
    for n, i in enumerate(order):
        assert t.write_block(i, blocks_of(data)[i])
        left = sorted(order[n + 1:])
        assert t.missing_indices() == left
        assert t.missing_indices(5) == left[:5]


def test_bad_blocks_are_refused(state, journal):
    data = blob(3 * BS + 10)
    t = make_store(state, journal).begin(sha(data), len(data), BS)
    assert not t.write_block(4, b"x" * BS)  # index past the end
    assert not t.write_block(-1, b"x" * BS)
    assert not t.write_block(0, b"x" * (BS - 1))  # wrong length
    assert not t.write_block(3, b"x" * BS)  # the last block is short
    assert t.write_block(3, data[3 * BS:])
    assert t.received() == 1


def test_hash_mismatch_discards_the_partial(state, journal):
    data = blob(4 * BS)
    store = make_store(state, journal)
    digest = sha(data)
    t = store.begin(digest, len(data), BS)
    for i, block in enumerate(blocks_of(blob(4 * BS, seed=2))):  # same size, other bytes
        t.write_block(i, block)
    with pytest.raises(AgentError) as info:
        t.finish()
    assert info.value.code == "hash_mismatch"
    assert digest in info.value.message and sha(blob(4 * BS, seed=2)) in info.value.message
    assert not store.has(digest)
    assert journal.transfer_get(digest) is None
    assert os.listdir(os.path.join(state, "artifacts", "partial")) == []
    # a fresh start begins from nothing
    assert store.begin(digest, len(data), BS).received() == 0


def test_truncated_artifact_is_a_mismatch(state, journal):
    data = blob(4 * BS)
    store = make_store(state, journal)
    t = store.begin(sha(data), 3 * BS, BS)  # the job announced a wrong (smaller) size
    for i in range(3):
        t.write_block(i, blocks_of(data)[i])
    with pytest.raises(AgentError) as info:
        t.finish()
    assert info.value.code == "hash_mismatch"


def test_disk_full_is_checked_before_starting(state, journal):
    disk = FakeStatvfs(free=100 * BS)
    store = make_store(state, journal, statvfs=disk, reserve_bytes=10 * BS)
    data = blob(95 * BS)
    with pytest.raises(AgentError) as info:
        store.begin(sha(data), len(data), BS)
    err = info.value
    assert err.code == "disk_full"
    assert err.details == {"needed": 105 * BS, "free": 100 * BS}
    assert str(105 * BS) in err.message and str(100 * BS) in err.message
    assert journal.transfers() == [] and store.transfer(sha(data)) is None
    disk.free = 200 * BS
    assert store.begin(sha(data), len(data), BS).received() == 0


def test_store_budget_evicts_unreferenced_artifacts(state, journal, tmp_path):
    store = make_store(state, journal, max_bytes=10 * BS)
    paths = []
    for seed in range(3):
        src = tmp_path / "a{}".format(seed)
        src.write_bytes(blob(3 * BS, seed=seed))
        paths.append(store.put_file(str(src)))
        os.utime(paths[-1], (1000 + seed, 1000 + seed))  # a0 is the least recently used
    shas = [os.path.basename(p) for p in paths]
    # an unfinished job references a0: it must survive
    journal.add_job({"job_id": "j", "kind": "deploy",
                     "artifacts": {"model": {"sha256": shas[0], "size": 3 * BS}}})
    assert store.usage() == 9 * BS
    data = blob(4 * BS, seed=9)
    store.begin(sha(data), len(data), BS)
    assert store.has(shas[0]) and not store.has(shas[1]) and store.has(shas[2])
    assert store.usage() == 10 * BS  # 2 stored + the transfer in progress
    big = blob(8 * BS, seed=10)
    with pytest.raises(AgentError) as info:
        store.begin(sha(big), len(big), BS)
    assert info.value.code == "disk_full" and "budget" in info.value.message


def test_put_file_verifies(state, journal, tmp_path):
    store = make_store(state, journal)
    src = tmp_path / "m.onnx"
    src.write_bytes(b"model bytes")
    with pytest.raises(AgentError) as info:
        store.put_file(str(src), sha256="0" * 64)
    assert info.value.code == "hash_mismatch"
    path = store.put_file(str(src), sha256=sha(b"model bytes"))
    assert store.put_file(str(src)) == path
    with pytest.raises(AgentError) as info:
        store.put_file(str(tmp_path / "missing"))
    assert info.value.code == "file_not_found"


def test_names_never_come_from_the_wire(state, journal):
    store = make_store(state, journal)
    for bad in ("../../etc/passwd", "A" * 64, "/tmp/x"):
        with pytest.raises(AgentError) as info:
            store.begin(bad, 10, BS)
        assert info.value.code == "bad_message"
        with pytest.raises(AgentError):
            store.path(bad)
    with pytest.raises(AgentError) as info:
        store.path("e" * 64)
    assert info.value.code == "unknown_artifact"
    for size, bs in ((0, BS), (-5, BS), (10, 100), (10, 1 << 21)):
        with pytest.raises(AgentError) as info:
            store.begin("e" * 64, size, bs)
        assert info.value.code == "bad_argument"


def test_huge_artifacts_get_bigger_blocks(state, journal):
    store = make_store(state, journal, statvfs=FakeStatvfs(1 << 40))
    size = protocol.MAX_BLOCKS * BS * 3  # 3 GiB in 1 KiB blocks would exceed MAX_BLOCKS
    store._allocate = lambda transfer: None  # do not really reserve 3 GiB on this disk
    t = store.begin("e" * 64, size, BS)
    assert t.block_size == 3 * BS and t.blocks == protocol.MAX_BLOCKS
    t.abort()


def test_recovery_drops_orphans(state, journal):
    store = make_store(state, journal)
    partial_dir = os.path.join(state, "artifacts", "partial")
    orphan = os.path.join(partial_dir, "f" * 64 + ".part")
    junk = os.path.join(partial_dir, ".import-123")
    for p in (orphan, junk):
        with open(p, "wb") as f:
            f.write(b"x")
    journal.transfer_put("a" * 64, 100, BS, b"\x00")  # a record whose file is gone
    make_store(state, journal)
    assert os.listdir(partial_dir) == [] and journal.transfers() == []
    assert store.entries() == []


CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r})
    from agent.wire.device.artifacts import ArtifactStore
    from agent.device.journal.store import Journal
    data = open({src!r}, "rb").read()
    store = ArtifactStore({state!r}, Journal({db!r}), reserve_bytes=0, flush_every=4)
    t = store.begin({sha!r}, len(data), {bs})
    for i in {order!r}:
        t.write_block(i, data[i * {bs}:(i + 1) * {bs}])
    if {kill}:
        os.kill(os.getpid(), signal.SIGKILL)  # no close, no flush of the last batch
    t.close()
""")


@pytest.mark.parametrize("kill", [False, True])
def test_resume_in_a_new_process_from_the_persisted_bitmap(state, journal, tmp_path, kill):
    data = blob(20 * BS + 5, seed=4)
    src = tmp_path / "src.bin"
    src.write_bytes(data)
    digest = sha(data)
    first = [19, 3, 7, 0, 12, 20, 5, 9, 1, 2]  # 10 blocks: two batches of 4 are fsync'd
    script = CHILD.format(root=ROOT, src=str(src), state=state, db=journal.path, sha=digest,
                          bs=BS, order=first, kill=kill)
    proc = subprocess.run([sys.executable, "-c", script])
    assert proc.returncode == (-signal.SIGKILL if kill else 0)
    store = make_store(state, journal)
    t = store.begin(digest, len(data), BS)
    have = set(range(21)) - set(t.missing_indices())
    if kill:
        assert have == set(first[:8])  # only what was fsync'd and recorded
    else:
        assert have == set(first)
    for i in t.missing_indices():
        assert t.write_block(i, blocks_of(data)[i])
    with open(t.finish(), "rb") as f:
        assert f.read() == data


def test_partials_no_job_needs_are_reclaimed_and_count_against_the_budget(state, journal):
    """A job naming large artifacts nobody serves must not leave pre-allocated partials that
    make every later job fail disk_full (at job end, start-up, and under store pressure)."""
    clock = [time.time()]  # the journal stamps transfers with the real time
    store = make_store(state, journal, max_bytes=10 * BS, clock=lambda: clock[0])
    t = store.begin("a" * 64, 8 * BS, BS)
    t.close()  # the job ended (fetcher.cancel): the partial stays, unreferenced
    assert [p["sha256"] for p in store.partials()] == ["a" * 64]
    assert store.usage() == 8 * BS  # counted at full size against the budget
    # Under pressure: the next artifact gets room by reclaiming it, not disk_full.
    store.begin("b" * 64, 8 * BS, BS).close()
    assert [p["sha256"] for p in store.partials()] == ["b" * 64]
    assert not os.path.exists(store.partial_path("a" * 64))
    # One an unfinished job names is kept ... until it is idle past the age limit.
    journal.add_job({"job_id": "j1", "kind": "deploy", "artifacts": {
        "model": {"sha256": "b" * 64, "size": 8 * BS}}})
    assert store.reclaim_partials() == []
    clock[0] += store.max_partial_age_s + 1
    assert store.reclaim_partials() == ["b" * 64]
    assert store.partials() == [] and journal.transfers() == []
    # A transfer being fetched here is never reclaimed.
    open_one = store.begin("c" * 64, 2 * BS, BS)
    assert store.reclaim_partials() == [] and store.partials()[0]["open"]
    open_one.close()
    assert store.reclaim_partials() == ["c" * 64]


def test_the_budget_is_never_exceeded_by_pre_allocation(state, journal):
    store = make_store(state, journal, max_bytes=4 * BS)
    journal.add_job({"job_id": "j1", "kind": "deploy", "artifacts": {
        "model": {"sha256": "a" * 64, "size": 3 * BS}}})
    store.begin("a" * 64, 3 * BS, BS).close()  # named by an unfinished job: kept
    with pytest.raises(AgentError) as exc:
        store.begin("b" * 64, 2 * BS, BS)
    assert exc.value.code == "disk_full" and "budget" in exc.value.message
    assert not os.path.exists(store.partial_path("b" * 64))  # nothing allocated
