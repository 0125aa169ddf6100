"""The host backend end to end on real onnxruntime: fp16 emulation (the seeds' FP16_MAX model),
int8 calibration of a classifier trained on scikit-learn's digits, calibration caches, bad
input."""

import base64
import io
import json
import os

import numpy as np
import onnx
import pytest

from agent.engines.backends import graph, onnx_model
from agent.engines.backends.base import BuildPlan, CalibrationSettings, get_backend
from agent.engines.backends.onnxruntime import create, read_metadata
from agent.engines.backends.onnxruntime_runner import session_options
from agent.errors import AgentError
from calib.cache import read_cache, write_cache
from tests.models import digits_classifier, fp16_max_model, save

ort = pytest.importorskip("onnxruntime")

ALGORITHMS = ("entropy2", "minmax", "percentile", "legacy")


@pytest.fixture(scope="module")
def backend():
    return create(threads=1)


@pytest.fixture(scope="module")
def fp16_max(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp16max")
    path = save(fp16_max_model(), d / "needs_constraints.onnx")
    x = np.random.RandomState(0).uniform(1, 2, (1, 1, 4, 4)).astype(np.float32)
    return path, x


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """A trained MLP, its calibration shards (from the training split) and the held-out split."""
    d = tmp_path_factory.mktemp("digits")
    model, (x_train, _y_train, x_test, y_test) = digits_classifier()
    path = save(model, d / "digits.onnx")
    calib = d / "calib"
    calib.mkdir()
    for k in range(4):  # 4 shards x 128 training images
        np.save(str(calib / "input_{:02d}.npy".format(k)), x_train[128 * k:128 * (k + 1)])
    return {"model": path, "calib": str(calib), "x": x_test, "y": y_test, "dir": d}


def run(backend, engine, feeds):
    with backend.open(engine) as runner:
        return runner.infer(feeds)


def build(backend, model, plan, engine, **kwargs):
    return backend.build(model, plan, str(engine), **kwargs)


def top1(backend, engine, digits):
    logits = run(backend, engine, {"input": digits["x"]})["logits"]
    return 100.0 * float(np.mean(logits.argmax(axis=1) == digits["y"]))


def errors(y, ref):
    diff = np.abs(y.astype(np.float64) - ref)
    return float(np.median(diff)), float(np.max(diff))


# -- fp16: the seeds' FP16_MAX model -----------------------------------------------------------

def test_fp16_overflows_and_fp32_islands_fix_it(backend, fp16_max, tmp_path):
    model, x = fp16_max
    ref = run(backend, build(backend, model, BuildPlan("fp32"), tmp_path / "fp32").engine_path,
              {"x": x})["y"]
    assert np.allclose(ref, x, atol=4e-3)  # flip, +65504, -65504, flip: x back in fp32

    r = build(backend, model, BuildPlan("fp16"), tmp_path / "fp16")
    assert r.layer_precisions == {n: "float16" for n in ("MatMul_0", "Add", "Sub", "MatMul_1")}
    y = run(backend, r.engine_path, {"x": x})["y"]
    median, worst = errors(y, ref)
    assert median > 0.5 or not np.all(np.isfinite(y))  # Add's x + 65504 rounds/overflows

    plan = BuildPlan("fp16", layer_precisions={"Add": "float32", "Sub": "float32"})
    r = build(backend, model, plan, tmp_path / "fixed")
    assert r.layer_precisions["Add"] == r.layer_precisions["Sub"] == "float32"
    assert r.layer_precisions["MatMul_0"] == "float16" and r.mismatches == []
    y = run(backend, r.engine_path, {"x": x})["y"]
    median, worst = errors(y, ref)
    # Polygraphy's --check-error-stat median, as in the seed example; element-wise the error
    # is at most one fp32 ulp at 65504 (2^-8): fp16 rounding of x before the fp32 Add.
    assert median <= 1e-3
    assert worst <= 2.0 ** -8 + 1e-6


def test_fp32_output_overflows_again_when_an_fp16_layer_reads_it(backend, fp16_max, tmp_path):
    """The seed's --layer-precisions Add:float16 Sub:float32 still fails, and so does Add kept
    alone: TensorRT reformats at precision boundaries and so does the emulation."""
    model, x = fp16_max
    for layers in ({"Add": "float16", "Sub": "float32"}, {"Add": "float32"}):
        r = build(backend, model, BuildPlan("fp16", layer_precisions=layers), tmp_path / "e")
        y = run(backend, r.engine_path, {"x": x})["y"]
        assert errors(y, x)[0] > 0.5 or not np.all(np.isfinite(y)), layers


def test_plain_fp16_model_does_not_overflow_on_the_cpu_provider(fp16_max):
    """Why the backend rewrites with explicit Cast pairs (REFERENCE §6): a model whose tensors
    are all fp16 runs fp32 kernels on ORT's CPU provider, so the FP16_MAX overflow never shows
    and a plain fp16 conversion would pass a build that fails on a device."""
    model, x = fp16_max
    plain = graph.to_fp16(onnx_model.load_model(model), keep=set(), emulate=False)
    assert sum(1 for n in plain.graph.node if n.op_type == "Cast") == 2  # in and out only
    session = ort.InferenceSession(plain.SerializeToString(), session_options(1),
                                   providers=["CPUExecutionProvider"])
    y = session.run(None, {"x": x})[0]
    assert np.all(np.isfinite(y)) and errors(y, x)[1] < 4e-3


def test_engine_metadata_and_runner(backend, fp16_max, tmp_path):
    model, x = fp16_max
    r = build(backend, model, BuildPlan("fp16", mark_outputs=["Add"]), tmp_path / "e.onnx")
    meta = read_metadata(onnx.load(r.engine_path))
    assert meta["backend"] == "onnxruntime" and meta["plan"]["precision"] == "fp16"
    assert meta["layer_precisions"] == r.layer_precisions
    assert r.details["emulated"] is True and "rewrite_seconds" in r.details
    with backend.open(r.engine_path) as runner:
        assert [(s.name, s.shape) for s in runner.inputs] == [("x", (1, 1, 4, 4))]
        assert [s.name for s in runner.outputs] == ["y", "added"]
        out = runner.infer({"x": x.astype(np.float64)})  # same-kind input is cast
        assert set(out) == {"y", "added"}
        with pytest.raises(AgentError) as err:
            runner.infer({"z": x})
        assert err.value.code == "bad_argument"
    assert get_backend("onnxruntime").name == "onnxruntime"


def test_open_after_build_takes_the_session_that_checked_those_bytes(fp16_max, tmp_path):
    # A search opens each engine right after building it: the build's check session serves
    # once, for those exact bytes only (a copy elsewhere is fine, other bytes load anew).
    model, x = fp16_max
    backend = create(threads=1)
    r = build(backend, model, BuildPlan("fp16"), tmp_path / "a.onnx")
    checked = backend._checked[1]
    copy = tmp_path / "copy.onnx"
    copy.write_bytes(open(r.engine_path, "rb").read())  # the engine cache moves it
    with backend.open(str(copy)) as runner:
        assert runner.session is checked and backend._checked is None
        expected = runner.infer({"x": x})
    with backend.open(str(copy)) as runner:  # served once: loaded anew
        assert runner.session is not checked
        np.testing.assert_array_equal(runner.infer({"x": x})["y"], expected["y"])
    build(backend, model, BuildPlan("fp32"), tmp_path / "b.onnx")
    other = backend._checked[1]
    with backend.open(r.engine_path) as runner:  # other bytes: loaded, the slot emptied
        assert runner.session is not other and runner.session is not checked
    assert backend._checked is None


# -- int8: a classifier trained on real data ----------------------------------------------------

@pytest.fixture(scope="module")
def fp32_accuracy(backend, digits):
    r = build(backend, digits["model"], BuildPlan("fp32"), digits["dir"] / "fp32.onnx")
    return top1(backend, r.engine_path, digits)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_int8_accuracy_within_two_points(backend, digits, fp32_accuracy, algorithm, tmp_path,
                                         record_property, capsys):
    calls = []
    plan = BuildPlan("int8", calibration=CalibrationSettings(digits["calib"], algorithm, 32))
    r = build(backend, digits["model"], plan, tmp_path / "int8.onnx",
              progress=lambda stage, done, total: calls.append((stage, done, total)))
    assert r.calibrated and r.calibration_cache is None
    assert r.layer_precisions == {"fc0": "int8", "relu0": "float32", "fc1": "int8",
                                  "relu1": "float32", "fc_out": "int8"}
    assert ("calibrating", 16, 16) in calls and ("building", 1, 1) in calls
    accuracy = top1(backend, r.engine_path, digits)
    record_property("int8_top1_" + algorithm, accuracy)
    with capsys.disabled():
        print("\n[digits] fp32 top-1 {:.2f}%  int8 {} top-1 {:.2f}%".format(
            fp32_accuracy, algorithm, accuracy))
    assert abs(accuracy - fp32_accuracy) <= 2.0
    # really quantized: the logits move, the engine holds Q/DQ
    engine = onnx.load(r.engine_path)
    assert sum(1 for n in engine.graph.node if n.op_type == "QuantizeLinear") == 3
    fp32 = run(backend, str(digits["dir"] / "fp32.onnx"), {"input": digits["x"]})["logits"]
    int8 = run(backend, r.engine_path, {"input": digits["x"]})["logits"]
    assert 0 < np.abs(int8 - fp32).max() < 0.25 * np.abs(fp32).max()


def test_best_is_int8_with_fp16_fallback(backend, digits, fp32_accuracy, tmp_path):
    plan = BuildPlan("best", layer_precisions={"fc_out": "float32"},
                     calibration=CalibrationSettings(digits["calib"], "minmax", 64))
    r = build(backend, digits["model"], plan, tmp_path / "best.onnx")
    assert r.layer_precisions == {"fc0": "int8", "relu0": "float16", "fc1": "int8",
                                  "relu1": "float16", "fc_out": "float32"}
    assert abs(top1(backend, r.engine_path, digits) - fp32_accuracy) <= 2.0


def test_calibration_cache_skips_calibration_next_time(backend, digits, tmp_path):
    cache = str(tmp_path / "digits.cache")
    plan = BuildPlan("int8", calibration=CalibrationSettings(digits["calib"], "entropy2", 32,
                                                             cache=cache))
    first = build(backend, digits["model"], plan, tmp_path / "a.onnx")
    assert first.calibrated and first.calibration_cache == cache
    parsed = read_cache(cache)
    assert parsed.header == "TRT-100300-EntropyCalibration2"
    assert {"input", "fc0.out", "relu0.out", "logits"} <= set(parsed.scales)
    calls = []
    second = build(backend, digits["model"], plan, tmp_path / "b.onnx",
                   progress=lambda stage, done, total: calls.append(stage))
    assert not second.calibrated and second.calibration_cache == cache
    assert "calibrating" not in calls
    a = run(backend, first.engine_path, {"input": digits["x"]})["logits"]
    b = run(backend, second.engine_path, {"input": digits["x"]})["logits"]
    assert np.array_equal(a, b)

    # Only the cache is needed now, and one written for TensorRT 8.6 serves the host too.
    only_cache = BuildPlan("int8", calibration=CalibrationSettings(None, "entropy2",
                                                                   cache=cache))
    assert not build(backend, digits["model"], only_cache, tmp_path / "c.onnx").calibrated
    old = str(tmp_path / "trt86.cache")
    write_cache(old, parsed.amax, "entropy2", "8.6.1")
    plan86 = BuildPlan("int8", calibration=CalibrationSettings(None, "entropy2", cache=old))
    c = build(backend, digits["model"], plan86, tmp_path / "d.onnx")
    assert c.details["calibration_cache_version"] == "8.6.1"

    # A cache for another algorithm is refused.
    other = BuildPlan("int8", calibration=CalibrationSettings(digits["calib"], "minmax", 32,
                                                              cache=cache))
    with pytest.raises(AgentError) as err:
        build(backend, digits["model"], other, tmp_path / "e.onnx")
    assert err.value.code == "calibration_cache_mismatch"
    assert "EntropyCalibration2" in err.value.message and "MinMaxCalibration" in err.value.message


def test_fixed_batch_model_calibrates_from_polygraphy_inputs(backend, fp16_max, tmp_path):
    """The FP16_MAX model has a fixed batch of 1: calibration uses batch 1 whatever was asked;
    the data is a Polygraphy --save-inputs file."""
    model, x = fp16_max
    feeds = []
    for k in range(3):
        buf = io.BytesIO()
        np.save(buf, x + 0.1 * k)
        feeds.append({"x": {"array": base64.b64encode(buf.getvalue()).decode(),
                            "polygraphy_class": "ndarray"}})
    (tmp_path / "inputs.json").write_text(json.dumps(feeds))
    plan = BuildPlan("int8", calibration=CalibrationSettings(str(tmp_path / "inputs.json"),
                                                             "minmax", 8))
    r = build(backend, model, plan, tmp_path / "int8.onnx")
    assert r.details["calibration_batch_size"] == 1 and r.details["calibration_samples"] == 3
    assert r.layer_precisions["MatMul_0"] == "int8" and r.layer_precisions["Add"] == "float32"
    assert np.all(np.isfinite(run(backend, r.engine_path, {"x": x})["y"]))


# -- bad input ---------------------------------------------------------------------------------

def code(fn):
    with pytest.raises(AgentError) as err:
        fn()
    return err.value


def test_bad_models_and_layers(backend, fp16_max, tmp_path):
    model, _ = fp16_max
    data = open(model, "rb").read()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    (tmp_path / "text.onnx").write_text("this is not a model")
    for name in ("cut.onnx", "text.onnx"):
        err = code(lambda name=name: backend.build(str(tmp_path / name), BuildPlan("fp16"),
                                                   str(tmp_path / "e")))
        assert err.code == "bad_model" and "expected" in err.message
    assert not os.path.exists(str(tmp_path / "e"))
    err = code(lambda: backend.build(model, BuildPlan("fp16", layer_precisions={"add": "float32"}),
                                     str(tmp_path / "e")))
    assert err.code == "unknown_layer" and "'add'" in err.message
    err = code(lambda: backend.build(model, BuildPlan("fp32", shapes={"y": ((1,), (1,), (1,))}),
                                     str(tmp_path / "e")))
    assert err.code == "bad_argument"
    err = code(lambda: backend.open(str(tmp_path / "text.onnx")))
    assert err.code == "bad_engine"


def test_bad_calibration_input(backend, digits, tmp_path):
    def attempt(settings):
        return code(lambda: backend.build(digits["model"], BuildPlan("int8", calibration=settings),
                                          str(tmp_path / "e")))

    assert attempt(None).code == "bad_argument"
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    np.save(str(wrong / "input.npy"), np.zeros((8, 63), np.float32))
    err = attempt(CalibrationSettings(str(wrong)))
    assert err.code == "bad_calibration_data" and "[?, 64]" in err.message
    np.save(str(wrong / "input.npy"), np.zeros((8, 64), np.complex64))
    assert attempt(CalibrationSettings(str(wrong))).code == "bad_calibration_data"
    named = tmp_path / "named"
    named.mkdir()
    np.savez(str(named / "s.npz"), image=np.zeros((8, 64), np.float32))
    err = attempt(CalibrationSettings(str(named)))
    assert err.code == "bad_calibration_data" and "'image'" in err.message
    empty = tmp_path / "empty"
    empty.mkdir()
    assert attempt(CalibrationSettings(str(empty))).code == "empty_calibration_data"
    bad_cache = tmp_path / "bad.cache"
    bad_cache.write_text("TRT-100300-EntropyCalibration2\ninput 3c010a14\n")
    assert attempt(CalibrationSettings(digits["calib"], cache=str(bad_cache))).code == \
        "bad_calibration_cache"
    assert attempt(CalibrationSettings(None, cache=str(tmp_path / "none.cache"))).code == \
        "file_not_found"
    foreign = tmp_path / "foreign.cache"  # made for another network: no tensor name matches
    foreign.write_text("TRT-100300-EntropyCalibration2\n(Unnamed Layer* 0) [Constant]_output: "
                       "3c010a14\n")
    err = attempt(CalibrationSettings(None, cache=str(foreign)))
    assert err.code == "calibration_cache_mismatch" and "'input'" not in err.message
    assert "input" in err.message and "(Unnamed Layer* 0)" in err.message
    assert not os.path.exists(str(tmp_path / "e"))


def test_calibration_slices_large_batches_with_the_same_ranges(backend, digits, tmp_path,
                                                               monkeypatch):
    # A dynamic batch is fed in slices whose activations fit RUN_BYTES: the ranges are those
    # of whole batches (minmax: exactly).
    from agent.engines.backends import onnxruntime_calibration as ort_backend

    def ranges(name):
        cache = str(tmp_path / (name + ".cache"))
        plan = BuildPlan("int8", calibration=CalibrationSettings(digits["calib"], "minmax", 64,
                                                                 cache=cache))
        build(backend, digits["model"], plan, tmp_path / (name + ".onnx"))
        return read_cache(cache).amax

    whole = ranges("whole")
    monkeypatch.setattr(ort_backend, "RUN_BYTES", 1)  # one sample per run
    assert ranges("sliced") == whole
