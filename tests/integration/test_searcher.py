"""Precision searches end to end: real ONNX models, the onnxruntime backend's fp16/int8
emulation, the engine cache on disk."""

import math
import os

import numpy as np
import pytest

from agent.engines.backends import onnx_model
from agent.engines.backends.base import BuildPlan, CalibrationSettings
from agent.engines.backends.onnxruntime import create
from agent.engines.cache import EngineCache
from agent.errors import AgentError
from agent.precision import golden
from agent.precision.searcher import run_search
from tests.models import fp16_max_model, save
from tests.planted import fp16_chain, int8_outlier_chain

HOST = {"kind": "host", "gpu": "cpu"}
# The seeds' comparison: `--check-error-stat median` with the default tolerances.
MEDIAN = {"check_error_stat": "median"}


@pytest.fixture()
def env(tmp_path):
    class Env(object):
        backend = create(threads=1)
        cache = EngineCache(str(tmp_path / "engines"))
        calibration_dir = str(tmp_path / "calibration")

        def model(self, model, name="model.onnx"):
            return save(model, str(tmp_path / name))

        def goldens(self, path, val_range=None, iterations=1, shapes=None):
            m = onnx_model.load_model(path)
            inputs = golden.generate_inputs(onnx_model.input_specs(m), val_range,
                                            iterations=iterations, shapes=shapes)
            return inputs, golden.reference_outputs(path, inputs, self.backend)

        def search(self, path, plan, inputs, goldens, **kwargs):
            kwargs.setdefault("calibration_dir", self.calibration_dir)
            return run_search(path, plan, inputs, goldens, self.backend, self.cache, HOST,
                              **kwargs)

    e = Env()
    e.tmp = tmp_path
    return e


@pytest.fixture()
def fp16_max(env):
    path = env.model(fp16_max_model())
    inputs, goldens = env.goldens(path, {"x": (1.0, 2.0)})
    return path, inputs, goldens


def test_fp16_max_minimal_keeps_exactly_add_and_sub(env, fp16_max):
    path, inputs, goldens = fp16_max
    r = env.search(path, BuildPlan("fp16"), inputs, goldens, compare_options=MEDIAN)
    assert r.keep == ["Add", "Sub"] and r.passed and r.complete
    assert r.layer_precisions == "Add:float32 Sub:float32"
    assert r.evaluations <= 7  # bisect's steps, the bound by worst-first, the removals
    # Dropping either one fails, and the table says so.
    rows = {row["layer"]: row for row in r.sensitivity}
    assert rows["Add"]["without_it"]["passed"] is False
    assert rows["Sub"]["without_it"]["passed"] is False
    assert rows["Add"]["out_of_range"] > 0 and rows["Sub"]["out_of_range"] > 0
    # The answer's engine is in the cache, and it passes.
    assert r.engine_key and env.cache.get(r.engine_key) is not None
    assert r.comparison is not None and r.comparison.passed
    doc = r.to_dict()
    assert doc["keep"] == ["Add", "Sub"] and doc["passed"] and doc["evaluations"] == r.evaluations
    assert [it["size"] for it in doc["iterations"]][:2] == [0, 4]  # the sanity steps


def test_fp16_max_with_elementwise_tolerances_also_needs_the_first_flip(env, fp16_max):
    # Elementwise 1e-5: MatMul_0 in fp16 rounds x in [1, 2] by up to 2^-11 (x + 65504 in fp32
    # keeps only 8 fraction bits, so this shows as 0.0039 at the output); the other flip
    # reads values that fp16 represents exactly.
    path, inputs, goldens = fp16_max
    r = env.search(path, BuildPlan("fp16"), inputs, goldens)
    assert r.keep == ["MatMul_0", "Add", "Sub"]


def test_preflight_prediction_verified_or_searched(env, fp16_max):
    path, inputs, goldens = fp16_max
    plan = BuildPlan("fp16")
    # The device verifies the host's prediction with one build...
    r = env.search(path, plan, inputs, goldens, compare_options=MEDIAN,
                   predicted=["Sub", "Add"])
    assert r.keep == ["Add", "Sub"] and r.evaluations == 1 and r.prediction_passed
    # ... and searches when it fails (the failed prediction counts as an evaluation).
    r = env.search(path, plan, inputs, goldens, compare_options=MEDIAN, predicted=["Add"])
    assert r.prediction_passed is False and r.keep == ["Add", "Sub"] and r.evaluations >= 2
    for bad, code in ((["Nope"], "unknown_layer"), ("Add", "bad_argument")):
        with pytest.raises(AgentError) as err:
            env.search(path, plan, inputs, goldens, compare_options=MEDIAN, predicted=bad)
        assert err.value.code == code


@pytest.mark.parametrize("mode,direction,keep", [
    ("bisect", "forward", ["MatMul_0", "Add", "Sub"]),
    ("bisect", "reverse", ["Add", "Sub", "MatMul_1"]),
    ("linear", "forward", ["MatMul_0", "Add", "Sub"]),
    ("linear", "reverse", ["Add", "Sub", "MatMul_1"]),
    ("worst-first", "forward", ["Add", "Sub"]),
])
def test_fp16_max_polygraphy_modes(env, fp16_max, mode, direction, keep):
    path, inputs, goldens = fp16_max
    r = env.search(path, BuildPlan("fp16"), inputs, goldens, mode=mode, direction=direction,
                   compare_options=MEDIAN)
    assert r.keep == keep


def test_planted_fp16_pairs_at_several_depths(env):
    model, culprits = fp16_chain()
    path = env.model(model)
    inputs, goldens = env.goldens(path, iterations=2)
    opts = {"atol": 1e-2, "rtol": 1e-2}
    found = {}
    for mode in ("minimal", "bisect", "linear"):
        found[mode] = env.search(path, BuildPlan("fp16"), inputs, goldens, mode=mode,
                                 compare_options=opts)
    minimal = found["minimal"]
    n, k = minimal.candidates, len(culprits)
    assert sorted(minimal.keep) == sorted(culprits)
    assert minimal.evaluations <= k * math.log2(n) + 2 * k
    # Polygraphy's answers are contiguous prefixes reaching the deepest culprit.
    for mode in ("bisect", "linear"):
        assert set(culprits) <= set(found[mode].keep)
        assert len(found[mode].keep) > 4 * k
    assert found["linear"].evaluations > minimal.evaluations
    assert minimal.one_minimal and minimal.evaluations <= 3 * found["bisect"].evaluations + 4
    # Without the instrumented ranking the default keeps no more than bisect; past its
    # budget only while the set still shrinks fast (cheap host evaluations), up to the cap.
    bounded = env.search(path, BuildPlan("fp16"), inputs, goldens, compare_options=opts,
                         instrument=False)
    assert set(culprits) <= set(bounded.keep)
    assert len(bounded.keep) <= len(found["bisect"].keep)
    assert bounded.evaluations <= 3 * found["bisect"].evaluations + 4 or (
        bounded.budget_extended and bounded.evaluations <= bounded.budget_cap
        and len(bounded.keep) < len(found["bisect"].keep))
    # ... and with a larger budget it shrinks to the same answer (group testing).
    unranked = env.search(path, BuildPlan("fp16"), inputs, goldens, compare_options=opts,
                          instrument=False, max_evaluations=200)
    assert sorted(unranked.keep) == sorted(culprits)
    assert unranked.evaluations <= k * math.log2(n) + 2 * k + 2 * math.log2(n) + 5
    assert unranked.sensitivity and all(row["kept"] for row in unranked.sensitivity)


def test_planted_int8_outlier_channels(env):
    model, culprits = int8_outlier_chain()
    path = env.model(model)
    rng = np.random.RandomState(0)
    data = str(env.tmp / "calib.npz")
    np.savez(data, x=rng.random_sample((64, 16)).astype(np.float32))
    plan = BuildPlan("int8", calibration=CalibrationSettings(data=data, algorithm="minmax"))
    inputs, goldens = env.goldens(path, iterations=2, shapes={"x": (8, 16)})
    calibrations = []

    def progress(stage, done, total):
        if stage == "calibrating" and done == 0:
            calibrations.append(stage)

    opts = {"atol": 0.05, "rtol": 0.05, "check_error_stat": "median"}
    r = env.search(path, plan, inputs, goldens, compare_options=opts, progress=progress)
    assert r.keep == culprits
    assert r.candidates == 10  # the MatMuls: nothing else has an int8 kernel
    assert len(calibrations) == 1  # one calibration for every candidate build
    # bisect's steps, then the bound by worst-first and group testing
    assert r.evaluations <= (len(culprits) + 1) * math.log2(r.candidates) + 2 * len(culprits) + 6
    # int8 with fp16 fallback ("best"): the same layers need fp32.
    best = BuildPlan("best", calibration=plan.calibration)
    r = env.search(path, best, inputs, goldens, compare_options=opts)
    # Each MatMul's fp16 Relu is fused into it (one TensorRT layer): one candidate, kept
    # whole, counted once.
    assert r.layers_kept == len(culprits) and r.candidates < r.candidate_nodes
    assert r.groups == {m: [m, m.replace("mm", "relu")] for m in culprits}
    assert r.keep == [n for m in culprits for n in r.groups[m]]


def test_reference_mismatch_when_even_fp32_fails(env, fp16_max):
    path, inputs, goldens = fp16_max
    shifted = [{"y": g["y"] + np.float32(1.0)} for g in goldens]
    with pytest.raises(AgentError) as err:
        env.search(path, BuildPlan("fp16"), inputs, shifted)
    assert err.value.code == "reference_mismatch"
    assert "y needs atol 1" in err.value.message


@pytest.mark.parametrize("bad,code", [
    ({"goldens": [{"out": np.zeros((1, 1, 4, 4), np.float32)}]}, "golden_mismatch"),
    ({"goldens": [{"y": np.zeros((1, 1, 4, 5), np.float32)}]}, "golden_mismatch"),
    ({"goldens": [{"y": np.full((1, 1, 4, 4), np.nan, np.float32)}]}, "golden_mismatch"),
    ({"inputs": [{"x": np.zeros((1, 1, 4, 4), np.float64)}]}, "golden_mismatch"),
    ({"inputs": [{"input": np.zeros((1, 1, 4, 4), np.float32)}]}, "golden_mismatch"),
    ({"compare_options": {"atol": -1e-3}}, "bad_argument"),
    ({"compare_options": {"check_error_stat": "worst"}}, "bad_argument"),
    ({"mode": "greedy"}, "bad_argument"),
    ({"plan": BuildPlan("fp32")}, "bad_argument"),
])
def test_bad_input_fails_before_any_build(env, fp16_max, bad, code):
    path, inputs, goldens = fp16_max
    kwargs = {"compare_options": bad.get("compare_options")}
    if "mode" in bad:
        kwargs["mode"] = bad["mode"]
    with pytest.raises(AgentError) as err:
        env.search(path, bad.get("plan", BuildPlan("fp16")), bad.get("inputs", inputs),
                   bad.get("goldens", goldens), **kwargs)
    assert err.value.code == code
    assert env.cache.counters["misses"] == 0


def test_stopped_search_reports_partial_results_and_resumes_from_the_cache(env):
    model, culprits = fp16_chain()
    path = env.model(model)
    inputs, goldens = env.goldens(path)
    opts = {"atol": 1e-2, "rtol": 1e-2}
    evaluated = []

    def progress(stage, done, total):
        if stage == "searching":
            evaluated.append(done)

    r = env.search(path, BuildPlan("fp16"), inputs, goldens, compare_options=opts,
                   progress=progress, should_stop=lambda: len(evaluated) > 5)
    assert r.interrupted and not r.complete and r.to_dict()["partial"]
    assert 0 < r.evaluations < 10
    assert r.passed and set(culprits) <= set(r.keep)  # the smallest passing set so far
    assert env.cache.verify()["corrupt"] == []
    # A new search rebuilds nothing it already evaluated.
    again = env.search(path, BuildPlan("fp16"), inputs, goldens, compare_options=opts)
    assert sorted(again.keep) == sorted(culprits)
    first = [it["cache_hit"] for it in again.iterations[:r.evaluations]]
    assert all(first)


def test_ctrl_c_during_calibration_leaves_caches_consistent(env):
    model, culprits = int8_outlier_chain()
    path = env.model(model)
    data = str(env.tmp / "calib.npz")
    np.savez(data, x=np.random.RandomState(0).random_sample((64, 16)).astype(np.float32))
    plan = BuildPlan("int8", calibration=CalibrationSettings(data=data, algorithm="minmax"))
    inputs, goldens = env.goldens(path, shapes={"x": (8, 16)})
    opts = {"atol": 0.05, "rtol": 0.05, "check_error_stat": "median"}

    def interrupt(stage, done, total):
        if stage == "calibrating" and done == 1:
            raise KeyboardInterrupt()

    r = env.search(path, plan, inputs, goldens, compare_options=opts, progress=interrupt)
    assert r.interrupted and not r.passed and r.keep == []
    report = env.cache.verify()
    assert report["corrupt"] == [] and report["ok"] == report["checked"]
    assert os.listdir(os.path.join(env.cache.root, "tmp")) == []  # no half-built engine
    assert not [f for f in os.listdir(env.calibration_dir) if f.endswith(".cache")]
    r = env.search(path, plan, inputs, goldens, compare_options=opts)
    assert r.keep == culprits and r.complete


def _identity_after_if():
    """out = Identity(If(cond) { x * 1.0001 } else { x + 0.0001 }): a model exported with
    subgraphs, whose output passes through an Identity the fp16 build rounds."""
    from onnx import TensorProto, helper

    def branch(name, op, value):
        c = helper.make_node("Constant", [], [name + "_c"], value=helper.make_tensor(
            name + "_v", TensorProto.FLOAT, [], [value]))
        n = helper.make_node(op, ["x", name + "_c"], [name + "_y"], name=name + "_" + op)
        return helper.make_graph([c, n], name, [], [helper.make_tensor_value_info(
            name + "_y", TensorProto.FLOAT, [1, 8])])

    node_if = helper.make_node("If", ["cond"], ["y"], name="If_0",
                               then_branch=branch("then", "Mul", 1.0001),
                               else_branch=branch("else", "Add", 0.0001))
    ident = helper.make_node("Identity", ["y"], ["out"], name="Identity_out")
    graph = helper.make_graph(
        [node_if, ident], "vad_like",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8]),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


def test_output_identity_after_if_is_a_candidate_and_the_subgraph_is_named(env):
    path = env.model(_identity_after_if(), "vad_like.onnx")
    inputs = [{"x": np.linspace(1.0, 2.0, 8, dtype=np.float32).reshape(1, 8),
               "cond": np.array(True)}]
    goldens = golden.reference_outputs(path, inputs, env.backend)
    r = env.search(path, BuildPlan("fp16"), inputs, goldens)
    # The fp16 build rounds the If's branches (as one layer) and the Identity's output: both
    # are offered, and keeping both is the answer.
    assert r.candidates == 2 and r.keep == ["If_0", "Identity_out"] and r.one_minimal
    assert r.out_of_reach == [{"node": "If_0", "op": "If", "nodes_inside": 4}]
    assert "If 'If_0' (4 nodes)" in r.message
    # Pinned to fp16 by the user, nothing is left to offer: the error names it and the If.
    plan = BuildPlan("fp16", layer_precisions={"Identity_out": "float16"})
    with pytest.raises(AgentError) as err:
        env.search(path, plan, inputs, goldens)
    assert err.value.code == "reference_mismatch"
    assert "Identity_out" in err.value.message and "If 'If_0'" in err.value.message
