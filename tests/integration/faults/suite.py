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
(tracebacks in its log). ``test_faults_report.py``, whose name sorts last in this directory,
prints it and asserts the zeros; ``scripts/benchmarks/reliability.py`` runs this directory and
turns the report into rows (docs/reliability.md). JETSON_AGENT_FAULT_KILLS / _SEED /
_FUZZ_PER_TOPIC scale it.

This module holds what the scenario files share: the report, the helpers that start, stop and
audit daemons, the job documents, and the forged-job helper; ``conftest.py`` the fixtures.
"""

import collections
import hashlib
import os
import subprocess
import time

import numpy as np

from agent.engines.cache import EngineCache
from agent.wire import job_signer, protocol

KILLS = int(os.environ.get("JETSON_AGENT_FAULT_KILLS", "20"))
SEED = int(os.environ.get("JETSON_AGENT_FAULT_SEED", "7"))
FUZZ_PER_TOPIC = int(os.environ.get("JETSON_AGENT_FAULT_FUZZ_PER_TOPIC", "2000"))
GATE = {"atol": 0.5, "rtol": 0.5, "check_error_stat": "mean", "min_top1": 0.9}
SMALL_BLOCKS = "transfer:\n  block_size: 1024\n  window: 8\n  timeout_s: 2\n"

FAULTS = collections.Counter()
# What the suite asserts is 0 (after each scenario file, and in the report).
MUST_BE_ZERO = ("data_lost", "corrupt_cache_entries", "daemon_crashes", "unexpected_errors",
                "devices_out_of_service")
REPORT = collections.OrderedDict([
    ("runs", 0), ("faults_injected", 0), ("jobs_submitted", 0), ("jobs_completed", 0),
    ("jobs_failed_with_reason", 0), ("jobs_refused", 0), ("data_lost", 0),
    ("corrupt_cache_entries", 0), ("cache_entries_checked", 0), ("daemon_crashes", 0),
    ("unexpected_errors", 0), ("devices_out_of_service", 0)])


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


def _sent(controller):
    with controller.lock:
        return sum(controller.blocks_sent.values())


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
