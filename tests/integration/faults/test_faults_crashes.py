"""The fault suite (``suite.py``): the faults that stop a part of the system. ``kill -9`` of the
agent at random points of its jobs, the broker killed and restarted during a transfer, and a
disk that fills during an engine-cache write."""

import collections
import os
import random
import sqlite3
import subprocess
import sys
import time

import pytest

from agent.wire import protocol
from tests.integration.faults.suite import (
    KILLS,
    REPORT,
    SEED,
    SMALL_BLOCKS,
    _sent,
    audit,
    calib_file,
    corrupt_entries,
    deploy_doc,
    fault,
    finish,
    started,
    submit,
)


def kill_point(agent, job_id):
    """Where the job stands when the daemon is killed: its stage (or state), "starting" before
    the daemon took the document, "ended" after it finished."""
    try:
        with agent.journal() as journal:
            row = journal.job(job_id)
    except sqlite3.Error:
        return "journal busy"
    if row is None:
        return "starting"
    if protocol.is_terminal(row["state"]):
        return "ended"
    return row["stage"] or row["state"].lower()


# ---------------------------------------------------------------------------- kill -9

def test_kill9_at_random_points(fleet, digits_files, tmp_path):
    controller, make_agent = fleet
    agent = make_agent(extra_config=SMALL_BLOCKS, start=False)
    rng = random.Random(SEED)
    jobs, current, points = [], None, collections.Counter()
    for _ in range(KILLS):
        if current is None or _ended(agent, current):
            current = "kill-{}".format(len(jobs))
            jobs.append(current)
            submit(controller, deploy_doc(controller, digits_files, current,
                                          calib=calib_file(tmp_path, len(jobs)),
                                          bench_iterations=rng.choice([300, 2000, 8000])))
        started(agent)
        time.sleep(rng.uniform(0.3, 2.5))
        if not agent.alive():
            REPORT["daemon_crashes"] += 1
            started(agent)
            continue
        points[kill_point(agent, current)] += 1
        agent.kill()
        fault("agent_kill_9")
    started(agent)
    result = audit(agent, controller, jobs)
    print("\nkill -9 points: {}; jobs: {}".format(dict(points), {
        i: (r["state"], (r["error"] or {}).get("code")) for i, r in result["rows"].items()}))
    assert not result["lost"] and not result["pending"] and not result["corrupt"], result
    assert result["checked"] >= 4  # the artifacts and at least one engine were verified
    # Each job completed, or ended FAILED with its reason (killed twice while its worker ran).
    assert all(r["state"] == "SUCCEEDED" or (r["state"] == "FAILED" and r["error"]["code"])
               for r in result["rows"].values())
    # The daemon still serves: one more job, after all that.
    submit(controller, deploy_doc(controller, digits_files, "after-kills"))
    assert controller.wait_state("after-kills", protocol.TERMINAL_STATES, 90)["state"] == \
        "SUCCEEDED", agent.log_tail()
    audit(agent, controller, ["after-kills"])


def _ended(agent, job_id):
    with agent.journal() as journal:
        row = journal.job(job_id)
    return row is not None and protocol.is_terminal(row["state"])


# ---------------------------------------------------------------------------- broker restarts

def test_broker_restarts_during_transfer(fleet, mosquitto, digits_files, tmp_path):
    controller, make_agent = fleet
    agent = make_agent(extra_config=SMALL_BLOCKS)
    calib = calib_file(tmp_path, 1000, rows=1000)  # 250 KiB: 250 blocks of 1 KiB
    doc = deploy_doc(controller, digits_files, "restarts", calib=calib)
    blocks = sum(protocol.block_count(a["size"], 1024) for a in doc["artifacts"].values())
    controller.served_limit = blocks // 4
    submit(controller, doc)
    for k in (1, 2, 3):
        controller.wait_for(lambda k=k: _sent(controller) >= blocks * k // 4, 30,
                            "{}/4 of the blocks".format(k))
        time.sleep(0.3)
        mosquitto.restart(down_s=0.5)  # SIGKILL, then the same port again
        fault("broker_restart")
        controller.client.wait_connected(15)
        controller.served_limit = blocks * (k + 1) // 4 if k < 3 else None
        controller.serve = True
    final = controller.wait_state("restarts", protocol.TERMINAL_STATES, 90)
    assert final["state"] == "SUCCEEDED", (final, agent.log_tail())
    duplicates = sum(n - 1 for n in controller.blocks_sent.values())
    assert len(controller.blocks_sent) == blocks
    assert duplicates <= 3 * 2 * 8, duplicates  # what was in flight at each restart
    result = audit(agent, controller, ["restarts"])
    assert not result["lost"] and not result["pending"] and not result["corrupt"], result


# ---------------------------------------------------------------------------- disk full

ENOSPC_SITECUSTOMIZE = r'''
"""Fault injection: ENOSPC on writes under FAULT_ENOSPC_DIR once more than the budget in
FAULT_ENOSPC_FILE has been written there ("off": no fault). Loaded by the worker only."""
import errno
import os

_DIR = os.environ.get("FAULT_ENOSPC_DIR", "")
_FILE = os.environ.get("FAULT_ENOSPC_FILE", "")
_real = {"write": os.write, "fsync": os.fsync}
_written = [0]


def _budget():
    try:
        with open(_FILE) as f:
            text = f.read().strip()
    except OSError:
        return None
    return None if text == "off" else int(text)


def _under(fd):
    try:
        return os.readlink("/proc/self/fd/{}".format(fd)).startswith(_DIR)
    except OSError:
        return False


def _check(fd, size):
    if not _DIR or not _under(fd):
        return
    budget = _budget()
    if budget is None:
        return
    _written[0] += size
    if _written[0] > budget:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def write(fd, data):
    _check(fd, len(data))
    return _real["write"](fd, data)


def fsync(fd):
    # Buffered files reach the disk through write(2) calls Python makes in C: the bytes they
    # hold are counted when they are made durable.
    try:
        size = os.fstat(fd).st_size
    except OSError:
        size = 0
    _check(fd, size)
    return _real["fsync"](fd)


os.write = write
os.fsync = fsync
'''


def _mount_tmpfs(path, size):
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False
    os.makedirs(path, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size={}".format(size), "tmpfs", path],
                          capture_output=True)
    return proc.returncode == 0


def _umount(path):
    subprocess.run(["umount", "-l", path], capture_output=True)


@pytest.mark.parametrize("how", ["tmpfs", "injected"])
def test_disk_fills_during_a_cache_write(fleet, digits_files, tmp_path, how):
    controller, make_agent = fleet
    cache_dir = str(tmp_path / "cache")
    extra = "cache:\n  dir: {}\n".format(cache_dir)
    budget_file = str(tmp_path / "enospc-budget")
    if how == "tmpfs":
        # 64 KiB, 60 KiB of it taken: the calibration cache (one page) fits, the engine
        # (~10 KiB for the digits MLP in int8) does not.
        if not _mount_tmpfs(cache_dir, "64k"):
            pytest.skip("this machine does not allow mounting a tmpfs (the injected variant "
                        "covers the same path)")
        os.makedirs(os.path.join(cache_dir, "filler"), exist_ok=True)
        with open(os.path.join(cache_dir, "filler", "data"), "wb") as f:
            f.write(b"\0" * 60 * 1024)
    else:
        inject = tmp_path / "inject"
        inject.mkdir()
        (inject / "sitecustomize.py").write_text(ENOSPC_SITECUSTOMIZE)
        with open(budget_file, "w") as f:
            f.write(str(8 * 1024))
        wrapper = tmp_path / "worker-python"
        wrapper.write_text("#!/bin/sh\nPYTHONPATH={}:$PYTHONPATH FAULT_ENOSPC_DIR={} "
                           "FAULT_ENOSPC_FILE={} exec {} \"$@\"\n".format(
                               inject, cache_dir, budget_file, sys.executable))
        wrapper.chmod(0o755)
        extra += "worker_python: {}\n".format(wrapper)
    agent = None
    try:
        agent = make_agent(extra_config=extra)
        submit(controller, deploy_doc(controller, digits_files, "full-" + how))
        fault("disk_full")
        msg = controller.wait_state("full-" + how, protocol.TERMINAL_STATES, 90)
        assert msg["state"] == "FAILED" and msg["error"]["code"] == "disk_full", (
            msg, agent.log_tail())
        assert corrupt_entries(agent.state_dir, cache_dir) == 0
        leftovers = [n for n in _walk(os.path.join(cache_dir, "engines"))
                     if os.path.basename(n).startswith(".tmp-")]
        assert not leftovers, leftovers  # no half-written file left behind
        # Space comes back: the same job under a new id succeeds.
        if how == "tmpfs":
            os.unlink(os.path.join(cache_dir, "filler", "data"))
            subprocess.run(["mount", "-o", "remount,size=64m", cache_dir], check=True)
        else:
            with open(budget_file, "w") as f:
                f.write("off")
        submit(controller, deploy_doc(controller, digits_files, "space-back-" + how))
        msg = controller.wait_state("space-back-" + how, protocol.TERMINAL_STATES, 90)
        assert msg["state"] == "SUCCEEDED", (msg, agent.log_tail())
        result = audit(agent, controller, ["full-" + how, "space-back-" + how], cache_dir)
        assert not result["lost"] and not result["corrupt"], result
        finish(agent)
    finally:
        if how == "tmpfs":
            if agent is not None:
                finish(agent)
            _umount(cache_dir)


def _walk(root):
    for dirpath, _, names in os.walk(root):
        for name in names:
            yield os.path.join(dirpath, name)
