"""``jetson-agent search`` and ``jetson-agent compare`` as a user runs them."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from agent.cli import main
from agent.precision import golden
from tests.models import fp16_max_model, save
from tests.planted import fp16_chain

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture()
def fp16_max(tmp_path):
    return save(fp16_max_model(), str(tmp_path / "needs_constraints.onnx"))


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_seed_workflow_goldens_then_compare_then_search(tmp_path, capsys, fp16_max):
    inputs, outputs = str(tmp_path / "inputs.json"), str(tmp_path / "golden_outputs.json")
    # polygraphy run needs_constraints.onnx --onnxrt --val-range x:[1,2]
    #     --save-inputs inputs.json --save-outputs golden_outputs.json
    code, out, _ = cli(capsys, "compare", fp16_max, "--val-range", "x:[1,2]", "--save-inputs",
                       inputs, "--save-outputs", outputs, "-q")
    assert code == 0 and "[I] PASSED" in out
    assert len(golden.load_inputs(inputs)) == 1 and "y" in golden.load_outputs(outputs)[0]
    # fp16 against those goldens fails the comparison: exit status 1, Polygraphy's report.
    code, out, _ = cli(capsys, "compare", fp16_max, "--fp16", "--load-inputs", inputs,
                       "--load-outputs", outputs, "--check-error-stat", "median", "-q")
    assert code == 1
    assert "FAILED | Output: 'y' | Difference exceeds tolerance" in out
    assert "Minimum Required Tolerance: median error" in out
    # The search finds the two layers; --json carries keep, evaluations, passed.
    code, out, err = cli(capsys, "search", fp16_max, "--fp16", "--load-inputs", inputs,
                         "--load-outputs", outputs, "--check-error-stat", "median", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["keep"] == ["Add", "Sub"] and doc["passed"] and doc["evaluations"] <= 7
    assert doc["layer_precisions"] == "Add:float32 Sub:float32"
    assert "searching" in err  # progress on stderr, never on stdout
    # Without a terminal: one line per evaluation (layers kept, verdict, time).
    lines = [x for x in err.splitlines() if x.startswith("search minimal: evaluation ")]
    assert len(lines) == doc["evaluations"]
    assert lines[0].startswith("search minimal: evaluation 1/") and "0 layer(s) kept -> fail" \
        in lines[0] and lines[0].endswith((" s)", "cached)"))
    assert "/{}: ".format(doc["budget"]) in lines[0]
    assert doc["one_minimal"] and doc["untested_removals"] == [] and doc["out_of_reach"] == []
    code, out, err = cli(capsys, "search", fp16_max, "--fp16", "--load-inputs", inputs,
                         "--load-outputs", outputs, "--check-error-stat", "median", "--json",
                         "-q")
    assert code == 0 and err == ""  # -q: silent
    # Pasting the answer makes the comparison pass.
    code, out, _ = cli(capsys, "compare", fp16_max, "--fp16", "--layer-precisions",
                       "Add:float32", "Sub:float32", "--load-inputs", inputs, "--load-outputs",
                       outputs, "--check-error-stat", "median", "-q", "--json")
    assert code == 0 and json.loads(out)["passed"]
    assert json.loads(out)["engine"]["cache_hit"]  # the search built this engine already


def test_search_text_report(capsys, fp16_max):
    code, out, _ = cli(capsys, "search", fp16_max, "--fp16", "--mode", "bisect",
                       "--val-range", "x:[1,2]", "--check-error-stat", "median", "-q")
    assert code == 0
    assert "--layer-precisions MatMul_0:float32 Add:float32 Sub:float32" in out  # graph order
    assert "[I] Iterations:" in out and "PASS" in out and "FAIL" in out


def test_max_evaluations_gives_a_partial_result(capsys, fp16_max):
    code, out, _ = cli(capsys, "search", fp16_max, "--fp16", "--val-range", "x:[1,2]",
                       "--check-error-stat", "median", "--max-evaluations", "3", "--json",
                       "-q")
    doc = json.loads(out)
    assert code == 1 and doc["partial"] and doc["exhausted"] and doc["evaluations"] == 3


@pytest.mark.parametrize("argv,code_name", [
    (["--fp16", "--atol", "-1"], "bad_argument"),
    (["--fp16", "--rtol", "y:nan"], "bad_argument"),
    (["--fp16", "--atol", "out9:1e-3"], "bad_argument"),
    (["--fp16", "--val-range", "x:[2,1]"], "bad_argument"),
    (["--int8"], "bad_argument"),
    ([], "bad_argument"),
])
def test_bad_arguments_exit_2_with_a_code(capsys, fp16_max, argv, code_name):
    code, out, err = cli(capsys, "search", fp16_max, "--json", "-q", *argv)
    assert code == 2
    assert json.loads(out)["error"]["code"] == code_name


def test_goldens_that_do_not_fit_the_model(tmp_path, capsys, fp16_max):
    inputs, outputs = str(tmp_path / "in.npz"), str(tmp_path / "out.json")
    golden.save_inputs(inputs, [{"x": np.ones((1, 1, 4, 4), np.float32)}])
    golden.save_outputs(outputs, [{"logits": np.ones((1, 10), np.float32)}])
    code, out, err = cli(capsys, "compare", fp16_max, "--fp16", "--load-inputs", inputs,
                         "--load-outputs", outputs, "-q")
    assert code == 2 and "golden_mismatch" in err and "'logits'" in err
    golden.save_outputs(outputs, [{"y": np.full((1, 1, 4, 4), 5.0, np.float32)}])
    code, out, err = cli(capsys, "search", fp16_max, "--fp16", "--load-inputs", inputs,
                         "--load-outputs", outputs, "-q")
    assert code == 2 and "reference_mismatch" in err


def test_ctrl_c_prints_the_partial_result(tmp_path):
    # linear mode: one build per layer. The last culprit sits at the end of 40 blocks
    # (~120 evaluations, minutes at load 8), so no scheduling delay of the SIGINT lets the
    # search finish first; interrupted after its first evaluation it costs one build.
    path = save(fp16_chain(blocks=40, sites=(2, 38))[0], str(tmp_path / "chain.onnx"))
    env = dict(os.environ, JETSON_AGENT_STATE_DIR=str(tmp_path / "state"),
               PYTHONPATH=ROOT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent", "search", path, "--fp16", "--mode", "linear",
         "--atol", "1e-2", "--rtol", "1e-2", "--json"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        universal_newlines=True)
    err = []
    try:
        for line in proc.stderr:  # the first evaluation's line: the search loop runs
            err.append(line)
            if line.startswith("search linear: evaluation 1/"):
                proc.send_signal(signal.SIGINT)
                break
        out, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, "".join(err) + rest
    doc = json.loads(out)
    assert doc["interrupted"] and doc["partial"] and doc["evaluations"] < 100


def _shape_fed_reshape(path):
    """fp16 overflow behind a Reshape fed by Shape: the instrumented model has outputs whose
    shape nothing infers (declared type-only)."""
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m"])
    inits = [numpy_helper.from_array(np.array(2e5, np.float32), "up"),
             numpy_helper.from_array(np.array(5e-6, np.float32), "down")]
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Mul", ["r", "up"], ["a"], name="amp"),
             helper.make_node("Shape", ["a"], ["s"], name="shape"),
             helper.make_node("ReduceProd", ["s"], ["p"], name="prod", keepdims=1),
             helper.make_node("Reshape", ["a", "p"], ["f"], name="flat"),
             helper.make_node("Mul", ["f", "down"], ["g"], name="att"),
             helper.make_node("Sigmoid", ["g"], ["y"], name="sig")]
    model = helper.make_model(helper.make_graph(nodes, "reshape", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 13)])
    return save(model, path)


def test_default_search_survives_type_only_outputs_and_reuses_its_ranking(tmp_path, capsys):
    from agent.engines.cache import EngineCache
    from agent.fsio import state_dir

    path = _shape_fed_reshape(str(tmp_path / "reshape.onnx"))
    argv = ["search", path, "--fp16", "--shapes", "x:2x4", "--val-range", "x:[1,2]",
            "--check-error-stat", "median", "--json", "-q"]
    code, out, _ = cli(capsys, *argv)
    doc = json.loads(out)
    assert code == 0 and doc["passed"] and {"amp", "flat"} & set(doc["keep"])
    assert not doc["ranking_cached"]
    # Every engine it published loads (cache verify opens them), and the repeat skips the
    # instrumented runs.
    code, out, _ = cli(capsys, "cache", "verify", "--json")
    assert code == 0 and json.loads(out)["corrupt"] == []
    code, out, _ = cli(capsys, *argv)
    again = json.loads(out)
    assert again["ranking_cached"] and again["keep"] == doc["keep"]
    # Pre-flight: the host's set is verified with one build.
    code, out, _ = cli(capsys, *(argv + ["--preflight"]))
    pre = json.loads(out)
    assert code == 0 and pre["prediction_passed"] and pre["evaluations"] == 1
    assert pre["preflight"]["keep"] == doc["keep"] and pre["keep"] == doc["keep"]
    # A budget smaller than one engine: the command ends with the cache within it.
    code, out, _ = cli(capsys, *(argv[:-2] + ["--cache-budget", "1", "--json", "-q"]))
    assert code == 0
    cache = EngineCache(os.path.join(state_dir(None), "engines"))
    assert sum(e.size for e in cache.ls()) <= 1


def test_compare_generates_inputs_of_the_shapes_asked(tmp_path, capsys):
    path = _shape_fed_reshape(str(tmp_path / "reshape.onnx"))
    saved = str(tmp_path / "inputs.npz")
    code, out, _ = cli(capsys, "compare", path, "--fp16", "--shapes", "x:3x4",
                       "--save-inputs", saved, "--check-error-stat", "median", "-q")
    assert golden.load_inputs(saved)[0]["x"].shape == (3, 4)
    assert "emulated" in out  # host numerics, said so in the report


def test_int8_build_with_nothing_to_quantize_still_writes_the_asked_calibration_cache(
        tmp_path, capsys):
    # A model with no int8 kernel (one Relu): the build runs all in fp32, but the calibration
    # cache asked for is written (every tensor's range, as TensorRT calibrates), so the next
    # search with that cache alone finds it.
    from onnx import TensorProto, helper

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "relu",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    model = save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]),
                 str(tmp_path / "relu.onnx"))
    data, cache = str(tmp_path / "calib.npz"), str(tmp_path / "relu.cache")
    np.savez(data, x=np.random.RandomState(0).random_sample((4, 4)).astype(np.float32))
    code, out, _ = cli(capsys, "build", model, "--int8", "--calib", data,
                       "--calibration-cache", cache)
    assert code == 0 and os.path.isfile(cache)
    from calib.cache import read_cache
    assert set(read_cache(cache).scales) == {"x", "y"}
    code, out, _ = cli(capsys, "search", model, "--int8", "--calibration-cache", cache,
                       "--json")
    doc = json.loads(out)
    assert code == 0 and doc["passed"] and doc["keep"] == [] and doc["evaluations"] == 1
