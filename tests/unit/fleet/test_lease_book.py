"""``LeaseBook`` (agent.fleet.database.leases): which fence keys may still be sent, on the
monotonic clock, without a database."""

import time

from agent.fleet.database.leases import LeaseBook


def test_a_rollouts_messages_go_only_under_its_epoch_and_deadline():
    book = LeaseBook("h", lease_s=6.0)  # margin 1.5 s: 4.5 s after a renewal began
    now = time.monotonic()
    assert book.may_act() and book.key() == ("", 0)  # before any claim: nothing held up yet
    book.claimed({"r": 3}, now)
    assert book.key("r") == ("r", 3) and book.key("other") == ("", 0)
    assert book.may_send(("r", 3)) and book.may_send(("", 0))
    assert not book.may_send(("r", 2))  # an older epoch: another holder came between
    book.claimed({"r": 3}, now - 5.0)  # a claim that began 5 s ago (it was held up since)
    assert not book.may_send(("r", 3)) and not book.may_act()
    book.renewed("r", now)  # a write renewed it just now
    assert book.may_send(("r", 3))
    book.claimed({}, time.monotonic())  # taken over: its messages never go
    assert not book.may_send(("r", 3))


def test_a_finished_rollouts_last_messages_need_no_lease():
    book = LeaseBook("h", lease_s=6.0)
    book.claimed({"r": 1}, time.monotonic())
    book.finish("r")
    book.claimed({}, time.monotonic())  # no longer active: not claimed any more
    assert book.may_send(("r", 1)) and not book.may_send(("r", 2))


def test_held_up_past_its_deadline_a_new_generation_sits_a_lease_out():
    book = LeaseBook("h", lease_s=6.0)
    start = time.monotonic() - 10.0
    book.claimed({"r": 1}, start)  # its deadline: start + 4.5 s, long passed
    assert not book.may_act() and not book.may_send(("", 0))
    book.claimed({"r": 1}, time.monotonic())  # the first claim after: held up
    assert book.generation == 1 and book.held_up_s > 5.0
    assert not book.may_act()  # one lease without acting on its own account
    assert not book.may_send(("", 0)) and not book.may_send(("", 1))
    assert book.may_send(("r", 1))  # its rollout's lease is its own again, same epoch
    book.quiet_until = time.monotonic()  # (the lease sat out)
    assert book.may_act() and book.may_send(("", 1)) and not book.may_send(("", 0))
