"""agent.fleet.rollouts.reread: which unfinished jobs to read again, how often, how many."""

from agent.fleet.rollouts.device_run import DeviceRun
from agent.fleet.rollouts.reread import Reread


def run(device, state, job_id="j1"):
    r = DeviceRun(device, 0)
    r.state, r.job_id = state, job_id
    return r


def test_a_run_unchanged_past_the_wait_is_read_again_a_bounded_number_of_times():
    """Waits of 10, then 20 s; two attempts, then the stage's own timeout decides."""
    rr = Reread(after_s=10, attempts=2, batch=100)
    runs = [run("a", "QUEUED"), run("b", "IN_PROGRESS"), run("c", "SUCCEEDED"),
            run("d", "PENDING")]
    assert rr.due("ro", runs, 0.0, 100) == []  # first seen: noted
    assert rr.due("ro", runs, 9.0, 100) == []
    assert rr.due("ro", runs, 10.0, 100) == [("a", "j1", 1), ("b", "j1", 1)]
    assert rr.due("ro", runs, 25.0, 100) == []  # the next attempt waits twice as long
    assert rr.due("ro", runs, 30.0, 100) == [("a", "j1", 2), ("b", "j1", 2)]
    assert rr.due("ro", runs, 99.0, 100) == []  # attempts spent: the stage's timeout decides


def test_a_change_restarts_the_wait_and_a_round_is_bounded():
    rr = Reread(after_s=10, attempts=3, batch=100)
    runs = [run("d{}".format(i), "QUEUED") for i in range(5)]
    rr.due("ro", runs, 0.0, 100)
    runs[0].state = "IN_PROGRESS"  # (a new stage of the job, downloading -> building, too)
    due = rr.due("ro", runs, 10.0, 2)
    assert [d for d, _j, _a in due] == ["d1", "d2"]  # d0 changed; room for two
    assert [d for d, _j, _a in rr.due("ro", runs, 10.0, 100)] == ["d3", "d4"]
    rr.forget("ro")
    assert rr.due("ro", runs, 100.0, 100) == []
