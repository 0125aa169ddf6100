"""The tensorrt backend against version-faithful fakes (``tests/fake_trt.py``, a fake pycuda),
for the defects of issue 11 met on the device: DLA cores, calibration batches, the range engine
and the runner's CUDA objects."""

import gc

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.engines.backends import tensorrt as trt_backend
from agent.engines.backends import tensorrt_network
from agent.engines.backends.base import BuildPlan, CalibrationSettings
from agent.engines.backends.tensorrt_plan import builder_settings
from agent.errors import AgentError
from tests import fake_trt
from tests.models import fp16_max_model
from tests.trt_builds import build as _build
from tests.trt_builds import save as _save


@pytest.fixture(autouse=True)
def _fresh_logger(monkeypatch):
    monkeypatch.setattr(tensorrt_network, "_LOGGER", None)


# -- 4: DLA ----------------------------------------------------------------------------------

@pytest.mark.parametrize("profile", ["10.13"])  # 11.x is 11.4.1: DLA again (issue 34)
def test_dla_refused_where_tensorrt_has_none(monkeypatch, tmp_path, profile):
    with pytest.raises(AgentError) as err:
        _build(monkeypatch, tmp_path, profile, BuildPlan(precision="fp16", dla_core=0),
               num_dla_cores=2)
    assert err.value.code == "unsupported_precision"
    assert "reports 0 DLA core" in err.value.message and "<= 10.7" in err.value.message


def test_dla_core_checked_against_the_device(monkeypatch, tmp_path):
    with pytest.raises(AgentError) as err:
        _build(monkeypatch, tmp_path, "8.6", BuildPlan(precision="fp16", dla_core=1),
               num_dla_cores=1)
    assert err.value.code == "unsupported_precision"
    assert "reports 1 DLA core" in err.value.message


def test_fp32_on_dla_is_refused():
    with pytest.raises(AgentError) as err:
        builder_settings(BuildPlan(precision="fp32", dla_core=0), (8, 5, 2))
    assert err.value.code == "unsupported_precision" and "fp16 or int8" in err.value.message


def test_runner_runs_on_the_dla_core_it_was_built_for(monkeypatch, tmp_path):
    backend, result, trt, _ = _build(monkeypatch, tmp_path, "8.5",
                                     BuildPlan(precision="fp16", dla_core=1), num_dla_cores=2)
    assert result.details["dla_core"] == 1
    with backend.open(result.engine_path) as runner:
        assert runner.runtime.DLA_core == 1
        assert runner.engine.dla_core == 1


def test_dla_by_tensorrt_version_in_the_platform():
    from agent.platform import dla_available

    assert dla_available("8.5.2", "agx-orin") and dla_available("10.3.0", "orin-nx")
    assert not dla_available("10.13.0", "agx-orin")
    assert not dla_available("11.4.0", "agx-orin")
    assert dla_available("11.4.1", "agx-orin") and not dla_available("11.4.1", "orin-nx")


# -- 9: calibration feeds float32 ---------------------------------------------------------------

def _fp16_input_model():
    w = numpy_helper.from_array(np.ones((4, 4), np.float16), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="MatMul_0")]
    graph = helper.make_graph(nodes, "half",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 4])],
                              [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_calibration_batches_are_float32_for_float_inputs(monkeypatch, tmp_path):
    data = str(tmp_path / "calib.npz")
    np.savez(data, x=np.random.RandomState(0).rand(6, 4).astype(np.float16))
    trt, cuda = fake_trt.install(monkeypatch, "8.5")
    uploads = []
    monkeypatch.setattr(cuda, "memcpy_htod", lambda ptr, host: uploads.append(host.dtype))
    backend = trt_backend.TensorRTBackend(trt.__version__)
    plan = BuildPlan(precision="int8", calibration=CalibrationSettings(data, "entropy2",
                                                                       batch_size=2))
    result = backend.build(_save(_fp16_input_model(), tmp_path), plan, str(tmp_path / "e"))
    assert result.calibrated and uploads and set(uploads) == {np.dtype(np.float32)}


def _uint8_input_model():
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=TensorProto.FLOAT, name="Cast_0"),
             helper.make_node("Relu", ["xf"], ["y"], name="Relu_0")]
    graph = helper.make_graph(nodes, "bytes",
                              [helper.make_tensor_value_info("x", TensorProto.UINT8, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("profile", ["8.5", "8.6", "10.3"])
def test_calibration_batches_of_uint8_inputs_are_float32(monkeypatch, tmp_path, profile):
    """Issue 24 defect 2: uint8 / int8 inputs were uploaded in their own type, but TensorRT
    reads every non-index calibration input (all but float32, int32, int64, bool) as float32:
    it read four times the buffer's bytes. Profiles with calibrators and a UINT8 type."""
    from agent.engines.backends.base import TensorSpec
    from calib.calibrators import calibration_dtypes

    data = str(tmp_path / "calib.npz")
    np.savez(data, x=np.random.RandomState(0).randint(0, 255, (6, 4)).astype(np.uint8))
    trt, cuda = fake_trt.install(monkeypatch, profile)
    uploads = []
    monkeypatch.setattr(cuda, "memcpy_htod", lambda ptr, host: uploads.append(host.dtype))
    backend = trt_backend.TensorRTBackend(trt.__version__)
    plan = BuildPlan(precision="int8", calibration=CalibrationSettings(data, "entropy2",
                                                                       batch_size=2))
    result = backend.build(_save(_uint8_input_model(), tmp_path), plan, str(tmp_path / "e"))
    assert result.calibrated and uploads and set(uploads) == {np.dtype(np.float32)}
    kept = calibration_dtypes([TensorSpec(n, d, (2,)) for n, d in (
        ("i32", np.int32), ("i64", np.int64), ("b", np.bool_), ("i8", np.int8))])
    assert kept == {"i32": np.int32, "i64": np.int64, "b": np.bool_, "i8": np.float32}


# -- 10: stream and events freed while the context is current --------------------------------

@pytest.mark.parametrize("profile", ["8.2", "10.3"])
def test_runner_close_frees_stream_and_events_in_order(monkeypatch, tmp_path, profile):
    backend, result, _, cuda = _build(monkeypatch, tmp_path, profile,
                                      BuildPlan(precision="fp32"))
    runner = backend.open(result.engine_path)
    runner.infer({"x": np.ones((1, 1, 4, 4), np.float32)})
    assert runner.time_inference(2) == [1.0, 1.0]
    runner.close()
    del runner
    gc.collect()
    assert cuda.leaked == [] and cuda.live_objects == 0


def test_detection_drops_dla_cores_tensorrt_cannot_drive():
    from agent.platform import load_matrix
    from agent.platform.info import PlatformInfo
    from agent.platform.versions import _check_dla

    info = PlatformInfo(load_matrix())
    info.family, info.dla_cores, info.dla_source, info.tensorrt = "agx-orin", 2, "sysfs", "10.13.3"
    _check_dla(info)
    assert (info.dla_cores, info.dla_source) == (0, "tensorrt 10.13.3")
    assert "11.4.1" in info.problems[0]["fix"]
    info.dla_cores, info.tensorrt = 2, "10.3.0.30"
    _check_dla(info)
    assert info.dla_cores == 2


# -- the range engine marks outputs as Polygraphy's mark_layerwise does ----------------------

def _shape_model():
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="Relu_0"),
             helper.make_node("Shape", ["r"], ["s"], name="Shape_1"),
             helper.make_node("Reshape", ["r", "s"], ["y"], name="Reshape_2")]
    graph = helper.make_graph(nodes, "shape",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_mark_layerwise_skips_shape_and_constant_layers(monkeypatch):
    trt, _ = fake_trt.install(monkeypatch, "8.6")
    monkeypatch.setitem(__import__("sys").modules, "polygraphy", None)  # our own copy
    builder = trt.Builder(object())
    network = builder.create_network(1)
    trt.OnnxParser(network, None).parse(_shape_model().SerializeToString())
    assert tensorrt_network.mark_layerwise(trt, network) == ["y", "r"]


@pytest.mark.parametrize("profile", ["8.5", "10.3", "10.13", "11.x"])
def test_percentile_int8_through_the_range_engine(monkeypatch, tmp_path, profile):
    data = str(tmp_path / "calib.npz")
    np.savez(data, x=np.random.RandomState(0).rand(4, 1, 4, 4).astype(np.float32))
    plan = BuildPlan(precision="int8", calibration=CalibrationSettings(data, "percentile",
                                                                       batch_size=1))
    model = fp16_max_model()
    _, result, trt, _ = _build(monkeypatch, tmp_path, profile, plan, model)
    assert result.calibrated and result.details["calibration"] == "percentile"
    assert result.details["range_outputs"] == 4  # every layer's output, y included once
    assert [b["detailed"] for b in trt._driver.builds] == [True, True]


# -- issue 24 defect 7: the runner checks TensorRT's boolean answers ----------------------------

def _dynamic_relu_model():
    nodes = [helper.make_node("Relu", ["x"], ["y"], name="Relu_0")]
    graph = helper.make_graph(nodes, "dyn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("profile", fake_trt.PROFILES)
def test_a_shape_outside_the_profile_is_named_not_called_data_dependent(monkeypatch, tmp_path,
                                                                        profile):
    """``set_input_shape`` / ``set_binding_shape`` answer False for a shape outside the
    optimization profile; the runner ignored it and then called the unresolved output shape
    "data-dependent" (8.0 - 11: the bindings API on 8.0 / 8.2, tensor names from 8.5)."""
    plan = BuildPlan(precision="fp32", shapes={"x": ((1, 4), (2, 4), (4, 4))})
    backend, result, _, _ = _build(monkeypatch, tmp_path, profile, plan,
                                   model=_dynamic_relu_model())
    with backend.open(result.engine_path) as runner:
        assert runner.infer({"x": np.ones((3, 4), np.float32)})["y"].shape == (3, 4)
        with pytest.raises(AgentError) as err:
            runner.infer({"x": np.ones((8, 4), np.float32)})
    assert err.value.code == "bad_argument"
    assert "optimization profile" in str(err.value) and "[8, 4]" in str(err.value)
    assert "data-dependent" not in str(err.value)
