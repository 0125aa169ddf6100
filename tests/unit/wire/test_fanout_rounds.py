"""Fan-out rounds (agent/wire/fanout_rounds.py, used by agent/wire/block_server.py): a block
goes out on the shared topic once per round; a device that missed a round joins the next one
(no fall-back to its own topic); a large artifact's first round waits for the devices just sent
its job; a device asking again for what went out while it listened gets no second copy."""

from agent.wire import fanout_rounds
from agent.wire.fanout_rounds import Rounds

SHA = "b" * 64
BIG = 16 << 20
BS = 65536


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_block_goes_out_once_for_the_devices_listening():
    clock = Clock()
    r = Rounds(2.0, clock)
    assert r.request(SHA, BS, BIG, "d1", [0, 1, 2]) == [0, 1, 2]
    clock.now += 0.1
    r.request(SHA, BS, 4096, "d2", [])  # d2 starts listening (another artifact's size)
    assert r.request(SHA, BS, BIG, "d1", [0, 1, 2, 3]) == [3]  # d1 listened: has 0..2
    assert r.due() == {} and r.next_due() is None


def test_a_device_that_missed_a_round_joins_the_next():
    clock = Clock()
    r = Rounds(2.0, clock)
    assert r.request(SHA, BS, BIG, "early", [0, 1]) == [0, 1]
    clock.now += 0.5
    assert r.request(SHA, BS, BIG, "late", [0, 1]) == []  # went out before it listened
    assert r.joined == 2
    due = r.next_due()
    assert due is not None and due - clock.now <= fanout_rounds.JOIN_S
    clock.now += 0.5
    assert r.request(SHA, BS, BIG, "later", [0, 1]) == []  # the same coming round
    assert r.due() == {}
    clock.now = due
    assert r.due() == {"{}:{}".format(SHA, BS): [0, 1]}  # one copy for both
    assert r.next_due() is None


def test_a_small_artifacts_next_round_comes_sooner():
    clock = Clock()
    r = Rounds(2.0, clock)
    r.request(SHA, BS, 4128, "early", [0])
    clock.now += 0.05
    assert r.request(SHA, BS, 4128, "late", [0]) == []
    assert r.next_due() - clock.now <= fanout_rounds.SMALL_JOIN_S + 1e-9


def test_a_large_artifacts_first_round_waits_for_the_devices_just_sent_its_job():
    clock = Clock()
    r = Rounds(2.0, clock)
    for dev in ("d1", "d2", "d3"):
        r.expect(SHA, dev)
    clock.now += 0.3
    # Held (d2 and d3 are coming) but for its prelude: one block at once, so that the devices
    # listening wait their full request timeout rather than leave the shared topic.
    assert r.request(SHA, BS, BIG, "d1", [0, 1, 2]) == [0]
    assert r.next_due() - clock.now <= fanout_rounds.HOLD_S + 1e-9
    clock.now += 0.2
    assert r.request(SHA, BS, BIG, "d2", [0, 1, 2]) == []  # block 0: the next round
    assert r.request(SHA, BS, BIG, "d3", [0, 1, 2]) == []  # the last expected: the round goes
    assert r.next_due() <= clock.now
    # One round for all three: the prelude again (for d2 and d3) with the rest.
    assert r.due() == {"{}:{}".format(SHA, BS): [0, 1, 2]}
    assert r.next_due() is None
    clock.now += 0.1
    assert r.request(SHA, BS, BIG, "d1", [3]) == [3]  # after the first round: at once


def test_the_hold_ends_when_expected_devices_do_not_come():
    clock = Clock()
    r = Rounds(2.0, clock)
    r.expect(SHA, "d1")
    r.expect(SHA, "gone")
    assert r.request(SHA, BS, BIG, "d1", [0, 1]) == [0]
    assert r.due() == {}
    clock.now += fanout_rounds.HOLD_S
    assert r.due() == {"{}:{}".format(SHA, BS): [1]}


def test_small_artifacts_and_unexpected_requests_are_not_held():
    clock = Clock()
    r = Rounds(2.0, clock)
    r.expect(SHA, "d1")
    r.expect(SHA, "d2")
    assert r.request(SHA, BS, 4096, "d1", [0]) == [0]  # below HOLD_BYTES
    other = "c" * 64
    assert r.request(other, BS, BIG, "d1", [0]) == [0]  # nobody expected for it


def test_expected_devices_are_forgotten():
    clock = Clock()
    r = Rounds(2.0, clock)
    r.expect(SHA, "d1")
    clock.now += fanout_rounds.EXPECT_S + 0.1
    r.expect("c" * 64, "d2")
    assert SHA not in r.expected


def test_a_late_device_gets_the_missed_blocks_in_the_next_round_on_the_shared_topic(tmp_path):
    # As a daemon of any release fetches (agent.wire.device.transfer.BlockFetcher): a device that
    # starts listening after the blocks went out gets them from the next round, on the shared
    # topic, before its first fan-out timeout; nothing goes on its own topic.
    from tests.unit.wire.test_transfer_fanout import late_joiner

    clock, broker, sha, data, _late, (j1, j2) = late_joiner(tmp_path)
    assert not broker.completed["late"]
    due = broker.server.next_due()
    assert due is not None and due - clock.now < 3.0  # FANOUT_FIRST_TIMEOUT_S
    clock.now = due
    assert broker.server.poll() == 6
    broker.pump()
    (got_sha, path), = broker.completed["late"]
    assert got_sha == sha and open(path, "rb").read() == data
    assert all("/devices/" not in topic for topic, _ in broker.published)  # shared only
    assert len(broker.published) == 12  # two rounds: one copy each
    j1.close()
    j2.close()
