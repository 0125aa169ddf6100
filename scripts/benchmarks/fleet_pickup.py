"""Rollout pickup: the seconds from a rollout's row being committed (``fleet rollout --submit
--detach``, the row's ``created``) until its job document reaches the device, with
``fleet serve`` (SQLite) already running and idle, one simulated device
(scripts/simulate_devices.py) on a local Mosquitto. REPEAT rollouts (default 20), one after
the other (each waits for the previous to succeed); the median and the worst.

    python scripts/lib/bench.py fleet_pickup        (FLEET_PICKUP_REPEAT=5)
"""

import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (ROOT, os.path.join(ROOT, "scripts"), HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import fleet_scale as fs  # noqa: E402
from simulate_devices import SimulatedFleet  # noqa: E402

REPEAT = int(os.environ.get("FLEET_PICKUP_REPEAT", "20"))
TIMEOUT = int(os.environ.get("FLEET_PICKUP_TIMEOUT", "120"))


def measure(repeat=REPEAT):
    """Pickup seconds of ``repeat`` rollouts, in order."""
    import shutil

    work = tempfile.mkdtemp(prefix="fleet-pickup-")
    mosq, port = fs.broker(work)
    db_path = os.path.join(work, "fleet.db")
    db = "sqlite:///" + db_path
    fleet = SimulatedFleet("127.0.0.1", port, 1, name="sim")
    serve = None
    out = []
    try:
        fleet.start()
        serve = subprocess.Popen([sys.executable, "-m", "agent", "fleet", "serve", "--broker",
                                  "mqtt://127.0.0.1:{}".format(port), "--db", db, "--admission",
                                  "open"],
                                 env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT,
                                 stdout=subprocess.DEVNULL,
                                 stderr=open(os.path.join(work, "serve.log"), "w"))
        deadline = time.monotonic() + TIMEOUT
        while fs.count(db_path, "SELECT COUNT(*) FROM devices") < 1:
            assert time.monotonic() < deadline and serve.poll() is None, open(
                os.path.join(work, "serve.log")).read()[-2000:]
            time.sleep(0.2)
        what = ["--model", os.path.join(fs.FP16, "model.onnx"), "--inputs",
                os.path.join(fs.FP16, "inputs.json"), "--golden",
                os.path.join(fs.FP16, "golden.json"), "--precision", "fp16"]
        for i in range(repeat):
            rid = "pickup-{}".format(i)
            out_cli = fs.cli(["rollout"] + what + ["--match", "sim-*", "--rollout-id", rid,
                                                   "--submit", "--detach"], db)
            assert out_cli.returncode == 0, out_cli.stderr
            deadline = time.monotonic() + TIMEOUT
            while len(fleet.jobs.get("sim-00000", [])) < i + 1:
                assert time.monotonic() < deadline and serve.poll() is None, rid
                time.sleep(0.01)
            got = fleet.last_doc
            created = fs.count(db_path, "SELECT created FROM rollouts WHERE rollout_id = "
                                        "'{}'".format(rid))
            out.append(got - created)
            while fs.count(db_path, "SELECT COUNT(*) FROM rollouts WHERE rollout_id = '{}' "
                                    "AND state NOT IN ('running', 'paused')".format(rid)) < 1:
                assert time.monotonic() < deadline and serve.poll() is None, rid + " end"
                time.sleep(0.05)
        return out
    finally:
        fleet.stop()
        if serve is not None and serve.poll() is None:
            serve.terminate()
            serve.wait(30)
        mosq.terminate()
        mosq.wait(10)
        if not os.environ.get("FLEET_PICKUP_KEEP"):
            shutil.rmtree(work, ignore_errors=True)


def run():
    values = sorted(measure())
    return [{"name": "rollout pickup ({} of {})".format(stat, len(values)), "ours": value,
             "unit": "s", "goal": "<= 0.5 s"}
            for stat, value in (("median", values[len(values) // 2]), ("worst", values[-1]))]


if __name__ == "__main__":
    for row in run():
        print("{name}: {ours:.3f} {unit} (goal {goal})".format(**row))
