"""agent.fleet.rollouts.reread: which unfinished jobs to read again, how often, how many."""

from agent.fleet.rollouts.device_run import DeviceRun
from agent.fleet.rollouts.reread import Reread


def run(device, state, job_id="j1"):
    r = DeviceRun(device, 0)
    r.state, r.job_id = state, job_id
    return r


def busy(rr, now):
    rr.heard("ro", "other", now)  # another status of the rollout, just now: it goes on


def test_while_statuses_flow_an_unchanged_run_is_read_again_a_bounded_number_of_times():
    """Waits of 10, then 20 s; two attempts, then the stage's own timeout decides."""
    rr = Reread(after_s=10, attempts=2, batch=100, busy_every_s=0)
    runs = [run("a", "QUEUED"), run("b", "IN_PROGRESS"), run("c", "SUCCEEDED"),
            run("d", "PENDING")]
    for now, want in [(0.0, []), (9.0, []), (10.0, [("a", "j1", 1), ("b", "j1", 1)]),
                      (25.0, []),  # the next attempt waits twice as long
                      (30.0, [("a", "j1", 2), ("b", "j1", 2)]),
                      (99.0, [])]:  # attempts spent: the stage's timeout decides
        busy(rr, now)
        assert not rr.quiet("ro", now) and rr.room("ro", now) == rr.busy_batch
        assert rr.due("ro", runs, now, 100) == want, now


def test_a_change_restarts_the_wait_and_a_round_is_bounded():
    rr = Reread(after_s=10, attempts=3, batch=100, busy_every_s=0)
    runs = [run("d{}".format(i), "QUEUED") for i in range(5)]
    busy(rr, 0.0)
    rr.due("ro", runs, 0.0, 100)
    runs[0].state = "IN_PROGRESS"  # (a new stage of the job, downloading -> building, too)
    busy(rr, 10.0)
    due = rr.due("ro", runs, 10.0, 2)
    assert [d for d, _j, _a in due] == ["d1", "d2"]  # d0 changed; room for two
    assert [d for d, _j, _a in rr.due("ro", runs, 10.0, 100)] == ["d3", "d4"]
    rr.forget("ro")
    assert rr.due("ro", runs, 100.0, 100) == []


def test_once_the_rollout_is_quiet_what_is_unfinished_is_read_back_in_rounds_within_seconds():
    """The end of a stream: 3,500 QUEUED runs whose statuses the queue dropped (most of the
    stage: the service was starved) come back in rounds of 1,000, one a second, their own
    answers not ending the quiet."""
    rr = Reread(after_s=30, batch=1000, quick_s=2, quiet_s=1)
    runs = [run("d{}".format(i), "QUEUED") for i in range(3500)]
    runs += [run("f{}".format(i), "SUCCEEDED") for i in range(500)]
    busy(rr, 0.0)
    assert rr.due("ro", runs, 0.0, rr.room("ro", 0.0)) == []  # noted while busy
    assert not rr.quiet("ro", 0.5) and rr.due("ro", runs, 0.5, 200) == []  # scans 5 s apart
    asked = []
    now = 1.0
    while len(asked) < 3500 and now < 10:
        due = rr.due("ro", runs, now, rr.room("ro", now))
        assert len(due) <= 1000
        assert not due or not rr.answered()  # asked, not answered yet
        for device, _j, attempt in due:
            asked.append(device)
            assert attempt == 1
            rr.heard("ro", device, now + 0.1)  # the answers to the round
        assert rr.answered()  # the next round may go before its time
        now += 1.0
    # Quiet at 1 s, unchanged for 2 s at 2 s: four rounds, 2 to 5 s.
    assert sorted(asked) == sorted(r.device for r in runs[:3500]) and now == 6.0, now
    # Those whose answer did not come either are asked again, 4 s after their first read.
    assert rr.due("ro", runs, 5.5, 1000) == []
    again = rr.due("ro", runs, 2.0 + 4.0, 1000)
    assert len(again) == 1000 and again[0] == ("d0", "j1", 2)
    # Documents still to send: never quiet (the service, busy building them, reads nothing).
    rr.sending("ro", 6.2)
    assert not rr.quiet("ro", 6.5)
    # A status from a device not asked: the stream goes on (it had paused), the quiet ends.
    rr.heard("ro", "d3499", 6.5)
    assert not rr.quiet("ro", 7.0) and rr.room("ro", 7.0) == rr.busy_batch


def test_quiet_waits_double_up_to_a_cap_the_attempts_are_bounded_and_a_fleet_wide_build_waits():
    rr = Reread(quick_s=2, max_wait_s=120, attempts=8)
    assert [rr.wait(True, a) for a in range(8)] == [2, 4, 8, 16, 32, 64, 120, 120]
    assert rr.wait(False, 0) == rr.after_s

    def reads(runs):
        out, now = [], 0.0
        while now < 3600:
            out += [now for _ in rr.due("ro", runs, now, 1000)]
            now += 1.0
        rr.forget("ro")
        return out

    # A straggler whose peers are done: read within seconds, then less and less often.
    straggler = reads([run("a", "IN_PROGRESS"), run("b", "SUCCEEDED")])
    assert len(straggler) == 8 and straggler[0] <= 7 and straggler[-1] < 400
    # A job not started yet, in a quiet rollout: the same (its QUEUED came, its start not).
    assert reads([run("a", "QUEUED"), run("b", "IN_PROGRESS")])[0] <= 7
    # The whole stage building for minutes, quiet: not overdue, the busy waits (30 s, ...).
    building = reads([run("a", "IN_PROGRESS"), run("b", "IN_PROGRESS")])
    assert len(building) == 16 and building[0] >= 30
