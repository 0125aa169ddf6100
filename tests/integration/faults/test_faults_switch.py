"""kill -9 during a model switch (``switch_driver``: the daemon's switch in a subprocess), at
each step of it, KILLS times each: after every kill ``current`` points at a complete version
(its engine's size and sha256 as meta.json says), never a partial or missing one; at the end
nothing is pending, every job has ended SUCCEEDED (an interrupted one ran again or resumed its
wait), the journal's active version is ``current`` and the directories are the kept versions.
"""

import os
import subprocess
import sys
import time

from agent.device.journal.store import Journal
from agent.device.models.directory import ModelsDir, version_problem
from tests.integration.faults.suite import FAULTS, KILLS, REPORT

STEPS = ("version_written", "pending_recorded", "link_switched", "handoff_running", "pending")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def drive(state_dir, version=None, kill_at=""):
    cmd = [sys.executable, "-m", "tests.integration.faults.switch_driver", state_dir]
    if version:
        cmd += ["--version", version, "--kill-at", kill_at]
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True,
                          timeout=120)


def check_current(models):
    for name in models.names():
        link = os.path.join(models.name_dir(name), "current")
        if os.path.lexists(link):
            target = os.path.join(models.name_dir(name), os.readlink(link))
            assert os.path.isdir(target), "current of {} dangles: {}".format(name, target)
            assert version_problem(target) is None, version_problem(target)


def test_kill_during_switch(tmp_path):
    state = str(tmp_path)
    models = ModelsDir(os.path.join(state, "models"))
    started = time.monotonic()
    n = 0
    for _ in range(KILLS):
        for step in STEPS:
            n += 1
            out = drive(state, "v{}".format(n), step)
            REPORT["runs"] += 1
            assert out.returncode == -9, (step, out.returncode, out.stderr.decode()[-2000:])
            REPORT["faults_injected"] += 1
            FAULTS["kill -9 during a model switch ({})".format(step)] += 1
            check_current(models)
    out = drive(state)  # the last restart: recover, nothing new
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    check_current(models)
    with Journal(os.path.join(state, "journal.sqlite3")) as journal:
        assert journal.pending_versions() == []
        jobs = journal.jobs()
        assert len(jobs) == n
        lost = [j["job_id"] for j in jobs if j["state"] != "SUCCEEDED"]
        REPORT["data_lost"] += len(lost)
        REPORT["jobs_submitted"] += n
        REPORT["jobs_completed"] += n - len(lost)
        assert lost == [], [(j["job_id"], j["state"], j["error"]) for j in jobs
                            if j["state"] != "SUCCEEDED"]
        active = journal.active_version("det")
        assert active["version"] == "v{}".format(n) and active["state"] == "committed"
        assert models.current("det") == active["version"]
        assert sorted(models.versions("det")) == sorted(
            r["version"] for r in journal.model_versions("det"))
    print("{} kills in {:.1f} s".format(n, time.monotonic() - started))
