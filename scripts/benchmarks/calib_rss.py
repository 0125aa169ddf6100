"""Peak memory of INT8 calibration: a dataset 10x larger vs the small one.

Each calibration runs in a fresh Python process (an onnxruntime-backend int8 build of the
digits MLP with entropy2, batch 256), which reports its own peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``). The datasets are directories of .npy shards
(8192 samples, 2 MiB each) cut from scikit-learn's digits images, tiled with a little noise:
SMALL_SHARDS shards vs 10x as many. A streaming reader holds about one shard at a time, so
the ratio stays near 1. A control row holds the large dataset in memory in the same child, to
show what a reader that loads everything would cost.
"""

import json
import os
import subprocess
import sys
import tempfile
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SMALL_SHARDS = 16
SHARD_SAMPLES = 8192

CHILD = r"""
import json, os, resource, sys, time
sys.path.insert(0, sys.argv[1])
from agent.engines.backends.base import BuildPlan, CalibrationSettings
from agent.engines.backends.onnxruntime import create
model, data, engine, hold = sys.argv[2:6]
if hold == "hold":  # the control: what keeping the whole dataset in memory costs
    import numpy as np
    held = [np.load(os.path.join(data, n)) for n in sorted(os.listdir(data))]
plan = BuildPlan("int8", calibration=CalibrationSettings(data=data, batch_size=256))
t = time.perf_counter()
result = create(threads=1).build(model, plan, engine)
seconds = time.perf_counter() - t
assert result.calibrated
print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "seconds": seconds, "samples": result.details.get("calibration_samples")}))
"""


def _dataset(directory, shards, x, seed):
    os.makedirs(directory)
    rng = np.random.RandomState(seed)
    for i in range(shards):
        rows = x[rng.randint(0, len(x), SHARD_SAMPLES)]
        noisy = np.clip(rows + rng.normal(0, 0.02, rows.shape), 0, 1).astype(np.float32)
        np.save(os.path.join(directory, "input_{:04d}.npy".format(i)), noisy)
    return shards * SHARD_SAMPLES * x.shape[1] * 4


def _calibrate(model, data, engine, hold=False):
    proc = subprocess.run([sys.executable, "-c", CHILD, ROOT, model, data, engine,
                           "hold" if hold else "stream"],
                          check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run():
    from tests import models

    with tempfile.TemporaryDirectory() as tmp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, split = models.digits_classifier()
        path = models.save(model, os.path.join(tmp, "digits.onnx"))
        small_bytes = _dataset(os.path.join(tmp, "small"), SMALL_SHARDS, split[0], 1)
        large_bytes = _dataset(os.path.join(tmp, "large"), SMALL_SHARDS * 10, split[0], 2)
        small = _calibrate(path, os.path.join(tmp, "small"), os.path.join(tmp, "e1"))
        large = _calibrate(path, os.path.join(tmp, "large"), os.path.join(tmp, "e2"))
        held = _calibrate(path, os.path.join(tmp, "large"), os.path.join(tmp, "e3"), True)
    mib = 1024.0
    return [{
        "name": "peak RSS calibrating {} vs {} samples ({:.0f} vs {:.0f} MiB of data; "
                "{:.1f} vs {:.1f} s)".format(
                    large["samples"], small["samples"], large_bytes / 2.0 ** 20,
                    small_bytes / 2.0 ** 20, large["seconds"], small["seconds"]),
        "ours": large["maxrss_kb"] / mib,
        "baseline": small["maxrss_kb"] / mib,
        "unit": "MiB",
        "goal": "<= 1.1 (streaming)",
    }, {
        "name": "control: the same, with the {:.0f} MiB dataset also loaded whole".format(
            large_bytes / 2.0 ** 20),
        "ours": held["maxrss_kb"] / mib,
        "baseline": small["maxrss_kb"] / mib,
        "unit": "MiB",
        "goal": "> 1.1 (shows the measure sees it)",
    }]


if __name__ == "__main__":
    for row in run():
        print(row)
