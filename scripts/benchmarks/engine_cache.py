"""Engine-cache hit vs cold build of the digits MLP in int8.

Cold: ``build_engine`` into an empty cache with no calibration cache, so it hashes the model
and the data, calibrates (entropy2 over 1257 real digits images), rewrites the graph to Q/DQ,
checks that the engine loads and publishes it. Hit: the same call again, which hashes the model
and the data (the in-process digest memo is cleared, as in a fresh process) and verifies the
entry's sha256, and never calls the backend. Both in-process (median of REPEATS) and as whole
``jetson-agent build`` processes (median of CLI_REPEATS; interpreter start and imports
included, the same for both).
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

REPEATS = 5
CLI_REPEATS = 3


def _prepare(tmp):
    from tests import models

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, split = models.digits_classifier()
    path = models.save(model, os.path.join(tmp, "digits.onnx"))
    calib = os.path.join(tmp, "calib")
    os.makedirs(calib)
    np.save(os.path.join(calib, "input.npy"), split[0])
    return path, calib


def _in_process(model, calib, tmp):
    from agent.engines import build as engine
    from agent.engines.backends.base import BuildPlan, CalibrationSettings
    from agent.engines.backends.onnxruntime import create
    from agent.engines.cache import EngineCache

    plan = BuildPlan("int8", calibration=CalibrationSettings(data=calib, batch_size=32))
    backend = create()
    cold, hit = [], []
    for i in range(REPEATS):
        state = os.path.join(tmp, "state-{}".format(i))
        cache = EngineCache(os.path.join(state, "engines"))
        cal_dir = os.path.join(state, "calibration")
        engine._DATA_DIGESTS.clear()
        t = time.perf_counter()
        first = engine.build_engine(model, plan, backend, cache, {"kind": "host"},
                                    calibration_dir=cal_dir)
        cold.append(time.perf_counter() - t)
        assert not first.cache_hit and first.result["calibrated"]
        engine._DATA_DIGESTS.clear()
        t = time.perf_counter()
        again = engine.build_engine(model, plan, backend, cache, {"kind": "host"},
                                    calibration_dir=cal_dir)
        hit.append(time.perf_counter() - t)
        assert again.cache_hit
    return statistics.median(hit) * 1000, statistics.median(cold) * 1000


def _cli(model, calib, tmp):
    cold, hit = [], []
    args = [sys.executable, "-m", "agent", "build", model, "--int8", "--calib", calib,
            "--calib-batch-size", "32", "--json"]
    for i in range(CLI_REPEATS):
        env = dict(os.environ, JETSON_AGENT_STATE_DIR=os.path.join(tmp, "cli-{}".format(i)),
                   PYTHONPATH=ROOT)
        for times in (cold, hit):
            t = time.perf_counter()
            subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True)
            times.append(time.perf_counter() - t)
    return statistics.median(hit) * 1000, statistics.median(cold) * 1000


def run():
    with tempfile.TemporaryDirectory() as tmp:
        model, calib = _prepare(tmp)
        hit, cold = _in_process(model, calib, tmp)
        cli_hit, cli_cold = _cli(model, calib, tmp)
    return [
        {"name": "digits int8: hit vs cold build (build_engine)", "ours": hit,
         "baseline": cold, "unit": "ms", "goal": "hit << cold (< 0.1)"},
        {"name": "digits int8: hit vs cold build (jetson-agent build process)",
         "ours": cli_hit, "baseline": cli_cold, "unit": "ms",
         "goal": "hit < cold (interpreter start-up is shared)"},
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
