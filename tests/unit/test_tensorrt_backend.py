"""The tensorrt backend's GPU-free parts: version branching, the builder calls a plan makes on
each TensorRT version (through a recorded fake ``tensorrt`` namespace: the hardware boundary),
layer-name mapping, engine-inspector parsing, shapes, parser errors, caches, calibration feed."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from agent.engines.backends import tensorrt_caches, tensorrt_network
from agent.engines.backends.base import BuildPlan, CalibrationSettings, TensorSpec, get_backend
from agent.engines.backends.tensorrt_inspect import (
    layer_onnx_nodes,
    node_precisions,
    parse_engine_information,
    parser_error,
    precision_mismatches,
)
from agent.engines.backends.tensorrt_plan import (
    Features,
    apply_builder_settings,
    builder_settings,
    network_creation_flags,
    parse_version,
)
from agent.engines.backends.tensorrt_shapes import calibration_shapes, profile_shapes
from agent.errors import CODES, AgentError
from calib import cache as calib_cache
from calib.calibrators import BatchFeeder, read_cache_bytes, write_cache_bytes

TRT_82, TRT_86, TRT_103, TRT_1013 = (8, 2, 1), (8, 6, 1), (10, 3, 0), (10, 13, 0)


# -- a recorded fake of the tensorrt module: enums are (name, value) pairs ---------------------

class _Enum(object):
    def __init__(self, kind, **members):
        for name in sorted(members):
            setattr(self, name, (kind, name, members[name]))


def fake_trt():
    flags = {n: i for i, n in enumerate(
        ["FP16", "INT8", "TF32", "OBEY_PRECISION_CONSTRAINTS", "PREFER_PRECISION_CONSTRAINTS",
         "GPU_FALLBACK", "STRICT_TYPES"])}
    return types.SimpleNamespace(
        BuilderFlag=_Enum("BuilderFlag", **flags),
        MemoryPoolType=_Enum("MemoryPoolType", WORKSPACE=0),
        DeviceType=_Enum("DeviceType", GPU=0, DLA=1),
        ProfilingVerbosity=_Enum("ProfilingVerbosity", DETAILED=2),
        NetworkDefinitionCreationFlag=types.SimpleNamespace(EXPLICIT_BATCH=0, STRONGLY_TYPED=1),
        LayerType=_Enum("LayerType", CONVOLUTION=0, SHAPE=1, CONSTANT=2, ELEMENTWISE=3,
                        GATHER=4),
        float32="float32", float16="float16", int8="int8", int32="int32", bool="bool",
    )


class RecordingConfig(object):
    """Stands in for IBuilderConfig: records every call and attribute set, in order."""

    def __init__(self):
        object.__setattr__(self, "calls", [])

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name,) + tuple(a[1] if isinstance(a, tuple) else a for a in args))
        return call

    def __setattr__(self, name, value):
        self.calls.append(("set " + name, value[1] if isinstance(value, tuple) else value))


def calls_for(plan, version):
    trt = fake_trt()
    config = RecordingConfig()
    settings = builder_settings(plan, version)
    apply_builder_settings(trt, config, settings)
    return settings, config.calls, network_creation_flags(trt, settings)


# -- versions --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("8.2.1.8", (8, 2, 1)), ("8.6.1.6", (8, 6, 1)), ("10.3.0.30", (10, 3, 0)),
    ("10.12", (10, 12, 0)), ("11", (11, 0, 0)), (" 10.13.0.35 ", (10, 13, 0)),
])
def test_parse_version(text, want):
    assert parse_version(text) == want


def test_parse_version_refuses_garbage():
    with pytest.raises(AgentError) as err:
        parse_version("unknown")
    assert err.value.code == "backend_unavailable"
    assert "8.6.1" in err.value.message and "'unknown'" in err.value.message


@pytest.mark.parametrize("version,explicit_batch,pool,tensor_io,inspector,typed,implicit", [
    ((8, 2, 1), True, False, False, True, False, True),
    ((8, 4, 3), True, True, False, True, False, True),
    ((8, 5, 2), True, True, True, True, False, True),
    ((8, 6, 1), True, True, True, True, False, True),
    ((10, 3, 0), False, True, True, True, False, True),
    ((10, 11, 0), False, True, True, True, False, True),
    ((10, 12, 0), False, True, True, True, True, True),
    ((11, 0, 0), False, True, True, True, True, False),
])
def test_features_per_version(version, explicit_batch, pool, tensor_io, inspector, typed,
                              implicit):
    f = Features(version)
    assert (f.explicit_batch_flag, f.memory_pool_api, f.tensor_io_api, f.engine_inspector,
            f.strongly_typed, f.implicit_int8) == (explicit_batch, pool, tensor_io, inspector,
                                                   typed, implicit)


# -- the builder calls a plan makes ----------------------------------------------------------

FP16_PINNED = dict(precision="fp16", layer_precisions={"Add_1": "float32", "Sub_2": "float32"},
                   precision_constraints="obey", workspace_bytes=1 << 30)


def test_fp16_with_pinned_layers_on_trt_8_2():
    settings, calls, net_flags = calls_for(BuildPlan(**FP16_PINNED), TRT_82)
    assert net_flags == 1 << 0  # EXPLICIT_BATCH
    assert calls == [
        ("set_flag", "FP16"), ("set_flag", "OBEY_PRECISION_CONSTRAINTS"),
        ("clear_flag", "TF32"),
        ("set max_workspace_size", 1 << 30),  # no memory pools before 8.4
        ("set profiling_verbosity", "DETAILED"),
    ]
    assert settings.layer_constraints and not settings.strongly_typed


def test_fp16_with_pinned_layers_on_trt_8_6_uses_memory_pools():
    _, calls, net_flags = calls_for(BuildPlan(**FP16_PINNED), TRT_86)
    assert net_flags == 1 << 0
    assert ("set_memory_pool_limit", "WORKSPACE", 1 << 30) in calls
    assert not any(c[0] == "set max_workspace_size" for c in calls)


def test_fp16_with_pinned_layers_on_trt_10_3_drops_explicit_batch():
    settings, calls, net_flags = calls_for(BuildPlan(**FP16_PINNED), TRT_103)
    assert net_flags == 0
    assert [c for c in calls if c[0] == "set_flag"] == [
        ("set_flag", "FP16"), ("set_flag", "OBEY_PRECISION_CONSTRAINTS")]
    assert settings.layer_constraints


def test_fp16_with_pinned_layers_on_trt_10_13_is_strongly_typed():
    settings, calls, net_flags = calls_for(BuildPlan(**FP16_PINNED), TRT_1013)
    assert net_flags == 1 << 1  # STRONGLY_TYPED
    # Precision lives in the graph: no FP16 flag, no constraints, no per-layer precision.
    assert [c for c in calls if c[0] == "set_flag"] == []
    assert ("clear_flag", "TF32") in calls
    assert settings.strongly_typed and not settings.layer_constraints


@pytest.mark.parametrize("constraints,flag", [
    ("obey", "OBEY_PRECISION_CONSTRAINTS"), ("prefer", "PREFER_PRECISION_CONSTRAINTS"),
])
def test_exactly_one_constraints_flag(constraints, flag):
    plan = BuildPlan(precision="fp16", layer_precisions={"Add_1": "float32"},
                     precision_constraints=constraints)
    _, calls, _ = calls_for(plan, TRT_86)
    set_flags = [c[1] for c in calls if c[0] == "set_flag"]
    assert flag in set_flags
    assert len([f for f in set_flags if "CONSTRAINTS" in f]) == 1


def test_no_constraints_and_no_layers_sets_neither_flag():
    _, calls, _ = calls_for(BuildPlan(precision="fp16"), TRT_86)
    assert not any("CONSTRAINTS" in str(c) for c in calls)


def test_layer_precisions_without_constraints_imply_prefer():
    plan = BuildPlan(precision="fp16", layer_precisions={"Add_1": "float32"})
    settings, calls, _ = calls_for(plan, TRT_86)
    assert ("set_flag", "PREFER_PRECISION_CONSTRAINTS") in calls
    assert any("prefer" in n for n in settings.notes)


@pytest.mark.parametrize("algorithm,source", [
    ("entropy2", "calibrator"), ("minmax", "calibrator"), ("legacy", "calibrator"),
    ("percentile", "ranges"),
])
def test_int8_sources_before_10_12(algorithm, source):
    plan = BuildPlan(precision="int8", calibration=CalibrationSettings("data", algorithm))
    settings, calls, _ = calls_for(plan, TRT_103)
    assert settings.int8_source == source
    assert ("set_flag", "INT8") in calls and ("set_flag", "FP16") not in calls


def test_int8_from_10_12_is_qdq_in_the_graph():
    plan = BuildPlan(precision="int8", calibration=CalibrationSettings("data", "minmax"))
    settings, calls, _ = calls_for(plan, (10, 12, 0))
    assert settings.int8_source == "qdq"
    assert ("set_flag", "INT8") not in calls


def test_best_sets_fp16_int8_and_tf32():
    plan = BuildPlan(precision="best", calibration=CalibrationSettings("data"))
    _, calls, _ = calls_for(plan, TRT_86)
    assert [c[1] for c in calls if c[0] == "set_flag"] == ["FP16", "INT8", "TF32"]
    assert ("clear_flag", "TF32") not in calls


def test_fp32_clears_tf32_so_float32_stays_float32():
    _, calls, _ = calls_for(BuildPlan(precision="fp32"), TRT_86)
    assert [c for c in calls if "flag" in c[0]] == [("clear_flag", "TF32")]


def test_dla_core_with_gpu_fallback():
    _, calls, _ = calls_for(BuildPlan(precision="fp16", dla_core=1), TRT_86)
    assert ("set default_device_type", "DLA") in calls
    assert ("set DLA_core", 1) in calls
    assert ("set_flag", "GPU_FALLBACK") in calls


def test_before_8_2_there_is_no_inspector():
    settings, calls, _ = calls_for(BuildPlan(precision="fp16"), (8, 0, 1))
    assert not settings.detailed_profiling
    assert not any(c[0] == "set profiling_verbosity" for c in calls)
    assert any("inspector" in n for n in settings.notes)


# -- layer names -> ONNX node names ----------------------------------------------------------

NODES = ["Conv_0", "Relu_1", "Add_2", "Sub_3", "Gemm_4", "MatMul_5", "Softmax_6", "Mul_7",
         "/blocks.0/attn/MatMul", "Add_2_1"]


@pytest.mark.parametrize("layer,metadata,want", [
    ("Conv_0", "", ["Conv_0"]),
    ("Add_2_1", "", ["Add_2_1"]),  # an exact node name wins over a suffix reading
    ("Gemm_4_17", "", ["Gemm_4"]),  # an extra layer the parser made for Gemm_4
    ("Gemm_4_output", "", ["Gemm_4"]),
    ("Conv_0 + Relu_1", "", ["Conv_0", "Relu_1"]),
    ("PWN(PWN(Add_2, Sub_3), Mul_7)", "", ["Add_2", "Sub_3", "Mul_7"]),
    ("{ForeignNode[MatMul_5...Mul_7]}", "", ["MatMul_5", "Softmax_6", "Mul_7"]),
    ("{ForeignNode[Mul_7...MatMul_5]}", "", ["MatMul_5", "Softmax_6", "Mul_7"]),
    ("Conv_0 input reformatter 0", "", ["Conv_0"]),
    ("(Unnamed Layer* 12) [Shuffle]", "", []),
    ("Reformatting CopyNode for Input Tensor 0 to Conv_0", "", []),
    ("Cast__x_fp16 + Add_2", "", ["Add_2"]),  # a rewrite's Cast fused in: not a node
    ("/blocks.0/attn/MatMul", "", ["/blocks.0/attn/MatMul"]),
    # TensorRT 10 metadata names the nodes of a fused layer, whatever the layer is called.
    ("myelin_region_3", "[ONNX Layer: Gemm_4]\x1e[ONNX Layer: /blocks.0/attn/MatMul]",
     ["Gemm_4", "/blocks.0/attn/MatMul"]),
    # What follows the name (onnx-tensorrt): a doc string's lines (8.6), a local function (10).
    ("fused_1", "[ONNX Layer: Gemm_4\n  model.py(12): forward]\x1e"
     "[ONNX Layer: Mul_7 | Local Function: gelu]", ["Gemm_4", "Mul_7"]),
])
def test_layer_onnx_nodes(layer, metadata, want):
    assert layer_onnx_nodes(layer, NODES, metadata) == want


# -- engine inspector ------------------------------------------------------------------------

def _io(name, fmt):
    return {"Name": name, "Location": "Device", "Dimensions": [1, 8], "Format/Datatype": fmt}


# Shaped like TensorRT 8.6's get_engine_information(JSON) with ProfilingVerbosity.DETAILED.
ENGINE_INFO = {
    "Layers": [
        {"Name": "Reformatting CopyNode for Input Tensor 0 to Conv_0 + Relu_1",
         "LayerType": "Reformat", "Inputs": [_io("input", "Row major linear FP32")],
         "Outputs": [_io("r0", "Channel major FP16 format where channel % 8 == 0")]},
        {"Name": "Conv_0 + Relu_1", "LayerType": "CaskConvolution",
         "Inputs": [_io("r0", "Channel major FP16 format where channel % 8 == 0")],
         "Outputs": [_io("relu", "Channel major FP16 format where channel % 8 == 0")]},
        {"Name": "Add_2", "LayerType": "ElementWise", "Inputs": [_io("relu", "Half")],
         "Outputs": [_io("add", "Row major linear FP32")]},
        {"Name": "PWN(Sub_3)", "LayerType": "PointWiseV2", "Inputs": [_io("add", "Float")],
         "Outputs": [_io("sub", "Half")]},
        {"Name": "Gemm_4", "LayerType": "CaskGemmConvolution", "Inputs": [_io("sub", "Half")],
         "Outputs": [_io("gemm", "Four wide channel vectorized row major Int8 format")]},
        {"Name": "Gemm_4_9", "LayerType": "ElementWise", "Inputs": [_io("gemm", "Int8")],
         "Outputs": [_io("out", "Row major linear FP32")]},
    ],
    "Bindings": ["input", "out"],
}


def test_parse_engine_information_reads_each_layers_output_type():
    layers = parse_engine_information(json.dumps(ENGINE_INFO))
    assert [(layer.name, layer.precision) for layer in layers][1:] == [
        ("Conv_0 + Relu_1", "float16"), ("Add_2", "float32"), ("PWN(Sub_3)", "float16"),
        ("Gemm_4", "int8"), ("Gemm_4_9", "float32")]


def test_node_precisions_and_mismatches():
    got = node_precisions(parse_engine_information(json.dumps(ENGINE_INFO)), NODES)
    # Gemm_4 spans two layers (int8 and fp32): the lower precision is what it runs in.
    assert got == {"Conv_0": "float16", "Relu_1": "float16", "Add_2": "float32",
                   "Sub_3": "float16", "Gemm_4": "int8"}
    asked = {"Add_2": "float32", "Sub_3": "float32", "Conv_0": "float16", "Mul_7": "float32"}
    # Sub_3 was fused into fp16 despite the request; Mul_7 is not in the engine: no claim.
    assert precision_mismatches(asked, got) == [("Sub_3", "float32", "float16")]


def test_engine_information_without_detailed_profiling_has_no_precisions():
    layers = parse_engine_information(json.dumps({"Layers": ["Conv_0 + Relu_1", "Add_2"],
                                                  "Bindings": ["input", "out"]}))
    assert [layer.name for layer in layers] == ["Conv_0 + Relu_1", "Add_2"]
    assert node_precisions(layers, NODES) == {}
    assert parse_engine_information("not json") == []


# -- shapes ----------------------------------------------------------------------------------

DYNAMIC = [TensorSpec("x", np.float32, (None, 3, None, 8)), TensorSpec("k", np.int64, (2,))]


def test_dynamic_dims_without_a_profile_are_refused():
    with pytest.raises(AgentError) as err:
        profile_shapes(DYNAMIC, {})
    assert err.value.code == "dynamic_shape"
    assert "'x' [?, 3, ?, 8]" in err.value.message
    assert err.value.details == {"inputs": ["x"]}
    assert "x:1x3x1x8" in err.value.message  # an example in the input's own rank


def test_profile_shapes_checked_against_the_inputs():
    good = {"x": ((1, 3, 4, 8), (8, 3, 16, 8), (16, 3, 32, 8))}
    assert profile_shapes(DYNAMIC, good) == good
    for bad in ({"x": ((1, 3, 4), (8, 3, 16), (16, 3, 32))},  # rank
                {"x": ((1, 4, 4, 8), (8, 4, 16, 8), (16, 4, 32, 8))},  # static dim changed
                {"x": ((8, 3, 4, 8), (1, 3, 16, 8), (16, 3, 32, 8))},  # min > opt
                dict(good, y=((1,), (1,), (1,)))):  # not an input
        with pytest.raises(AgentError) as err:
            profile_shapes(DYNAMIC, bad)
        assert err.value.code == "bad_argument"


def test_calibration_shapes():
    profile = {"x": ((1, 3, 4, 8), (8, 3, 16, 8), (16, 3, 32, 8))}
    inputs = [DYNAMIC[0], TensorSpec("k", np.int64, (None, 2))]
    batch, shapes, notes = calibration_shapes(inputs, profile, 4)
    assert batch == 4 and shapes == {"x": (4, 3, 16, 8), "k": (4, 2)} and notes == []
    static = [TensorSpec("x", np.float32, (1, 3, 8, 8))]
    batch, shapes, notes = calibration_shapes(static, {}, 8)
    assert batch == 1 and shapes == {"x": (1, 3, 8, 8)}
    assert "replaced by the model's fixed batch size 1" in notes[0]
    # Samples are stacked on axis 0 of every input, so any fixed leading dimension decides.
    mixed = [TensorSpec("x", np.float32, (None, 3)), TensorSpec("k", np.int64, (2, 5))]
    assert calibration_shapes(mixed, {"x": ((1, 3), (4, 3), (8, 3))}, 8)[0] == 2


# -- parser errors ---------------------------------------------------------------------------

def test_parser_errors_classified():
    err = parser_error([("UNSUPPORTED_NODE", "No importer registered for op: FancyOp", "Fancy_3")],
                       "m.onnx")
    assert err.code == "unsupported_model"
    assert "FancyOp" in err.message and "Fancy_3" in err.message
    err = parser_error([("MODEL_DESERIALIZE_FAILED", "Failed to parse the ONNX model", "")],
                       "m.onnx")
    assert err.code == "bad_model" and "Failed to parse" in err.message
    assert parser_error([], "m.onnx").code == "bad_model"


# -- layer constraints on a network (recorded fake network) ----------------------------------

class FakeTensor(object):
    def __init__(self, dtype, shape_tensor=False):
        self.dtype = dtype
        self.is_shape_tensor = shape_tensor


class FakeLayer(object):
    def __init__(self, name, layer_type, out_dtype, shape_tensor=False):
        self.name = name
        self.type = layer_type
        self.outputs = [FakeTensor(out_dtype, shape_tensor)]
        self.num_outputs = 1
        self.precision = None
        self.output_types = {}

    def get_output(self, i):
        return self.outputs[i]

    def set_output_type(self, i, dtype):
        self.output_types[i] = dtype


class FakeNetwork(object):
    def __init__(self, layers):
        self.layers = layers
        self.num_layers = len(layers)

    def get_layer(self, i):
        return self.layers[i]


def test_apply_layer_precisions_skips_what_cannot_be_constrained():
    trt = fake_trt()
    lt = trt.LayerType
    layers = [
        FakeLayer("Conv_0", lt.CONVOLUTION, "float32"),
        FakeLayer("Shape_1", lt.SHAPE, "int32"),
        FakeLayer("Gather_2", lt.GATHER, "int32"),
        FakeLayer("Add_3", lt.ELEMENTWISE, "float32"),
        FakeLayer("Add_3_5", lt.ELEMENTWISE, "float32"),  # a second layer of Add_3
        FakeLayer("Mul_4", lt.ELEMENTWISE, "float32", shape_tensor=True),
    ]
    asked = {"Conv_0": "float32", "Shape_1": "float32", "Gather_2": "float32",
             "Add_3": "float16", "Mul_4": "float32"}
    applied, skipped = tensorrt_network.apply_layer_precisions(
        trt, FakeNetwork(layers), asked, ["Conv_0", "Shape_1", "Gather_2", "Add_3", "Mul_4"])
    assert applied == {"Conv_0": ["Conv_0"], "Add_3": ["Add_3", "Add_3_5"]}
    assert [s[0] for s in skipped] == ["Shape_1", "Gather_2", "Mul_4"]
    assert layers[0].precision == "float32" and layers[0].output_types == {0: "float32"}
    assert layers[3].precision == "float16" and layers[4].output_types == {0: "float16"}
    assert layers[1].precision is None and layers[2].output_types == {}


# -- caches ----------------------------------------------------------------------------------

def test_calibration_cache_header_tag_and_version_check(tmp_path):
    assert calib_cache.trt_version_tag("8.6.1.6") == "8601"
    assert calib_cache.trt_version_tag("8.2.1.8") == "8201"
    assert calib_cache.trt_version_tag("10.3.0.30") == "100300"
    path = str(tmp_path / "calib.cache")
    assert tensorrt_caches.existing_calibration_cache(path, "entropy2", "10.3.0.30") is None
    calib_cache.write_cache(path, {"input": 2.54, "conv": 12.7}, "entropy2", "10.3.0.30")
    with open(path) as f:
        assert f.readline().strip() == "TRT-100300-EntropyCalibration2"
    cache = tensorrt_caches.existing_calibration_cache(path, "entropy2", "10.3.0.30")
    assert cache.amax["conv"] == pytest.approx(12.7, rel=1e-6)
    with pytest.raises(AgentError) as err:  # another TensorRT: TensorRT would recalibrate
        tensorrt_caches.existing_calibration_cache(path, "entropy2", "8.6.1.6")
    assert err.value.code == "calibration_cache_mismatch" and "8601" in err.value.message
    with pytest.raises(AgentError) as err:  # another algorithm
        tensorrt_caches.existing_calibration_cache(path, "minmax", None)
    assert err.value.code == "calibration_cache_mismatch"
    # Scales used directly (Q/DQ, dynamic ranges) only need the algorithm to match.
    assert tensorrt_caches.existing_calibration_cache(path, "entropy2", None) is not None


def test_calibration_cache_bytes_round_trip(tmp_path):
    path = str(tmp_path / "sub" / "c.cache")
    assert read_cache_bytes(path) is None and read_cache_bytes(None) is None
    write_cache_bytes(path, memoryview(b"TRT-8601-EntropyCalibration2\nx: 3c010a14\n"))
    assert read_cache_bytes(path).startswith(b"TRT-8601-")


def test_timing_cache_path_under_the_state_dir(tmp_path):
    path = tensorrt_caches.timing_cache_path("8.6.2.3", "Orin (nvgpu)-sm87")
    assert path == str(tmp_path / "state" / "timing" / "8.6.2.3-Orin_nvgpu_-sm87.cache")


class FakeTimingCache(object):
    """ITimingCache stand-in: a set of entries, serialized one per line."""

    def __init__(self, data):
        if data.startswith(b"corrupt"):
            raise RuntimeError("Deserialization of timing cache failed")
        self.entries = set(line for line in data.decode().split("\n") if line)

    def combine(self, other, ignore_mismatch):
        assert ignore_mismatch is False
        self.entries |= other.entries
        return True

    def serialize(self):
        return "\n".join(sorted(self.entries)).encode()


class FakeTimingConfig(object):
    def __init__(self):
        self.cache = None
        self.ignore_mismatch = None

    def create_timing_cache(self, data):
        return FakeTimingCache(bytes(data))

    def set_timing_cache(self, cache, ignore_mismatch):
        self.cache, self.ignore_mismatch = cache, ignore_mismatch
        return True

    def get_timing_cache(self):
        return self.cache


def test_timing_cache_is_loaded_and_merged_with_what_is_on_disk(tmp_path):
    path = str(tmp_path / "timing" / "t.cache")
    first, second = FakeTimingConfig(), FakeTimingConfig()
    tensorrt_caches.TimingCache(path).attach(first)
    tensorrt_caches.TimingCache(path).attach(second)  # both builds start from an empty cache
    assert first.ignore_mismatch is False
    first.cache.entries.add("conv tactic A")
    second.cache.entries.add("gemm tactic B")
    tensorrt_caches.TimingCache(path).save(first)
    tensorrt_caches.TimingCache(path).save(second)  # merges with what the first one wrote
    with open(path, "rb") as f:
        assert f.read() == b"conv tactic A\ngemm tactic B"
    third = FakeTimingConfig()
    cache = tensorrt_caches.TimingCache(path)
    cache.attach(third)
    assert cache.loaded_bytes > 0 and third.cache.entries == {"conv tactic A", "gemm tactic B"}


def test_unreadable_timing_cache_is_ignored(tmp_path):
    path = tmp_path / "t.cache"
    path.write_bytes(b"corrupt bytes")
    config = FakeTimingConfig()
    cache = tensorrt_caches.TimingCache(str(path))
    cache.attach(config)
    assert cache.loaded_bytes == 0 and config.cache.entries == set()
    config.cache.entries.add("x")
    cache.save(config)  # the corrupt file is replaced, not merged
    assert path.read_bytes() == b"x"


# -- calibration feed (fake device buffers: the CUDA boundary) -------------------------------

class FakeDeviceBuffers(object):
    def __init__(self):
        self.uploads = []
        self.freed = False

    def upload(self, arrays, dtypes=None):
        self.uploads.append({n: np.asarray(a, dtype=(dtypes or {}).get(n, np.asarray(a).dtype))
                             for n, a in arrays.items()})
        return {n: 1000 * len(self.uploads) + i for i, n in enumerate(sorted(arrays))}

    def free(self):
        self.freed = True


def test_batch_feeder_order_end_and_errors():
    batches = [{"a": np.full((2, 3), k, np.float64), "b": np.full((2,), k)} for k in range(3)]
    buffers = FakeDeviceBuffers()
    progress = []
    feeder = BatchFeeder(batches, 2, {"a": np.float32}, buffers=buffers,
                         progress=lambda *p: progress.append(p), total=3)
    assert feeder.get_batch(["b", "a"]) == [1001, 1000]  # in the order TensorRT names them
    assert buffers.uploads[0]["a"].dtype == np.float32
    assert feeder.get_batch(["a", "b"]) is not None
    assert feeder.get_batch(["a", "b"]) is not None
    assert feeder.get_batch(["a", "b"]) is None and feeder.batches_fed == 3
    assert progress[-1] == ("calibrating", 3, 3)
    feeder.close()
    assert buffers.freed
    wrong = BatchFeeder([{"a": np.zeros((2, 4))}], 2, buffers=FakeDeviceBuffers(),
                        shapes={"a": (2, 3)})
    with pytest.raises(AgentError) as err:
        wrong.get_batch(["a"])
    assert "expected shape [2, 3] (the calibration profile), found [2, 4]" in err.value.message
    missing = BatchFeeder([{"a": np.zeros((2, 3))}], 2, buffers=FakeDeviceBuffers())
    with pytest.raises(AgentError) as err:
        missing.get_batch(["a", "b"])
    assert err.value.code == "bad_calibration_data" and "inputs a, b" in err.value.message


# -- no TensorRT here ------------------------------------------------------------------------

def test_imports_stay_light():
    """Importing the backend and the calibrators loads neither TensorRT nor pycuda (checked in
    a fresh interpreter: other tests in this process may have imported pycuda)."""
    code = ("import sys, agent.engines.backends.tensorrt, calib.calibrators,"
            " agent.engines.backends.cuda_buffers;"
            "print(sorted(m for m in ('tensorrt', 'pycuda') if m in sys.modules))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.check_output([sys.executable, "-c", code], cwd=root)
    assert out.decode().strip() == "[]"


def test_get_backend_without_tensorrt_is_backend_unavailable(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", None)  # import tensorrt -> ImportError
    with pytest.raises(AgentError) as err:
        get_backend("tensorrt")
    assert err.value.code == "backend_unavailable"
    assert "TensorRT" in err.value.message and "--backend onnxruntime" in err.value.message


def test_codes_used_are_registered():
    for code in ("backend_unavailable", "dynamic_shape", "unsupported_model", "bad_model",
                 "build_failed", "bad_engine", "unknown_layer", "calibration_cache_mismatch",
                 "bad_calibration_data", "unsupported_precision"):
        assert code in CODES
