"""Explicitly quantized (Q/DQ) models end to end, on both real quantizers' output
(``tests/qdq_models.py``): detected at intake, built without calibration on the host backend
(onnxruntime runs the pairs natively, nothing rounded around them) and under every TensorRT
profile of the fake (INT8 flag without a calibrator up to 10.11, strongly typed from 10.12),
labelled ``int8 (explicit)`` in the build output, meta.json and DeepStream's network-mode, and
left out of the precision search's candidates. ``--explicit-int8`` puts our own calibration
into the graph as Q/DQ on TensorRT >= 10.1."""

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from agent.device.handoff.base import ModelVersion
from agent.device.handoff.deepstream import property_keys
from agent.device.models import meta as model_meta
from agent.engines.backends import onnx_model, quantization, tensorrt_network
from agent.engines.backends.base import BuildPlan, CalibrationSettings
from agent.engines.backends.onnxruntime import create as create_ort
from agent.engines.backends.tensorrt_plan import builder_settings
from agent.errors import AgentError
from agent.precision.searcher import _candidates
from tests import fake_trt, qdq_models
from tests.trt_builds import build as trt_build
from tests.trt_builds import engine_precisions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUANTIZERS = ("onnxruntime", "modelopt")
EXPECTED = {"onnxruntime": "explicit", "modelopt": "mixed"}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("qdq")
    src = qdq_models.source_model(root / "cls.onnx")
    calib = root / "calib.npz"
    np.savez(str(calib), **{qdq_models.INPUT: np.concatenate(
        [f[qdq_models.INPUT] for f in qdq_models.feeds()])})
    return {"root": root, "float": src, "calib": str(calib), "models": {}}


def qdq(work, quantizer):
    """The Q/DQ model of ``quantizer`` (made once per module)."""
    models = work["models"]
    if quantizer not in models:
        dst = work["root"] / "cls_{}.onnx".format(quantizer)
        if quantizer == "onnxruntime":
            models[quantizer] = qdq_models.onnxruntime_qdq(work["float"], dst)
        else:  # what ModelOpt made of the same model (tests/qdq_models.py)
            models[quantizer] = qdq_models.modelopt_fixture(dst)
    return models[quantizer]


@pytest.fixture(autouse=True)
def _fresh_logger(monkeypatch):
    monkeypatch.setattr(tensorrt_network, "_LOGGER", None)


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_quantization_is_read_off_the_graph(work, quantizer):
    assert quantization.quantization(onnx_model.load_model(work["float"])) == "none"
    model = onnx_model.load_model(qdq(work, quantizer))
    assert quantization.quantization(model) == EXPECTED[quantizer]
    layers = quantization.int8_layers(model)
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    assert set(convs) & layers  # the quantized convolutions
    if quantizer == "modelopt":
        assert set(convs) - layers  # the ones it left in float
    assert not any(n.op_type in quantization.QDQ_OPS for n in model.graph.node
                   if n.name in layers)


def test_modelopt_still_makes_the_model_the_suite_reads(work):
    """The kept ModelOpt model is what ModelOpt makes today (skipped where it is not
    installed: requirements-modelopt.txt)."""
    made = onnx_model.load_model(qdq_models.modelopt_qdq(work["float"],
                                                         work["root"] / "fresh_mo.onnx"))
    kept = onnx_model.load_model(qdq(work, "modelopt"))
    assert [(n.op_type, n.name) for n in made.graph.node] == [
        (n.op_type, n.name) for n in kept.graph.node]
    assert quantization.int8_layers(made) == quantization.int8_layers(kept)


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_host_builds_run_the_pairs_as_written(work, quantizer, tmp_path):
    """Every precision builds without calibration data; fp16 rounds only the layers outside
    the pairs (no Cast around a Q/DQ node) and says how many run in int8."""
    path = qdq(work, quantizer)
    model = onnx_model.load_model(path)
    layers = quantization.int8_layers(model)
    backend = create_ort()
    source_qdq = sum(1 for n in model.graph.node if n.op_type in quantization.QDQ_OPS)
    feed = qdq_models.feeds(1, seed=3)[0]
    outputs = {}
    for precision in ("fp32", "fp16", "int8", "best"):
        result = backend.build(path, BuildPlan(precision=precision),
                               str(tmp_path / "{}.onnx".format(precision)))
        assert result.precision == "int8 (explicit)"
        assert result.details["quantization"] == EXPECTED[quantizer]
        assert not result.calibrated and result.calibration_cache is None
        counts = result.details["counts"]
        assert counts["int8"] == len(layers)
        rest = "float16" if precision in ("fp16", "best") else "float32"
        assert counts[rest] == len(result.layer_precisions) - len(layers) > 0
        engine = onnx.load(result.engine_path)
        pairs = [n for n in engine.graph.node if n.op_type in quantization.QDQ_OPS]
        assert len(pairs) == source_qdq  # none added (never quantized twice), none removed
        dequantized = {o for n in pairs if n.op_type == "DequantizeLinear" for o in n.output}
        # What a pair dequantizes reaches its int8 layer as it is: no fp16 rounding between.
        assert not [n.name for n in engine.graph.node
                    if n.op_type == "Cast" and set(n.input) & dequantized]
        with backend.open(result.engine_path) as runner:
            outputs[precision] = list(runner.infer(feed).values())[0]
    assert np.array_equal(outputs["fp32"], outputs["int8"])
    assert np.abs(outputs["fp16"] - outputs["fp32"]).max() < 0.1  # the fp16 rest: close


def test_build_and_compare_cli_of_a_qdq_model(work, tmp_path):
    env = dict(os.environ, JETSON_AGENT_STATE_DIR=str(tmp_path), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "agent", "build", qdq(work, "onnxruntime"),
                           "--fp16", "--backend", "onnxruntime", "--save-engine",
                           str(tmp_path / "cls.engine")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "precision:   int8 (explicit)" in proc.stdout
    layers = [line for line in proc.stdout.splitlines() if line.startswith("layers:")][0]
    assert " int8 (explicit)" in layers and "float16" in layers
    meta = json.loads((tmp_path / "cls.engine.json").read_text())
    assert (meta["precision"], meta["quantization"]) == ("int8 (explicit)", "explicit")
    proc = subprocess.run([sys.executable, "-m", "agent", "compare", qdq(work, "onnxruntime"),
                           "--fp16", "--backend", "onnxruntime", "--atol", "0.1"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "jetson-agent[onnxruntime int8 (explicit) + fp16, emulated]" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "agent", "build", work["float"], "--int8",
                           "--backend", "onnxruntime"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--calib" in proc.stderr  # a float model still needs it


@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_the_search_keeps_the_pairs_fixed(work, quantizer):
    model = onnx_model.load_model(qdq(work, quantizer))
    fixed = quantization.explicit_nodes(model)
    for precision in ("fp16", "int8", "best"):
        candidates = _candidates(model, BuildPlan(precision=precision), "float32")
        assert not set(candidates) & fixed
        assert bool(candidates) == (precision != "int8")  # int8: the rest is float32 already


@pytest.mark.parametrize("profile", fake_trt.PROFILES)
@pytest.mark.parametrize("quantizer", QUANTIZERS)
def test_device_builds_of_qdq_models_on_every_profile(monkeypatch, tmp_path, work, profile,
                                                      quantizer):
    """INT8 flag without a calibrator on 8.x - 10.11 (fp32 and fp16 builds too), strongly
    typed from 10.12; an int8 build given calibration data never calibrates."""
    model = onnx_model.load_model(qdq(work, quantizer))
    layers = quantization.int8_layers(model)
    calib = CalibrationSettings(data=work["calib"], batch_size=1)
    for precision, calibration in (("fp16", None), ("int8", calib)):
        plan = BuildPlan(precision=precision, calibration=calibration)
        _, result, trt, _ = trt_build(monkeypatch, tmp_path, profile, plan, model=model,
                                      engine="{}.engine".format(precision))
        built = trt._driver.builds[-1]
        flags = set(f.split(".")[-1] for f in built["flags"])
        assert result.precision == "int8 (explicit)"
        assert not result.calibrated and "calibration" not in result.details
        if result.details["strongly_typed"]:
            assert not flags & {"INT8", "FP16"}
        else:
            assert "INT8" in flags and ("FP16" in flags) == (precision == "fp16")
        if fake_trt.load_profile(profile)["inspector"]:
            assert {n for n, p in result.layer_precisions.items() if p == "int8"} >= layers
        assert result.mismatches == []
        engine = engine_precisions(trt)
        assert all(engine[name] in ("INT8", "Int8", "int8") for name in layers
                   if name in engine)


def test_a_weakly_typed_fp32_build_of_a_qdq_model_sets_int8():
    from agent.engines.backends.tensorrt_plan import parse_version

    for version in ("8.0.1", "8.6.1", "10.3.0"):
        settings = builder_settings(BuildPlan(precision="fp32"), parse_version(version),
                                    "explicit")
        assert "INT8" in settings.set_flags and settings.int8_source is None
        settings = builder_settings(BuildPlan(precision="best"), parse_version(version),
                                    "mixed")
        assert {"INT8", "FP16"} <= set(settings.set_flags) and settings.int8_source is None


def test_explicit_int8_puts_our_calibration_into_the_graph(monkeypatch, tmp_path):
    """--explicit-int8: on 10.3 the strongly typed path (Q/DQ from our own ranges, measured
    on the device) instead of a calibrator; refused before 10.1."""
    from agent.engines.backends.tensorrt_plan import parse_version

    data = str(tmp_path / "calib.npz")
    np.savez(data, x=np.random.RandomState(0).rand(4, 1, 4, 4).astype(np.float32))
    calib = CalibrationSettings(data=data, batch_size=1, algorithm="minmax")
    plan = BuildPlan(precision="int8", calibration=calib, explicit_int8=True)
    with pytest.raises(AgentError) as err:
        builder_settings(plan, parse_version("8.6.1"))
    assert err.value.code == "unsupported_tensorrt" and "10.1" in err.value.message
    _, result, trt, _ = trt_build(monkeypatch, tmp_path, "10.3", plan)
    assert result.details["strongly_typed"] and result.calibrated
    assert result.layer_precisions["MatMul_0"] == "int8"
    assert any(layer["type"] == "QUANTIZE" for layer in trt._driver.builds[-1]["layers"])
    assert not any("INT8" in f for f in trt._driver.builds[-1]["flags"])
    assert BuildPlan.from_dict(plan.to_dict()).explicit_int8
    assert "explicit_int8" not in BuildPlan(precision="int8").to_dict()  # keys unchanged


def test_meta_json_and_deepstream_say_int8_explicit(tmp_path):
    meta = model_meta.build("cls", "1", "0" * 64, {"precision": "int8 (explicit)",
                                                   "quantization": "explicit", "io": {}},
                            {}, {}, None, 0.0, "committed", "0" * 64, 1)
    assert (meta["precision"], meta["quantization"]) == ("int8 (explicit)", "explicit")
    version = ModelVersion("cls", "1", str(tmp_path), str(tmp_path / "model.engine"), meta)
    keys = dict(property_keys(version))
    assert keys["network-mode"] == "1" and "int8-calib-file" not in keys


def test_a_deploy_job_of_a_qdq_model_through_the_daemon(controller, agent_factory, work):
    """int8 without a calibration artifact: built, activated, and recorded as int8 (explicit)
    in the job result, the device status and the version's meta.json."""
    from agent.wire import protocol

    agent = agent_factory().start()
    model = controller.add_artifact(qdq(work, "onnxruntime"))
    controller.send_job({"job_id": "qdq-1", "kind": "deploy", "artifacts": {"model": model},
                         "plan": {"precision": "int8"}, "bench": {"iterations": 3}})
    final = controller.wait_state("qdq-1", protocol.TERMINAL_STATES, timeout=120)
    assert final["state"] == "SUCCEEDED", (final, agent.log_tail())
    result = final["result"]
    assert (result["precision"], result["quantization"]) == ("int8 (explicit)", "explicit")
    assert result["calibrated"] is False
    controller.wait_for(lambda: any(e.get("precision") == "int8 (explicit)"
                                    for s in controller.device_status
                                    for e in s.get("active_engines") or []),
                        20, "status with the explicit engine")
    name = "sha-" + model["sha256"][:12]
    with open(os.path.join(agent.state_dir, "models", name, "current", "meta.json")) as f:
        meta = json.load(f)
    assert (meta["precision"], meta["quantization"]) == ("int8 (explicit)", "explicit")
    assert not controller.errors


@pytest.mark.slow  # ~20 s of search builds (the candidates alone: test_the_search_keeps_...)
def test_a_search_of_a_qdq_model_keeps_only_layers_outside_the_pairs(work, tmp_path):
    """fp16 of the rest (ModelOpt's: the convolutions it left in float, their BN, ...) fails
    the goldens (the model as quantized): the search keeps some layers outside the pairs,
    never a pair's."""
    from agent.engines.cache import EngineCache
    from agent.precision import golden
    from agent.precision.searcher import run_search

    path = qdq(work, "modelopt")
    backend = create_ort(threads=1)
    inputs = qdq_models.feeds(1, seed=5)
    goldens = golden.reference_outputs(path, inputs, backend)
    result = run_search(path, BuildPlan(precision="fp16"), inputs, goldens, backend,
                        EngineCache(str(tmp_path / "engines")), {"kind": "host", "gpu": "cpu"},
                        calibration_dir=str(tmp_path / "calibration"), max_evaluations=12)
    fixed = quantization.explicit_nodes(onnx_model.load_model(path))
    assert result.candidates and result.keep and not set(result.keep) & fixed


def test_a_qdq_model_is_refused_where_tensorrt_has_no_int8(monkeypatch, tmp_path, work):
    """A TX2 / Nano (platform_has_fast_int8 False): refused by name, whatever the precision."""
    trt, _ = fake_trt.install(monkeypatch, "8.2")
    monkeypatch.setattr(trt.Builder, "platform_has_fast_int8", False, raising=False)
    from agent.engines.backends import tensorrt as trt_backend

    backend = trt_backend.TensorRTBackend(trt.__version__)
    with pytest.raises(AgentError) as err:
        backend.build(qdq(work, "onnxruntime"), BuildPlan(precision="fp16"),
                      str(tmp_path / "e.engine"))
    assert err.value.code == "unsupported_precision" and "no fast INT8" in err.value.message
