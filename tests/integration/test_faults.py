"""The fault and abuse suite: a real Mosquitto, real daemons (signing required), real jobs on
the onnxruntime backend, and the faults a fleet meets.

- ``kill -9`` of the agent at random points of its jobs, KILLS (20) times in a row;
- the broker killed and restarted three times during one artifact transfer;
- a disk that fills during an engine-cache write: a small tmpfs where this machine allows
  mounting, and always a full-disk error (ENOSPC) injected at the write layer of the worker;
- thousands of fuzzed payloads on each topic the daemon subscribes to;
- tampered blocks (wrong content under an announced sha256, wrong lengths, bad indices);
- replayed, forged, mis-targeted, expired and unsigned jobs, and a job flood.

Each scenario adds to one report (``REPORT``): runs (daemon starts), faults injected (by
kind), jobs completed, data lost (job statuses that never reached the controller or differ
from the device's journal, status messages left in the outbox), corrupt cache entries (stored
artifacts whose bytes do not match their name, engine-cache entries that fail verification),
daemon crashes (a daemon that died on its own or did not stop cleanly) and unexpected errors
(tracebacks in its log). The last test prints it and asserts the zeros;
``scripts/benchmarks/reliability.py`` runs this module and turns the report into rows
(docs/reliability.md). JETSON_AGENT_FAULT_KILLS / _SEED / _FUZZ_PER_TOPIC scale it.
"""

import collections
import hashlib
import json
import os
import random
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest

from agent.device.daemon import journal_path
from agent.engines.cache import EngineCache
from agent.wire import job_signer, protocol
from tests.integration.fuzzing import WEIRD_VALUES, mutate_bytes, mutate_doc

KILLS = int(os.environ.get("JETSON_AGENT_FAULT_KILLS", "20"))
SEED = int(os.environ.get("JETSON_AGENT_FAULT_SEED", "7"))
FUZZ_PER_TOPIC = int(os.environ.get("JETSON_AGENT_FAULT_FUZZ_PER_TOPIC", "2000"))
GATE = {"atol": 0.5, "rtol": 0.5, "check_error_stat": "mean", "min_top1": 0.9}
SMALL_BLOCKS = "transfer:\n  block_size: 1024\n  window: 8\n  timeout_s: 2\n"

FAULTS = collections.Counter()
REPORT = collections.OrderedDict([
    ("runs", 0), ("faults_injected", 0), ("jobs_submitted", 0), ("jobs_completed", 0),
    ("jobs_failed_with_reason", 0), ("jobs_refused", 0), ("data_lost", 0),
    ("corrupt_cache_entries", 0), ("cache_entries_checked", 0), ("daemon_crashes", 0),
    ("unexpected_errors", 0), ("devices_out_of_service", 0)])


# ---------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("signing")
    trusted = job_signer.generate_keypair(str(d), "fleet")
    rogue = job_signer.generate_keypair(str(d), "rogue")
    return {"trusted": trusted, "rogue": rogue, "dir": str(d),
            "security": "  trusted_keys: [{}]\n".format(trusted["public_key"])}


@pytest.fixture
def signer(keys, tmp_path):
    return job_signer.Signer(keys["trusted"]["private_key"], str(tmp_path / "sequence.json"))


@pytest.fixture
def fleet(mosquitto, agent_factory, keys, signer):
    """(controller signing with the trusted key, make_agent(**kw) -> started agent)."""
    from tests.integration.conftest import Controller

    ctl = Controller(mosquitto, signer=signer)
    agents = []

    def make_agent(device="dev1", extra_config="", start=True):
        agent = agent_factory(device, extra_config=extra_config, security=keys["security"])
        agents.append(agent)
        if start:
            started(agent)
        return agent

    try:
        yield ctl, make_agent
    finally:
        for agent in agents:
            finish(agent)
        ctl.close()


def started(agent):
    agent.start()
    REPORT["runs"] += 1
    return agent


def finish(agent):
    """Stop an agent; a daemon that is gone already, or does not exit 0, crashed."""
    if getattr(agent, "_finished", False):
        return
    agent._finished = True
    if agent.proc is not None and agent.proc.poll() is not None and \
            agent.proc.returncode != -9:
        REPORT["daemon_crashes"] += 1
    else:
        try:
            code = agent.stop(timeout=30)
        except subprocess.TimeoutExpired:
            code = "hung"
        if code not in (0, None):
            REPORT["daemon_crashes"] += 1
    REPORT["unexpected_errors"] += read(agent.log).count("Traceback")


def read(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def fault(kind, n=1):
    FAULTS[kind] += n
    REPORT["faults_injected"] += n


def calib_file(directory, seed, rows=256):
    """A calibration set of digits rows of its own (its own sha256: every job downloads,
    calibrates and builds)."""
    from tests.models import load_digits_split

    x_train = load_digits_split(0)[0]
    pick = np.random.RandomState(seed).choice(len(x_train), rows, replace=False)
    path = os.path.join(str(directory), "calib-{}.npz".format(seed))
    np.savez(path, input=x_train[pick])
    return path


def deploy_doc(controller, files, job_id, calib=None, bench_iterations=50):
    files = dict(files)
    if calib is not None:
        files["calibration"] = calib
    files.pop("labels", None)
    return {"job_id": job_id, "kind": "deploy",
            "artifacts": {role: controller.add_artifact(path) for role, path in files.items()},
            "plan": {"precision": "int8",
                     "calibration": {"algorithm": "minmax", "batch_size": 64}},
            "gate": GATE, "bench": {"iterations": bench_iterations, "warmup": 2}}


def submit(controller, doc):
    return controller.send_job(doc)


def audit(agent, controller, job_ids, cache_dir=None):
    """Fold one agent's end state into the report: every job ended, its last status reached
    the controller, the outbox drained, the store and the cache are sound."""
    ids = list(job_ids)
    try:
        agent.wait_journal(lambda j: all(j.job(i) and protocol.is_terminal(j.job(i)["state"])
                                          for i in ids) and j.outbox_count() == 0, 90,
                     "every job to end and the outbox to drain")
    except AssertionError:
        pass  # counted below
    deadline = time.monotonic() + 15
    while True:
        with agent.journal() as journal:
            rows = {i: journal.job(i) for i in ids}
            pending = journal.outbox_count()
        lost = [i for i, row in rows.items() if row is None or not protocol.is_terminal(
            row["state"]) or not _status_arrived(controller, row)]
        if not lost or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    REPORT["data_lost"] += len(lost) + pending
    REPORT["jobs_submitted"] += len(ids)
    for row in rows.values():
        if row is None:
            continue
        if row["state"] == "SUCCEEDED":
            REPORT["jobs_completed"] += 1
        elif row["state"] in ("FAILED", "TIMED_OUT") and (row["error"] or {}).get("code"):
            REPORT["jobs_failed_with_reason"] += 1
        elif row["state"] == "REJECTED" and (row["error"] or {}).get("code"):
            REPORT["jobs_refused"] += 1
        elif protocol.is_terminal(row["state"]) and row["state"] != "CANCELED":
            REPORT["data_lost"] += 1  # ended without saying why
    checked = []
    corrupt = corrupt_entries(agent.state_dir, cache_dir, checked)
    REPORT["corrupt_cache_entries"] += corrupt
    REPORT["cache_entries_checked"] += checked[0]
    return {"lost": lost, "pending": pending, "corrupt": corrupt, "rows": rows,
            "checked": checked[0]}


def _status_arrived(controller, row):
    last = controller.last_status(row["job_id"])
    return last is not None and last["version"] == row["version"] and \
        last["state"] == row["state"]


def corrupt_entries(state_dir, cache_dir=None, checked=None):
    """Stored artifacts whose bytes do not match their name, plus engine-cache entries that
    fail verification. ``checked`` (a list) gets the number of entries looked at."""
    bad = seen = 0
    root = os.path.join(state_dir, "artifacts")
    for dirpath, _, names in os.walk(root):
        if os.path.basename(dirpath) == "partial":
            continue
        for name in names:
            seen += 1
            with open(os.path.join(dirpath, name), "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != name:
                    bad += 1
    engines = os.path.join(cache_dir or state_dir, "engines")  # config.Config.cache_dir
    if os.path.isdir(engines):
        report = EngineCache(engines).verify()
        bad += len(report["corrupt"])
        seen += report["checked"]
    if checked is not None:
        checked.append(seen)
    return bad


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


def _sent(controller):
    with controller.lock:
        return sum(controller.blocks_sent.values())


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


# ---------------------------------------------------------------------------- fuzz

# The shared odd values without the two the signed-job fuzz never drew, plus signature-shaped
# ones (the same list, in the same order, as before it was shared: a seed replays a run).
WEIRD = [v for v in WEIRD_VALUES if v not in (-1e308, {"a": {"b": {"c": []}}})] + [
    "ed25519", "AAAA=="]


def _mutate_bytes(rng, data):
    return mutate_bytes(rng, data, max_edits=6)


def _mutate_doc(rng, doc):
    return mutate_doc(rng, doc, weird=WEIRD, extra_keys=("extra", "signature", "kind", "seq"),
                      p_drop=0.08, p_replace=0.12, p_add=0.05)


def _payloads(rng, bases, n):
    specials = [b"", b"null", b"[]", b"{}", b"NaN", b'{"a":1,"a":2}', b"[" * 5000,
                b"\xff" * 64, b"x" * 40000, b'{"signature": {}}']
    for i in range(n):
        r = rng.random()
        if i < len(specials):
            yield specials[i]
        elif r < 0.02:
            yield protocol.encode(rng.choice(bases))
        elif r < 0.2:
            yield bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
        elif r < 0.5:
            yield _mutate_bytes(rng, protocol.encode(rng.choice(bases)))
        elif r < 0.9:
            yield json.dumps(_mutate_doc(rng, rng.choice(bases))).encode()
        else:
            yield json.dumps(rng.choice(WEIRD)).encode()


def _altered(rng, signed, job_id):
    """A schema-valid copy of a signed document with its signature kept and something the
    signature covers changed (a forgery only the signature check can catch)."""
    doc = json.loads(json.dumps(signed))
    doc["job_id"] = job_id
    change = rng.randrange(6)
    if change == 0:
        doc["plan"]["precision"] = rng.choice(["fp32", "fp16", "best"])
    elif change == 1:
        doc["artifacts"]["model"]["size"] = rng.randint(1, 1 << 30)
    elif change == 2:
        doc["gate"]["atol"] = rng.random()
    elif change == 3:
        doc["bench"] = {"iterations": rng.randint(1, 1000000)}
    elif change == 4:
        doc["signature"]["seq"] = rng.randint(1, 1 << 50)
    return doc  # change 5: only the job id (and the topic) differ


def test_fuzz_every_subscribed_topic(fleet, digits_files):
    controller, make_agent = fleet
    agent = make_agent()
    controller.wait_online()
    submit(controller, deploy_doc(controller, digits_files, "before-fuzz"))
    assert controller.wait_state("before-fuzz", protocol.TERMINAL_STATES, 90)["state"] == \
        "SUCCEEDED"
    with agent.journal() as journal:
        before = journal.job("before-fuzz")
    rng = random.Random(SEED)
    t = controller.topics
    # A correctly signed document (which may run: it is genuine) and its unsigned twin.
    signed = controller.signer.sign(dict(deploy_doc(controller, digits_files, "fz-signed"),
                                         protocol=1, device="dev1"))
    unsigned = dict(signed)
    unsigned.pop("signature")
    command = {"protocol": 1, "command": "cancel", "request_id": "r1", "job_id": "before-fuzz"}
    shas = [a["sha256"] for a in signed["artifacts"].values()] + ["f" * 64]
    handles, job_ids = [], set()
    for topic_kind in ("job", "block", "command"):
        bases = [signed, unsigned] if topic_kind != "command" else [command, {"command": "diag"}]
        for i, payload in enumerate(_payloads(rng, bases, FUZZ_PER_TOPIC)):
            if topic_kind == "job":
                job_id = rng.choice(["fz-signed", "before-fuzz", "fz-{}".format(i),
                                     "fz-{}".format(i % 40)])
                job_ids.add(job_id)
                topic = t.job("dev1", job_id)
                if rng.random() < 0.25:
                    payload = protocol.encode(_altered(rng, signed, job_id))
            elif topic_kind == "block":
                topic = t.block("dev1", rng.choice(shas), rng.choice([0, 1, 2, 9999, 1048575]))
            else:
                topic = t.commands("dev1")
            handles.append(controller.send_raw(topic, payload, qos=rng.choice([0, 1])))
        fault("fuzzed_payload_" + topic_kind, FUZZ_PER_TOPIC)
    for h in handles:
        h.wait(60)
    diag = controller.diag(timeout=120)
    assert diag["ok"] and agent.alive(), agent.log_tail()
    with agent.journal() as journal:
        rows = [journal.job(j) for j in sorted(job_ids - {"before-fuzz"})]
        after = journal.job("before-fuzz")
    ran = sorted(r["job_id"] for r in rows if r is not None and r["state"] != "REJECTED")
    assert set(ran) <= {"fz-signed"}, ran  # nothing but the genuine document ran
    codes = collections.Counter((r["error"] or {}).get("code") for r in rows
                                if r is not None and r["state"] == "REJECTED")
    ignored = diag["result"]["counters"]["unauthenticated_jobs"]
    print("\nfuzz: {} payloads; job documents ignored as unauthenticated: {}; recorded "
          "REJECTED: {}".format(3 * FUZZ_PER_TOPIC, ignored, dict(codes)))
    # Signing is required: no fuzzed document proves a trusted origin, so none claims a job
    # id or leaves a journal row; each is counted instead.
    assert not codes, codes
    assert ignored >= FUZZ_PER_TOPIC // 4, ignored  # the rest named a known job id
    assert (after["state"], after["version"], after["result"]) == \
        (before["state"], before["version"], before["result"])
    submit(controller, deploy_doc(controller, digits_files, "after-fuzz"))
    assert controller.wait_state("after-fuzz", protocol.TERMINAL_STATES, 90)["state"] == \
        "SUCCEEDED", agent.log_tail()
    db = sqlite3.connect(journal_path(agent.state_dir))
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()
    result = audit(agent, controller, ["before-fuzz", "after-fuzz"] + ran)
    assert not result["lost"] and not result["corrupt"], result


# ---------------------------------------------------------------------------- tampered blocks

def test_tampered_blocks(fleet, digits_files, tmp_path):
    controller, make_agent = fleet
    agent = make_agent(extra_config=SMALL_BLOCKS)
    calib = calib_file(tmp_path, 2000)
    tampered = tmp_path / "tampered.npz"
    data = bytearray(open(calib, "rb").read())
    for i in range(0, len(data), 997):
        data[i] ^= 0xFF  # same length, other bytes
    tampered.write_bytes(bytes(data))
    doc = deploy_doc(controller, digits_files, "tampered", calib=calib)
    real = doc["artifacts"]["calibration"]
    controller.server.add_file(str(tampered), sha256=real["sha256"])  # served under its sha
    submit(controller, doc)
    fault("tampered_artifact")
    msg = controller.wait_state("tampered", protocol.TERMINAL_STATES, 60)
    assert msg["state"] == "FAILED" and msg["error"]["code"] == "hash_mismatch", msg
    sha = real["sha256"]
    assert not os.path.exists(os.path.join(agent.state_dir, "artifacts", sha[:2], sha))
    assert not os.path.exists(os.path.join(agent.state_dir, "artifacts", "partial",
                                           sha + ".part"))
    # The honest file again, and junk blocks thrown at the transfer while it runs.
    controller.served_limit = _sent(controller) + 20
    submit(controller, deploy_doc(controller, digits_files, "honest", calib=calib))
    controller.wait_for(lambda: not controller.serve, 30, "the transfer to start")
    t = controller.topics
    junk = 0
    for i in range(60):
        for topic, payload in ((t.block("dev1", sha, i), b"short"),  # wrong length
                               (t.block("dev1", sha, 10 ** 6), b"\0" * 1024),  # no such block
                               (t.block("dev1", "e" * 64, i), b"\0" * 1024),  # not fetched
                               (t.block("dev1", sha, i), b"\0" * 4096)):  # too long
            controller.send_raw(topic, payload)
            junk += 1
    fault("junk_block", junk)
    controller.served_limit = None
    controller.serve = True
    msg = controller.wait_state("honest", protocol.TERMINAL_STATES, 90)
    assert msg["state"] == "SUCCEEDED", (msg, agent.log_tail())
    result = audit(agent, controller, ["tampered", "honest"])
    assert not result["lost"] and not result["corrupt"], result


# ---------------------------------------------------------------------------- forged jobs

def _forged(controller, keys, signer, job_id, device="dev1", seq=None, key="trusted",
            not_before=None, expires=None, tamper=None, kind="bench"):
    model = controller.add_artifact(MODEL[0])
    doc = {"protocol": 1, "job_id": job_id, "kind": kind, "device": device,
           "artifacts": {"model": model}, "plan": {"precision": "fp32"},
           "bench": {"iterations": 5, "warmup": 0}}
    now = time.time()
    private = job_signer.load_private_key(keys[key]["private_key"])
    if seq is None:
        seq = signer.sequence.next(signer.key_id, int(now * 1000))
    doc = job_signer.sign_document(doc, private, seq, now - 5 if not_before is None else not_before,
                                   now + 600 if expires is None else expires)
    if tamper:
        tamper(doc)
    return doc


MODEL = []  # the model file the forged jobs reference


def _send_raw_job(controller, doc, device="dev1", job_id=None):
    h = controller.send_raw(controller.topics.job(device, job_id or doc["job_id"]),
                            protocol.encode(doc), retain=True)
    assert h.wait(10)


def test_replayed_forged_and_mistargeted_jobs(fleet, keys, signer, digits_files):
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent()
    controller.wait_online()
    # Signed early, delivered late: its sequence is below the next one's.
    early = _forged(controller, keys, signer, "signed-early")
    good = _forged(controller, keys, signer, "good")
    _send_raw_job(controller, good)
    assert controller.wait_state("good", protocol.TERMINAL_STATES, 60)["state"] == "SUCCEEDED"
    version = controller.last_status("good")["version"]
    # A code: a signed document for this device and job id, REJECTED with it. None: one
    # that proves no trusted origin for this device and job id, ignored (no journal row, no
    # status: it must not claim the id before the genuine document comes), and counted.
    cases = {
        "signed-early": (early, "job_replayed"),
        "unsigned": (dict(good, job_id="unsigned", signature=None), None),
        "rogue-key": (_forged(controller, keys, signer, "rogue-key", key="rogue"), None),
        "tampered-plan": (_forged(controller, keys, signer, "tampered-plan", tamper=lambda d:
                                  d["plan"].update(precision="int8")), None),
        "tampered-sha": (_forged(controller, keys, signer, "tampered-sha", tamper=lambda d:
                                 d["artifacts"]["model"].update(sha256="ee" * 32)), None),
        "moved-signature": (dict(_forged(controller, keys, signer, "moved-signature"),
                                 signature=good["signature"]), None),
        "expired": (_forged(controller, keys, signer, "expired", not_before=time.time() - 7200,
                            expires=time.time() - 3600), "job_expired"),
        "not-yet": (_forged(controller, keys, signer, "not-yet", not_before=time.time() + 3600,
                            expires=time.time() + 7200), "job_not_yet_valid"),
        "for-dev2": (_forged(controller, keys, signer, "for-dev2", device="dev2"), None),
    }
    recorded = [j for j, (_, code) in cases.items() if code]
    ignored = [j for j, (_, code) in cases.items() if not code]
    for job_id, (doc, _) in cases.items():
        if doc.get("signature") is None:
            doc.pop("signature", None)
        _send_raw_job(controller, doc, job_id=job_id)
    fault("forged_job", len(cases) - 1)
    fault("replayed_job")
    # The genuine document again, as it is (a replay of a job the device ran): ignored.
    _send_raw_job(controller, good)
    fault("replayed_job")
    for job_id in recorded:
        msg = controller.wait_state(job_id, protocol.TERMINAL_STATES, 30)
        assert msg["state"] == "REJECTED" and msg["error"]["code"] == cases[job_id][1], (
            job_id, msg)
    counters = controller.diag()["result"]["counters"]
    assert counters["unauthenticated_jobs"] == len(ignored), counters
    time.sleep(0.5)
    assert controller.last_status("good")["version"] == version
    assert all(controller.last_status(j) is None for j in ignored)
    with agent.journal() as journal:
        assert all(journal.job(j) is None for j in ignored)
    # The last accepted sequence survives a restart: an old document is still a replay.
    agent.kill()
    fault("agent_kill_9")
    started(agent)
    controller.wait_online()
    stale = _forged(controller, keys, signer, "stale", seq=good["signature"]["seq"] - 1)
    _send_raw_job(controller, stale)
    fault("replayed_job")
    msg = controller.wait_state("stale", protocol.TERMINAL_STATES, 30)
    assert msg["state"] == "REJECTED" and msg["error"]["code"] == "job_replayed", msg
    fresh = _forged(controller, keys, signer, "fresh")
    _send_raw_job(controller, fresh)
    assert controller.wait_state("fresh", protocol.TERMINAL_STATES, 60)["state"] == "SUCCEEDED"
    with agent.journal() as journal:
        refused = [journal.job(j) for j in recorded + ["stale"]]
        assert all(journal.job(j) is None for j in ignored)
    assert all(r["attempts"] == 0 for r in refused)  # none of them ever ran
    result = audit(agent, controller, ["good", "fresh", "stale"] + recorded)
    assert not result["lost"] and not result["corrupt"], result


def test_a_job_flood_is_rate_limited(fleet, keys, signer, digits_files):
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent(extra_config="limits:\n  jobs_per_minute: 6\n  job_burst: 3\n")
    controller.wait_online()
    ids = ["flood-{}".format(i) for i in range(8)]
    for job_id in ids:
        _send_raw_job(controller, _forged(controller, keys, signer, job_id, kind="bench"))
    fault("job_flood", len(ids))
    finals = {j: controller.wait_state(j, protocol.TERMINAL_STATES, 90) for j in ids}
    limited = [j for j, m in finals.items() if (m.get("error") or {}).get("code") ==
               "rate_limited"]
    ran = [j for j, m in finals.items() if m["state"] == "SUCCEEDED"]
    assert len(ran) == 3 and len(limited) == 5, finals
    assert all(finals[j]["state"] == "REJECTED" for j in limited)
    assert "retry" in finals[limited[0]]["error"]["message"]
    result = audit(agent, controller, ids)
    assert not result["lost"] and not result["corrupt"], result


# ---------------------------------------------------------------------------- attacks

# What an attacker did to a daemon with signed jobs on a real broker (the hardening issue),
# one class per test; after each the daemon must complete a genuine job within 30 s.
AFTER_ATTACK_S = 30

WORKER_FAULTS = """#!{python}
# Fault injection: the worker of a job whose id starts with a key below prints the error
# given (as the real worker prints its errors) and exits 2; other jobs run the real worker.
import json, os, sys

NAMES = ["output_{{}}".format(i) for i in range(30000)]
ERRORS = {{
    "huge-name": {{"code": "bad_golden_file", "message": "golden output {{!r}} is not an output of "
                  "the model".format("o" * (2 << 20))}},
    "gate-30000": {{"code": "accuracy_gate_failed", "message": "the engine fails the accuracy "
                   "gate: output(s) {{}} outside atol/rtol".format(NAMES),
                   "details": {{"accuracy": {{"passed": False, "failed_outputs": NAMES}}}}}},
    "big-status": {{"code": "bad_golden_file", "message": "x" * 20000}},
}}
if "--job" not in sys.argv:  # the daemon's start-up probe of the backend: the real Python
    os.execv(sys.executable, [sys.executable] + sys.argv[1:])
spec = sys.argv[sys.argv.index("--job") + 1]
job_id = os.path.basename(os.path.dirname(spec))
for key, error in ERRORS.items():
    if job_id.startswith(key):
        sys.stdout.write(json.dumps({{"type": "error", "error": error}}) + "\\n")
        sys.exit(2)
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


def worker_faults(tmp_path):
    path = tmp_path / "worker-faults"
    path.write_text(WORKER_FAULTS.format(python=sys.executable))
    path.chmod(0o755)
    return "worker_python: {}\n".format(path)


def genuine_job(controller, keys, signer, job_id, agent):
    """A signed bench job sent after an attack: it must succeed within AFTER_ATTACK_S."""
    _send_raw_job(controller, _forged(controller, keys, signer, job_id))
    try:
        msg = controller.wait_state(job_id, protocol.TERMINAL_STATES, AFTER_ATTACK_S)
    except AssertionError:
        msg = {"state": "no answer"}
    if msg["state"] != "SUCCEEDED":
        REPORT["devices_out_of_service"] += 1
    assert msg["state"] == "SUCCEEDED", (msg, agent.log_tail())


def shipped_max_packet_size():
    from tests.integration.pki import FLEET_CONF

    with open(FLEET_CONF) as f:
        for line in f:
            if line.startswith("max_packet_size "):
                return int(line.split()[1])
    raise AssertionError("the shipped Mosquitto config sets no max_packet_size")


def limit_packets(broker, limit):
    """Restart the test broker with a max_packet_size (larger packets: it disconnects the
    sender)."""
    broker.stop()
    with open(broker.config, "a") as f:
        f.write("max_packet_size {}\n".format(limit))
    broker.start()


@pytest.fixture
def shipped_limit(mosquitto):
    limit = shipped_max_packet_size()
    limit_packets(mosquitto, limit)
    return limit


def disconnects(agent):
    return read(agent.log).count("disconnected from ")


def test_oversized_statuses_never_reach_the_broker(shipped_limit, fleet, keys, signer,
                                                   digits_files, tmp_path):
    """A worker error naming a 2 MB output and a gate failure listing 30,000 outputs become
    statuses under the per-topic limit (texts cut with a marker, lists summarised): the
    device keeps its connection and takes the next job."""
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent(extra_config=worker_faults(tmp_path))
    controller.wait_online()
    assert 2 << 20 > shipped_limit
    for job_id in ("huge-name", "gate-30000"):
        _send_raw_job(controller, _forged(controller, keys, signer, job_id))
        msg = controller.wait_state(job_id, protocol.TERMINAL_STATES, AFTER_ATTACK_S)
        assert msg["state"] in ("FAILED", "REJECTED"), (msg, agent.log_tail())
        assert msg["error"]["code"] in ("bad_golden_file", "accuracy_gate_failed")
        assert len(protocol.encode(msg)) <= protocol.MAX_BYTES["job_status"]
    assert "more characters cut]" in controller.last_status("huge-name")["error"]["message"]
    gate = controller.last_status("gate-30000")["error"]
    assert "more characters cut]" in gate["message"]
    failed = gate["details"]["accuracy"]["failed_outputs"]  # summarised, the count kept
    assert failed[-1].endswith("more items]") and len(failed) < 1000, failed[-3:]
    fault("oversized_status", 2)
    genuine_job(controller, keys, signer, "after-oversized", agent)
    assert disconnects(agent) == 0, agent.log_tail()
    result = audit(agent, controller, ["huge-name", "gate-30000", "after-oversized"])
    assert not result["lost"] and not result["pending"], result


def test_a_status_the_broker_keeps_refusing_goes_out_short(mosquitto, agent_factory, keys,
                                                           signer, digits_files, tmp_path):
    """A broker whose max_packet_size is below a (valid, 20 KB) status and that advertises
    none (MQTT 3.1.1): it drops the connection on every try; after a bounded number of tries
    the outbox sends the status's short form, and the device works on."""
    from tests.integration.conftest import Controller

    limit_packets(mosquitto, 8000)
    controller = Controller(mosquitto, signer=signer)
    agent = agent_factory("dev1", extra_config=SMALL_BLOCKS + worker_faults(tmp_path),
                          security=keys["security"], broker_extra="  protocol: v3.1.1\n")
    try:
        started(agent)
        MODEL[:] = [digits_files["model"]]
        controller.wait_online()
        _send_raw_job(controller, _forged(controller, keys, signer, "big-status"))
        msg = controller.wait_state("big-status", protocol.TERMINAL_STATES, AFTER_ATTACK_S)
        assert msg["state"] == "REJECTED" and msg["error"]["code"] == "bad_golden_file", msg
        assert msg["statusDetails"].get("truncated") == "true", msg  # the short form
        tries = disconnects(agent)
        assert 1 <= tries <= 10, agent.log_tail()
        fault("refused_status", tries)
        genuine_job(controller, keys, signer, "after-refused", agent)
        result = audit(agent, controller, ["big-status", "after-refused"])
        assert not result["lost"] and not result["pending"], result
    finally:
        finish(agent)
        controller.close()


def _status_json(agent):
    proc = subprocess.run([sys.executable, "-m", "agent", "status", "--state-dir",
                           agent.state_dir, "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_unserved_artifacts_leave_no_partials(fleet, keys, signer, digits_files):
    """Jobs naming large artifacts nobody serves, one killed -9 mid-download: their
    pre-allocated partials count against the store budget, show in ``status``, and are
    reclaimed when the jobs end, so the next job does not fail disk_full."""
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    budget = 4 << 20
    agent = make_agent(extra_config="limits:\n  max_store_bytes: {}\n".format(budget))
    controller.wait_online()
    ids = []
    for i, size in enumerate((budget - 4096, budget // 2)):
        job_id = "unserved-{}".format(i)
        ids.append(job_id)
        doc = {k: v for k, v in _forged(controller, keys, signer, job_id).items()
               if k != "signature"}
        doc["artifacts"] = {"model": {"sha256": "{:02x}".format(i + 1) * 32, "size": size,
                                      "name": "unserved.onnx"}}
        doc["timeout_s"] = 4
        _send_raw_job(controller, controller.signer.sign(doc))
        controller.wait_stage(job_id, ["downloading"], 30)
        partial = [p for p in _status_json(agent)["transfers"] if p["size"] == size]
        assert partial and partial[0]["referenced"], _status_json(agent)
        if i == 0:
            agent.kill()  # restarts included: the unfinished job resumes, then times out
            fault("agent_kill_9")
            started(agent)
        msg = controller.wait_state(job_id, protocol.TERMINAL_STATES, 30)
        assert msg["state"] == "TIMED_OUT", msg
    fault("unserved_artifact", len(ids))
    assert _status_json(agent)["transfers"] == []
    assert os.listdir(os.path.join(agent.state_dir, "artifacts", "partial")) == []
    genuine_job(controller, keys, signer, "after-unserved", agent)
    result = audit(agent, controller, ids + ["after-unserved"])
    assert not result["lost"] and not result["corrupt"], result


def test_a_client_id_takeover_is_surfaced(fleet, mosquitto, keys, signer, digits_files):
    """On a broker that does not bind client ids to identities (the shipped one does:
    test_acl), a client connecting with the device's id knocks it off: the daemon says so in
    its log and in ``status``, reconnects, and works on once the intruder is gone."""
    import queue

    from agent.wire.mqtt import DISCONNECTED, MqttClient

    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent()
    controller.wait_online()
    intruder = MqttClient("dev1", mosquitto.host, mosquitto.port, clean_start=False,
                          reconnect_min=0.5, reconnect_max=0.5, events=queue.Queue())
    intruder.start()
    try:
        agent.wait_journal(lambda j: (j.note("connection") or {}).get("taken_over"), 20,
                           "the takeover to be recorded")
    finally:
        intruder.stop()
    kicked = 0
    while not intruder.events.empty():
        kicked += intruder.events.get_nowait().kind == DISCONNECTED
    fault("session_takeover", 1 + kicked)
    assert "session_taken_over" in read(agent.log)
    status = _status_json(agent)["connection"]
    assert status["taken_over"] >= 1 and status["client_id"] == "dev1", status
    genuine_job(controller, keys, signer, "after-takeover", agent)
    audit(agent, controller, ["after-takeover"])


def test_anonymous_job_documents_claim_nothing(fleet, keys, signer, digits_files):
    """One byte on the job id the controller is about to use, then 3,000 garbage documents:
    none claims a job id, leaves a journal row or a retained status, or costs a disk write;
    the genuine documents run."""
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent()
    controller.wait_online()
    t = controller.topics
    assert controller.send_raw(t.job("dev1", "about-to-use"), b"x", retain=True).wait(10)
    fault("anonymous_job_claim")
    genuine_job(controller, keys, signer, "about-to-use", agent)
    rng = random.Random(SEED)
    unsigned = {k: v for k, v in _forged(controller, keys, signer, "u").items()
                if k != "signature"}
    started_at = time.monotonic()
    handles = []
    for i in range(3000):
        job_id = "garbage-{}".format(i)
        payload = rng.choice([b"x", b"{}", bytes(rng.getrandbits(8) for _ in range(64)),
                              protocol.encode(dict(unsigned, job_id=job_id))])
        handles.append(controller.send_raw(t.job("dev1", job_id), payload, retain=True))
    for h in handles:
        assert h.wait(60)
    counters = controller.diag(timeout=60)["result"]["counters"]
    print("\n3,000 garbage job documents handled in {:.1f} s".format(
        time.monotonic() - started_at))
    fault("garbage_job_document", 3000)
    assert counters["unauthenticated_jobs"] >= 3001, counters
    genuine_job(controller, keys, signer, "after-garbage", agent)
    with agent.journal() as journal:
        assert [r["job_id"] for r in journal.jobs()] == ["about-to-use", "after-garbage"]
    assert not [j for j in controller.job_status if j.startswith("garbage-")]
    audit(agent, controller, ["about-to-use", "after-garbage"])


def _rss_kb(pid):
    with open("/proc/{}/status".format(pid)) as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_junk_block_floods_and_stray_reply_topics(fleet, keys, signer, digits_files):
    """200 junk blocks of 512 KiB (100 MiB): the event queue is bounded by bytes, so the
    daemon's memory stays bounded and comes back down; a command's reply_to naming a job
    status is answered on the controller's reply topic instead; statuses name no absolute
    path of the device."""
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent()
    controller.wait_online()
    t = controller.topics
    before = _rss_kb(agent.proc.pid)
    junk = b"\0" * (512 << 10)
    handles = [controller.send_raw(t.block("dev1", "{:064x}".format(i), 0), junk)
               for i in range(200)]
    peak = before
    for h in handles:
        h.wait(60)
        peak = max(peak, _rss_kb(agent.proc.pid))
    fault("junk_block", len(handles))
    controller.diag(timeout=60)
    after = _rss_kb(agent.proc.pid)
    print("\ndaemon RSS: {} MB before, {} MB peak, {} MB after 100 MiB of junk blocks".format(
        before // 1024, peak // 1024, after // 1024))
    assert peak - before < 80 << 10 and after - before < 48 << 10, (before, peak, after)
    controller.command({"command": "diag", "request_id": "stray",
                        "reply_to": t.job_status("dev1", "forged-status")})
    fault("stray_reply_topic")
    controller.wait_for(lambda: any(r.get("request_id") == "stray" for r in controller.replies),
                        20, "the diag reply on the reply topic")
    assert "forged-status" not in controller.job_status
    genuine_job(controller, keys, signer, "after-junk", agent)
    for messages in controller.job_status.values():
        assert all(agent.state_dir not in json.dumps(m) for m in messages)
    audit(agent, controller, ["after-junk"])


# ---------------------------------------------------------------------------- the report

def test_report():
    """Runs last (pytest keeps the file's order): prints the figures and asserts the zeros."""
    report = dict(REPORT)
    report["faults_by_kind"] = dict(sorted(FAULTS.items()))
    text = json.dumps(report, indent=2)
    print("\nfault suite report:\n" + text)
    out = os.environ.get("JETSON_AGENT_FAULT_REPORT")
    if out:
        with open(out, "w") as f:
            f.write(text)
    if not REPORT["runs"]:
        pytest.skip("no scenario ran")
    assert REPORT["data_lost"] == 0
    assert REPORT["corrupt_cache_entries"] == 0
    assert REPORT["daemon_crashes"] == 0
    assert REPORT["unexpected_errors"] == 0
    assert REPORT["devices_out_of_service"] == 0
