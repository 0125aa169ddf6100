"""Live inputs: what donating costs the app, and what the live check costs the device.

- ``client.donate`` as the app calls it (queued for the sender thread, never waiting) against
  the same donation sent and answered (``wait=True``: the socket, the checks against the
  model's inputs, the atomic write), for one sample and a batch of 64 digits rows, through a
  real ``AppSocket`` and ``SampleStore``.
- The live check before commit in its child process (``python -m agent.worker.live``) on 256
  donated rows of the examples' digits classifier (v2 against v3, its classes rotated): wall
  time and the child's peak RSS, beside the daemon's own RSS (which the check leaves alone).
"""

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)

import numpy as np  # noqa: E402

CALLS = 200
EXAMPLES = os.path.join(ROOT, "examples")


def _times(fn):
    out = []
    for _ in range(CALLS):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000.0)
    out.sort()
    return {"p50": out[len(out) // 2], "p99": out[int(len(out) * 0.99) - 1], "max": out[-1]}


def donations(folder):
    from agent import client
    from agent.device.app.server import AppSocket
    from agent.device.models.live_samples import SampleStore

    models = os.path.join(folder, "models")
    os.makedirs(os.path.join(models, "digits", "v1"))
    with open(os.path.join(models, "digits", "v1", "meta.json"), "w") as f:
        json.dump({"inputs": [{"name": "input", "shape": ["N", 64], "dtype": "float32"}]}, f)
    os.symlink("v1", os.path.join(models, "digits", "current"))
    store = SampleStore(os.path.join(folder, "samples"))
    x = np.random.RandomState(0).rand(64, 64).astype(np.float32)
    out = {}
    with AppSocket(os.path.join(folder, "app.sock"), [], [], lambda r, p: {"ok": True},
                   rate_per_s=1e6, burst=1e6,
                   donate=lambda name, data: store.donate(models, name, data)) as sock:
        for label, rows in (("1 sample", x[0]), ("64 rows", x)):
            feeds = {"input": rows}
            queued = _times(lambda: client.donate("digits", feeds,  # noqa: B023 - used at once
                                                  socket_path=sock.path))
            client._sender_queue[0].join()  # the sender's last one answered before these
            out[label] = {"queued": queued, "answered": _times(lambda: client.donate(
                "digits", feeds, socket_path=sock.path, wait=True))}  # noqa: B023
    out["dropped"] = client.donations()["dropped"]
    return out


def live_check(folder):
    from agent.device.models.live_samples import SampleStore
    from agent.device.worker_supervisor import worker_env

    store = SampleStore(os.path.join(folder, "samples"))
    request = {"op": "check", "new": os.path.join(EXAMPLES, "digits_v3_broken", "model.onnx"),
               "running": os.path.join(EXAMPLES, "digits_v2", "model.onnx"),
               "backend": "onnxruntime", "samples": store.newest("digits"), "keep": 256,
               "batch": None, "min_agreement": 0.95, "max_error": 0.0, "error_stat": "mean"}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "agent.worker.live"],
                         input=json.dumps(request).encode(), capture_output=True,
                         env=worker_env(folder), check=True)
    wall = time.perf_counter() - started
    figures = json.loads(out.stdout.decode().splitlines()[-1])["figures"]
    child_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    own_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"wall_s": wall, "child_rss_mib": child_kib / 1024.0, "own_rss_mib": own_kib / 1024.0,
            "samples": figures["samples"], "agreement": figures["agreement"]}


def measure():
    folder = tempfile.mkdtemp(prefix="bench-live-")
    try:
        return {"donate": donations(folder), "check": live_check(folder)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def run():
    out = measure()
    rows = []
    for label in ("1 sample", "64 rows"):
        d = out["donate"][label]
        for key in ("p50", "p99"):
            rows.append({"name": "donate {} {}: the app's call (queued) vs sent and answered"
                         .format(label, key), "ours": d["queued"][key],
                         "baseline": d["answered"][key], "unit": "ms",
                         "goal": "the app never waits for the agent"})
    c = out["check"]
    rows.append({"name": "live check child, {} rows (agreement {:.2f}): wall".format(
        c["samples"], c["agreement"]), "ours": c["wall_s"], "unit": "s", "goal": "-"})
    rows.append({"name": "live check child peak RSS vs the caller's (socket, store, numpy)",
                 "ours": c["child_rss_mib"], "baseline": c["own_rss_mib"], "unit": "MiB",
                 "goal": "held by the child only, back after it"})
    return rows


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
