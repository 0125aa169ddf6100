"""What the tensorrt backend asks TensorRT for, without TensorRT: version branching, the
builder calls a plan makes on each TensorRT version and the layer constraints it sets (through
a recorded fake ``tensorrt`` namespace: the hardware boundary), and shape profiles."""

import types

import numpy as np
import pytest

from agent.engines.backends import tensorrt_network
from agent.engines.backends.base import BuildPlan, CalibrationSettings, TensorSpec
from agent.engines.backends.tensorrt_plan import (
    Features,
    apply_builder_settings,
    builder_settings,
    network_creation_flags,
    parse_version,
)
from agent.engines.backends.tensorrt_shapes import calibration_shapes, profile_shapes
from agent.errors import AgentError

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
