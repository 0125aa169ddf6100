"""The tensorrt backend end to end against version-faithful fakes (``tests/fake_trt.py`` built
from ``tests/trt_profiles/*.json``: TensorRT 8.0, 8.2, 8.5, 8.6, 10.3, 10.13, 11.x) and a fake
pycuda: one test per defect of issue 11, under the profile where the defect shows, plus the
whole build -> open -> infer path on every profile. The defects met on the device (DLA,
calibration, the range engine, the runner's CUDA objects) are in test_tensorrt_on_device.py."""

import json

import numpy as np
import pytest
from onnx import TensorProto, helper

from agent.engines.backends import tensorrt_inspect, tensorrt_network
from agent.engines.backends.base import BuildPlan, CalibrationSettings
from agent.engines.backends.tensorrt_inspect import parse_engine_information
from agent.engines.backends.tensorrt_plan import builder_settings
from agent.errors import AgentError
from tests import fake_trt
from tests.trt_builds import build as _build
from tests.trt_builds import engine_precisions as _engine_precisions

NODES = ["MatMul_0", "Add", "Sub", "MatMul_1"]


@pytest.fixture(autouse=True)
def _fresh_logger(monkeypatch):
    monkeypatch.setattr(tensorrt_network, "_LOGGER", None)


# -- every profile: build, open, infer, close ----------------------------------------------

@pytest.mark.parametrize("profile", fake_trt.PROFILES)
def test_build_open_infer_on_every_profile(monkeypatch, tmp_path, profile):
    backend, result, trt, cuda = _build(monkeypatch, tmp_path, profile,
                                        BuildPlan(precision="fp32"))
    with backend.open(result.engine_path) as runner:
        assert [(s.name, s.dtype) for s in runner.inputs] == [("x", np.float32)]
        out = runner.infer({"x": np.ones((1, 1, 4, 4), np.float32)})
        assert out["y"].shape == (1, 1, 4, 4)
    inspector = fake_trt.load_profile(profile)["inspector"]
    if inspector:  # 8.2+: precisions read back from the inspector in the profile's JSON
        assert result.layer_precisions == {n: "float32" for n in NODES}
    assert result.mismatches == []


@pytest.mark.parametrize("profile", fake_trt.PROFILES)
def test_fp16_with_a_pinned_layer_on_every_profile(monkeypatch, tmp_path, profile):
    """The precision search's build: fp16 with Add and Sub kept in float32."""
    plan = BuildPlan(precision="fp16", layer_precisions={"Add": "float32", "Sub": "float32"},
                     precision_constraints="obey")
    _, result, trt, _ = _build(monkeypatch, tmp_path, profile, plan)
    if fake_trt.load_profile(profile)["inspector"]:
        assert result.layer_precisions["Add"] == result.layer_precisions["Sub"] == "float32"
        assert result.mismatches == []
    if not result.details["strongly_typed"]:  # weakly typed: the engine shows the pins
        precisions = _engine_precisions(trt)
        assert (precisions["Add"], precisions["MatMul_0"]) == ("FLOAT", "HALF")


def test_profiles_cite_their_sources():
    for name in fake_trt.PROFILES:
        profile = fake_trt.load_profile(name)
        assert profile["sources"] and profile["profile"] == name
        assert profile["version"].startswith(name.split(".x")[0])


# -- 1: nptype and np.bool (8.0 - 8.5 on NumPy >= 1.24), bf16/fp8 on 10/11 -----------------

def test_8_5_on_numpy_1_24_builds_and_runs(monkeypatch, tmp_path):
    """JetPack 5's Python 3.8 gets NumPy 1.24.4, where 8.5's trt.nptype raises."""
    backend, result, trt, _ = _build(monkeypatch, tmp_path, "8.5", BuildPlan(precision="fp16"),
                                     numpy_version="1.24.4")
    with pytest.raises(AttributeError):
        trt.nptype(trt.float32)  # the fake is faithful: the real one fails here too
    with backend.open(result.engine_path) as runner:
        assert runner.inputs[0].dtype == np.float32


def _bf16_model():
    nodes = [helper.make_node("Cast", ["x"], ["xf"], name="Cast_0", to=TensorProto.FLOAT),
             helper.make_node("Relu", ["xf"], ["y"], name="Relu_1")]
    graph = helper.make_graph(nodes, "bf16",
                              [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_bf16_input_is_a_clear_error_on_10_13(monkeypatch, tmp_path):
    with pytest.raises(AgentError) as err:
        _build(monkeypatch, tmp_path, "10.13", BuildPlan(precision="fp32"), _bf16_model())
    assert err.value.code == "unsupported_model"
    assert "'x'" in err.value.message and "bfloat16" in err.value.message


def test_jetpack_5_requirements_pin_numpy_below_1_24():
    from tests.unit.test_jetson_requirements import requirement_lines

    assert "numpy>=1.19,<1.24" in requirement_lines("requirements-jetson5.txt")


# -- 2: weak typing lowers every layer -----------------------------------------------------

@pytest.mark.parametrize("profile", ["8.6", "10.3"])
def test_fp32_plan_with_one_fp16_layer_keeps_the_others_fp32(monkeypatch, tmp_path, profile):
    plan = BuildPlan(precision="fp32", layer_precisions={"Add": "float16"},
                     precision_constraints="obey")
    _, result, trt, _ = _build(monkeypatch, tmp_path, profile, plan)
    assert _engine_precisions(trt) == {"MatMul_0": "FLOAT", "Add": "HALF", "Sub": "FLOAT",
                                       "MatMul_1": "FLOAT"}
    assert result.layer_precisions["Sub"] == "float32"
    assert result.mismatches == []
    assert any("pinned to float32" in n for n in result.details["notes"])


def test_mismatches_cover_layers_not_asked():
    got = {"MatMul_0": "float16", "Add": "float16", "Sub": "float32"}
    mismatches = tensorrt_inspect.precision_mismatches
    assert mismatches({"Add": "float16"}, got, "float32") == [("MatMul_0", "float32", "float16")]
    assert mismatches({"Add": "float16"}, got) == []  # int8 / best: any precision


def test_int8_with_fp16_layers_is_refused_when_weakly_typed():
    plan = BuildPlan(precision="int8", layer_precisions={"Add": "float16"},
                     calibration=CalibrationSettings("data"))
    with pytest.raises(AgentError) as err:
        builder_settings(plan, (8, 6, 1))
    assert err.value.code == "unsupported_precision" and "10.12" in err.value.message
    assert builder_settings(plan, (10, 13, 0)).strongly_typed  # typed: the graph says it


# -- 3: TensorRT 8.0.1 (JetPack 4.6) and older ---------------------------------------------

def test_8_0_uses_strict_types_for_constraints(monkeypatch, tmp_path):
    plan = BuildPlan(precision="fp16", layer_precisions={"Add": "float32", "Sub": "float32"},
                     precision_constraints="obey")
    _, result, trt, _ = _build(monkeypatch, tmp_path, "8.0", plan)
    assert "BuilderFlag.STRICT_TYPES" in trt._driver.builds[-1]["flags"]
    precisions = _engine_precisions(trt)
    assert precisions["Add"] == precisions["Sub"] == "FLOAT"
    assert precisions["MatMul_0"] == "HALF"
    assert any("STRICT_TYPES" in n for n in result.details["notes"])


def test_tensorrt_7_is_refused_with_the_minimum():
    with pytest.raises(AgentError) as err:
        builder_settings(BuildPlan(precision="fp16"), (7, 1, 3))
    assert err.value.code == "unsupported_tensorrt" and "8.0.1" in err.value.message


# -- 5: TensorRT 11 inspector JSON ------------------------------------------------------------

def test_11_inspector_json_is_read(monkeypatch, tmp_path):
    plan = BuildPlan(precision="fp32", mark_outputs=[])
    _, result, _, _ = _build(monkeypatch, tmp_path, "11.x", plan)
    assert result.layer_precisions == {n: "float32" for n in NODES}


def test_both_inspector_formats_parse():
    old = {"Layers": [{"Name": "Add", "Outputs": [{"Format/Datatype": "Row major linear FP16"}]}],
           "Bindings": ["x", "y"]}
    new = {"Layers": [{"Name": "Add", "Outputs": [{"Format": "Row major linear",
                                                   "Datatype": "Half"}]}],
           "I/O Tensors": ["x", "y"]}
    for doc in (old, new):
        assert [(layer.name, layer.precision)
                for layer in parse_engine_information(json.dumps(doc))] == [("Add", "float16")]
        assert tensorrt_inspect.engine_io_names(json.dumps(doc)) == ["x", "y"]


# -- 6: one logger ------------------------------------------------------------------------------

def test_build_error_messages_survive_a_live_runtime(monkeypatch, tmp_path):
    """TensorRT logs into the first logger while any builder/runtime lives: a build next to an
    open runner (or nested in the percentile path) must still see its messages."""
    backend, result, trt, _ = _build(monkeypatch, tmp_path, "10.3", BuildPlan(precision="fp32"))
    with backend.open(result.engine_path):
        trt._driver.fail_next = "Internal Error: no tactic for MatMul_1"
        with pytest.raises(AgentError) as err:
            backend.build(str(tmp_path / "m.onnx"), BuildPlan(precision="fp16"),
                          str(tmp_path / "f.engine"))
    assert err.value.code == "build_failed"
    assert "no tactic for MatMul_1" in err.value.message


# -- 7: Cast / Identity are not constrained --------------------------------------------------

def _cast_model():
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="Relu_0"),
             helper.make_node("Cast", ["r"], ["h"], name="Cast_1", to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["h"], ["f"], name="Cast_2", to=TensorProto.FLOAT),
             helper.make_node("Identity", ["f"], ["i"], name="Identity_3"),
             helper.make_node("Add", ["i", "i"], ["y"], name="Add_4")]
    graph = helper.make_graph(nodes, "casts",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("profile", ["8.5", "10.3"])
def test_casts_and_identities_are_not_constrained(monkeypatch, tmp_path, profile):
    plan = BuildPlan(precision="fp32", precision_constraints="obey",
                     layer_precisions={"Cast_1": "float32", "Identity_3": "float16",
                                       "Add_4": "float16"})
    _, result, trt, _ = _build(monkeypatch, tmp_path, profile, plan, _cast_model())
    precisions = _engine_precisions(trt)
    assert precisions["Cast_1"] == "HALF"  # the cast survives
    assert precisions["Add_4"] == "HALF" and precisions["Relu_0"] == "FLOAT"
    skipped = [name for name, _ in result.details["skipped_layers"]]
    assert skipped == ["Cast_1", "Identity_3"]


def test_casts_and_identities_are_not_candidates():
    from agent.engines.backends import layer_precisions

    assert layer_precisions.float_nodes(_cast_model()) == ["Relu_0", "Add_4"]


# -- settled by reading sources (docs/tensorrt.md) -------------------------------------------

def test_inspector_deserializes_after_the_builder_is_gone(monkeypatch, tmp_path):
    """2-4 GB boards: the builder, network and parsed weights are released before the engine
    is deserialized again for the inspector."""
    _, _, trt, _ = _build(monkeypatch, tmp_path, "8.6", BuildPlan(precision="fp16"))
    assert trt._driver.builders_at_deserialize == [0]


def test_calibrator_batch_size_is_one_for_explicit_batch(monkeypatch):
    from calib.calibrators import make_calibrator

    fake_trt.install(monkeypatch, "8.6")
    calibrator = make_calibrator("entropy2", None, 8, None, b"cache")
    assert calibrator.get_batch_size() == 1
    assert make_calibrator("minmax", None, 8, None, b"c", explicit_batch=False
                           ).get_batch_size() == 8


def test_one_logger_per_process_and_per_job_messages(monkeypatch):
    trt, _ = fake_trt.install(monkeypatch, "10.3")
    logger = tensorrt_network._make_logger()
    assert tensorrt_network._make_logger() is logger
    mark = logger.mark()
    for i in range(60):
        logger.log(trt.ILogger.Severity.WARNING, "w{}".format(i))
    logger.log(trt.ILogger.Severity.VERBOSE, "not kept")
    assert logger.since(mark) == ["w{}".format(i) for i in range(10, 60)]
    assert logger.since(logger.mark()) == []


def test_pinning_others_keeps_the_network_outputs_type(monkeypatch, tmp_path):
    """An fp16 plan with one int8 layer pins the rest to float16, but not the engine's I/O."""
    data = str(tmp_path / "calib.npz")
    np.savez(data, x=np.random.RandomState(0).rand(2, 1, 4, 4).astype(np.float32))
    plan = BuildPlan(precision="fp16", layer_precisions={"MatMul_0": "int8"},
                     precision_constraints="obey",
                     calibration=CalibrationSettings(data, "entropy2", batch_size=1))
    backend, result, trt, _ = _build(monkeypatch, tmp_path, "8.6", plan)
    precisions = _engine_precisions(trt)
    assert precisions == {"MatMul_0": "INT8", "Add": "HALF", "Sub": "HALF", "MatMul_1": "HALF"}
    with backend.open(result.engine_path) as runner:
        assert runner.outputs[0].dtype == np.float32


@pytest.mark.parametrize("profile", fake_trt.PROFILES)
def test_a_plan_without_workspace_gets_scratch_memory(monkeypatch, tmp_path, profile):
    """Issue 24 defect 1: before 8.4 TensorRT's default workspace is 0 bytes (NvInfer.h 8.0.1
    and 8.2.1), so without --workspace every tactic needing scratch memory was excluded."""
    _, _, trt, _ = _build(monkeypatch, tmp_path, profile, BuildPlan(precision="fp32"))
    workspace = trt._driver.builds[-1]["workspace"]
    assert workspace == "device memory" or workspace >= 16 << 20, workspace
    _, _, trt, _ = _build(monkeypatch, tmp_path, profile,
                          BuildPlan(precision="fp32", workspace_bytes=1 << 20), engine="w.engine")
    assert trt._driver.builds[-1]["workspace"] == 1 << 20
