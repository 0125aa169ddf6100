"""`jetson-agent bench`'s measurement vs a plain onnxruntime loop, on the same engine.

Ours: ``agent.engines.bench.benchmark`` on the onnxruntime backend's Runner (input checks, output
dict, one clock read per iteration). Baseline: ``InferenceSession.run`` in a bare loop with
the same session threads, timed once around the loop. Both run the same engine file (the
digits MLP, trained on scikit-learn's digits, built fp32 through the engine cache) on the same
inputs, interleaved in short alternating rounds (order flipped every round) so that machine
noise hits both alike. Ours and baseline are each side's best round (the least disturbed);
the ratio is the median of the per-round throughput ratios.

A third row isolates the measurement loop: ``benchmark`` around a bare ``session.run``
(no Runner), against the same plain loop.
"""

import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

THREADS = 1
ROUNDS = 40
ROUND_SECONDS = 0.05


def _engine(tmp):
    from agent.engines.backends.base import BuildPlan
    from agent.engines.backends.onnxruntime import create
    from agent.engines.build import build_engine
    from agent.engines.cache import EngineCache
    from tests import models

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, split = models.digits_classifier()
    path = models.save(model, os.path.join(tmp, "digits.onnx"))
    record = build_engine(path, BuildPlan("fp32"), create(threads=THREADS),
                          EngineCache(os.path.join(tmp, "engines")), {"kind": "host"})
    return record.engine_path, split[2]


def _plain_loop(session, feeds, iterations):
    run = session.run
    start = time.perf_counter()
    for _ in range(iterations):
        run(None, feeds)
    return iterations / (time.perf_counter() - start)


class _BareSession(object):
    """``infer`` straight to ``session.run``: the measurement loop without the Runner."""

    def __init__(self, session):
        self.session = session

    def infer(self, feeds):
        return self.session.run(None, feeds)

    def close(self):
        pass


def compare(engine, x, batch, bare=False):
    import onnxruntime as ort

    from agent.engines.backends.onnxruntime import create
    from agent.engines.bench import benchmark

    feeds = {"input": np.ascontiguousarray(np.resize(x, (batch, x.shape[1])))}
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    session = ort.InferenceSession(engine, options, providers=["CPUExecutionProvider"])
    runner = _BareSession(session) if bare else create(threads=THREADS).open(engine)
    # iterations per round: about ROUND_SECONDS of work
    benchmark(runner, feeds, iterations=50, warmup=20)
    per_call = 1.0 / _plain_loop(session, feeds, 200)
    n = max(20, int(ROUND_SECONDS / per_call))
    ours, base, ratios = [], [], []
    for i in range(ROUNDS):
        if i % 2:
            b = _plain_loop(session, feeds, n)
            o = benchmark(runner, feeds, iterations=n, warmup=0).inferences_per_second
        else:
            o = benchmark(runner, feeds, iterations=n, warmup=0).inferences_per_second
            b = _plain_loop(session, feeds, n)
        ours.append(o)
        base.append(b)
        ratios.append(o / b)
    runner.close()
    return max(ours), max(base), statistics.median(ratios)


def run():
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        engine, x = _engine(tmp)
        for batch, bare in ((1, False), (256, False), (1, True)):
            ours, base, ratio = compare(engine, x, batch, bare)
            rows.append({
                "name": "digits MLP fp32, batch {}, {} thread{}".format(
                    batch, THREADS, ", loop only (no Runner)" if bare else ""),
                "ours": ours, "baseline": base, "unit": "inferences/s", "ratio": ratio,
                "goal": ">= 0.97",
            })
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
