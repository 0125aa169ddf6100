"""Births acknowledged and paced (agent.wire.rollcall, agent.device.birth_pacing): the answer
window sized to the fleet, each device's slot in it, the doubling retry, and the device's state
through acknowledgements and calls."""

from agent.device.birth_pacing import BirthPacer
from agent.wire import rollcall


def test_the_window_is_sized_to_the_fleet_within_bounds():
    assert rollcall.window_for(0) == rollcall.MIN_WINDOW_S
    assert rollcall.window_for(50000) == 50000 / rollcall.ANSWERS_PER_S
    assert rollcall.window_for(10 ** 9) == rollcall.MAX_WINDOW_S


def test_slots_spread_a_fleet_evenly_and_stay_put():
    devices = ["dev-{:05d}".format(i) for i in range(10000)]
    slots = [rollcall.slot(d) for d in devices]
    assert all(0.0 <= s < 1.0 for s in slots)
    assert slots == [rollcall.slot(d) for d in devices]  # the same place every time
    per_tenth = [0] * 10
    for s in slots:
        per_tenth[int(s * 10)] += 1
    # ANSWERS_PER_S at most in any tenth of a window sized for them (give or take 10 %)
    assert max(per_tenth) < 1100 and min(per_tenth) > 900, per_tenth


def test_a_retry_waits_twice_as_long_each_time_up_to_a_cap_plus_the_slot():
    dev, window = "dev-00001", 50.0
    offset = rollcall.slot(dev) * window
    delays = [rollcall.retry_delay(dev, a, window, ack_wait_s=10.0, max_backoff_s=300.0)
              for a in range(8)]
    assert [round(d - offset, 6) for d in delays] == [10, 20, 40, 80, 160, 300, 300, 300]
    assert rollcall.retry_delay(dev, 10 ** 6, window) <= rollcall.MAX_BACKOFF_S + window


def test_calls_and_acks_are_parsed_bounded():
    assert rollcall.parse_call(rollcall.encode_call("c1", 50.0)) == ("c1", 50.0)
    assert rollcall.parse_call(rollcall.encode_call("c1", 1e9)) == ("c1", rollcall.MAX_WINDOW_S)
    ack = rollcall.encode_ack("dev-1", 3, "c1", 20.0)
    assert rollcall.parse_ack("dev-1", ack) == (3, "c1", 20.0)
    assert rollcall.parse_ack("dev-2", ack) is None  # another device's
    for junk in (b"", b"[]", b"{", b"x" * 600, b'{"call": "c", "window_s": "1"}',
                 b'{"call": "' + b"c" * 65 + b'", "window_s": 1}'):
        assert rollcall.parse_call(junk) is None
        assert rollcall.parse_ack("dev-1", junk) is None
    assert rollcall.parse_ack("dev-1", b'{"device": "dev-1", "boot": true, "window_s": 1}') \
        is None


class Clock(object):
    t = 1000.0

    def __call__(self):
        return self.t


def test_before_any_call_a_birth_goes_out_once():
    clock = Clock()
    pacer = BirthPacer("dev-3", 1, clock=clock, ack_wait_s=1.0)
    pacer.published()
    clock.t += 10000.0
    assert not pacer.due() and pacer.next_at is None
    pacer.on_call(rollcall.encode_call("c1", 8.0))  # a controller that acknowledges came:
    # the retry, whose backoff passed long ago, at the device's slot of the window from now
    assert pacer.next_at == clock.t + rollcall.slot("dev-3") * 8.0


def test_a_birth_goes_out_again_until_acknowledged_then_answers_each_call_once():
    clock = Clock()
    offset = rollcall.slot("dev-7")
    pacer = BirthPacer("dev-7", 4, clock=clock, ack_wait_s=1.0, max_backoff_s=4.0)
    pacer.on_call(rollcall.encode_call("c0", 10.0))
    pacer.connected()
    pacer.published()
    assert not pacer.due()
    clock.t += 1.0 + offset * 10.0
    assert pacer.due()
    pacer.published()  # the retry waits twice as long
    assert pacer.next_at == clock.t + 2.0 + offset * 10.0
    assert not pacer.on_ack(rollcall.encode_ack("dev-7", 3, None, 5.0))  # an older boot's
    assert not pacer.on_ack(rollcall.encode_ack("dev-8", 4, None, 5.0))
    assert pacer.on_ack(rollcall.encode_ack("dev-7", 4, "c1", 20.0))
    assert pacer.acked and pacer.next_at is None and pacer.window_s == 20.0
    pacer.on_call(rollcall.encode_call("c1", 30.0))  # acknowledged under this call already
    assert pacer.next_at is None and pacer.window_s == 30.0
    pacer.on_call(rollcall.encode_call("c2", 40.0))  # a restarted controller's call
    assert pacer.next_at == clock.t + offset * 40.0
    clock.t = pacer.next_at
    assert pacer.due()
    pacer.published()  # the answer: acknowledged in turn, or again later
    pacer.on_call(rollcall.encode_call("c2", 40.0))  # the same call again: answered already
    assert pacer.next_at == clock.t + 1.0 + offset * 40.0


def test_a_call_while_the_birth_waits_for_its_ack_only_paces_the_retry():
    clock = Clock()
    slot = rollcall.slot("dev-9")
    pacer = BirthPacer("dev-9", 1, clock=clock, ack_wait_s=1.0)
    pacer.on_call(rollcall.encode_call("c1", 60.0))
    pacer.published()
    sent = clock.t
    assert pacer.next_at == sent + 1.0 + slot * 60.0
    clock.t += 0.5
    pacer.on_call(rollcall.encode_call("c1", 2.0))  # the retry, paced by the call's window
    assert pacer.next_at == sent + 1.0 + slot * 2.0 and pacer.window_s == 2.0
    clock.t = pacer.next_at
    pacer.published()
    assert pacer.next_at == clock.t + 2.0 + slot * 2.0
