"""The fault and abuse suite's figures (docs/reliability.md).

Runs tests/integration/faults/ (real Mosquitto, real daemons with signing required, the
onnxruntime backend): kill -9 of the agent at random points of its jobs, broker restarts
during a transfer, a disk that fills during a cache write, fuzzed payloads on every subscribed
topic, tampered blocks, replayed / forged / mis-targeted / expired jobs, a job flood. The
suite writes its report as JSON; each figure becomes a row. There is no baseline: the goal of
the loss, corruption and crash rows is 0.

Scale it with JETSON_AGENT_FAULT_KILLS (default 20), JETSON_AGENT_FAULT_FUZZ_PER_TOPIC (2000)
and JETSON_AGENT_FAULT_SEED (7).
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GOALS = {
    "runs": ("daemon starts", "-"),
    "faults_injected": ("faults injected (all kinds)", "-"),
    "jobs_submitted": ("jobs submitted", "-"),
    "jobs_completed": ("jobs completed (SUCCEEDED)", "-"),
    "jobs_failed_with_reason": ("jobs FAILED with a reason", "-"),
    "jobs_refused": ("jobs REJECTED with a reason", "-"),
    "data_lost": ("data lost (statuses, outbox)", "0"),
    "corrupt_cache_entries": ("corrupt store/cache entries", "0"),
    "cache_entries_checked": ("store/cache entries verified", "-"),
    "daemon_crashes": ("daemon crashes", "0"),
    "unexpected_errors": ("unexpected errors (tracebacks)", "0"),
    "devices_out_of_service": ("devices out of service (no genuine job within 30 s of an "
                               "attack)", "0"),
}


def run():
    fd, report_path = tempfile.mkstemp(prefix="fault-report-", suffix=".json")
    os.close(fd)
    env = dict(os.environ, JETSON_AGENT_FAULT_REPORT=report_path,
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             os.path.join(ROOT, "tests", "integration", "faults")],
            cwd=ROOT, env=env, capture_output=True, text=True)
        with open(report_path) as f:
            text = f.read()
        if not text:
            raise RuntimeError("the fault suite wrote no report:\n" + proc.stdout[-3000:])
        report = json.loads(text)
    finally:
        os.unlink(report_path)
    rows = []
    for key, (name, goal) in GOALS.items():
        rows.append({"name": name, "ours": report.get(key), "baseline": None,
                     "unit": "count", "goal": goal})
    for kind, count in sorted(report.get("faults_by_kind", {}).items()):
        rows.append({"name": "  fault: " + kind.replace("_", " "), "ours": count,
                     "baseline": None, "unit": "count", "goal": "-"})
    rows.append({"name": "suite result", "ours": "passed" if proc.returncode == 0 else
                 "FAILED (exit {})".format(proc.returncode), "baseline": None, "unit": "",
                 "goal": "passed"})
    return rows


if __name__ == "__main__":
    for row in run():
        print("{:40} {:>10} {}".format(row["name"], str(row["ours"]), row["goal"]))
