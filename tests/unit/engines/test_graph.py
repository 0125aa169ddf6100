"""ONNX graph rewrites (agent/engines/backends/graph.py): structure only, no runtime."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.engines.backends import graph, layer_precisions, onnx_model
from agent.errors import AgentError
from tests.models import FP16_MAX, fp16_max_model, save


def mlp(opset=17):
    """x[N,8] -> Gemm(fc0) -> Relu -> MatMul(fc1, weights [8,4]) -> y; unnamed Relu."""
    rs = np.random.RandomState(0)
    inits = [
        numpy_helper.from_array(rs.randn(8, 8).astype(np.float32), "w0"),
        numpy_helper.from_array(rs.randn(8).astype(np.float32), "b0"),
        numpy_helper.from_array(rs.randn(8, 4).astype(np.float32), "w1"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "w0", "b0"], ["h"], name="fc0", transB=1),
        helper.make_node("Relu", ["h"], ["r"]),
        helper.make_node("MatMul", ["r", "w1"], ["y"], name="fc1"),
    ]
    g = helper.make_graph(nodes, "mlp",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def shape_model():
    """Float work mixed with shape arithmetic and a Constant."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Add", ["s", "s"], ["s2"], name="int_add"),
        helper.make_node("Constant", [], ["c"], name="const",
                         value=numpy_helper.from_array(np.array(2.0, np.float32))),
        helper.make_node("Mul", ["x", "c"], ["m"], name="mul"),
        helper.make_node("Relu", ["m"], ["r"], name="relu"),
        helper.make_node("Reshape", ["r", "s"], ["y"], name="reshape"),
    ]
    g = helper.make_graph(nodes, "shapes",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
                           helper.make_tensor_value_info("s2", TensorProto.INT64, [2])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def check(model):
    onnx.checker.check_model(model, full_check=True)  # strict type and shape inference
    return model


def ops(model):
    return [n.op_type for n in model.graph.node]


def producer(model, tensor):
    return next(n for n in model.graph.node if tensor in n.output)


def node(model, name):
    return next(n for n in model.graph.node if n.name == name)


# -- loading -----------------------------------------------------------------------------------

def test_load_names_nodes_and_rejects_bad_bytes(tmp_path):
    path = save(mlp(), tmp_path / "m.onnx")
    model = onnx_model.load_model(path)
    assert [n.name for n in model.graph.node] == ["fc0", "Relu_1", "fc1"]
    data = open(path, "rb").read()

    def load(raw):
        p = tmp_path / "bad.onnx"
        p.write_bytes(raw)
        with pytest.raises(AgentError) as err:
            onnx_model.load_model(str(p))
        return err.value

    for cut in (len(data) // 2, len(data) - 3, 7):
        err = load(data[:cut])
        assert err.code == "bad_model", cut
        assert "expected" in err.message and "found" in err.message
    err = load(b"")
    assert err.code == "bad_model" and "empty" in err.message
    err = load(b"<html>not a model</html>\n" * 4)
    assert err.code == "bad_model" and "text starting with" in err.message
    err = load(b"\x93NUMPY\x01\x00v\x00{'descr': '<f4'}")
    assert err.code == "bad_model" and ".npy" in err.message
    with pytest.raises(AgentError) as missing:
        onnx_model.load_model(str(tmp_path / "nope.onnx"))
    assert missing.value.code == "file_not_found"


def test_unknown_operator_is_unsupported(tmp_path):
    m = mlp()
    m.graph.node[1].op_type = "FancyRelu"
    with pytest.raises(AgentError) as err:
        onnx_model.load_model(save(m, tmp_path / "m.onnx"))
    assert err.value.code == "unsupported_model" and "FancyRelu" in err.value.message


def test_ensure_node_names_is_stable_and_unique():
    m = mlp()
    m.graph.node[2].name = "fc0"  # duplicate
    onnx_model.ensure_node_names(m)
    assert [n.name for n in m.graph.node] == ["fc0", "Relu_1", "fc0_2"]
    onnx_model.ensure_node_names(m)
    assert [n.name for n in m.graph.node] == ["fc0", "Relu_1", "fc0_2"]


def test_digest_and_specs():
    m = mlp()
    assert onnx_model.model_digest(m) == onnx_model.model_digest(m.SerializeToString())
    (spec,) = onnx_model.input_specs(m)
    assert spec.name == "x" and spec.shape == (None, 8) and spec.dtype == np.float32


# -- layers ------------------------------------------------------------------------------------

def test_float_nodes_skip_shape_constant_and_int_work():
    assert layer_precisions.float_nodes(shape_model()) == ["mul", "relu", "reshape"]
    assert layer_precisions.float_nodes(fp16_max_model()) == ["MatMul_0", "Add", "Sub", "MatMul_1"]


def test_resolve_precisions():
    m = onnx_model.ensure_node_names(mlp())
    a, mism, ignored = layer_precisions.resolve_precisions(m, "best", {"Relu_1": "int8"})
    assert a == {"fc0": "int8", "Relu_1": "float16", "fc1": "int8"}
    assert mism == [("Relu_1", "int8", "float16")] and ignored == []
    a, mism, _ = layer_precisions.resolve_precisions(m, "int8", {"fc1": "float32"}, amax={"x": 1.0})
    assert a == {"fc0": "int8", "Relu_1": "float32", "fc1": "float32"}
    a, mism, _ = layer_precisions.resolve_precisions(m, "fp32", {"fc1": "int8"}, amax={})
    assert a["fc1"] == "float32" and mism == [("fc1", "int8", "float32")]
    with pytest.raises(AgentError) as err:
        layer_precisions.resolve_precisions(m, "fp16", {"Add": "float32"})
    assert err.value.code == "unknown_layer" and "'Add'" in err.value.message
    with pytest.raises(AgentError) as err:  # a typo: the near names come first
        layer_precisions.resolve_precisions(m, "fp16", {"fc_1": "float32"})
    assert "such as fc1, fc0" in err.value.message
    _, _, ignored = layer_precisions.resolve_precisions(
        onnx_model.ensure_node_names(shape_model()), "fp16", {"shape": "float32"})
    assert ignored == ["shape"]


# -- fp16 --------------------------------------------------------------------------------------

def test_emulated_fp16_rounds_inputs_outputs_and_weights():
    m = check(graph.to_fp16(fp16_max_model(), keep={"Add", "Sub"}))
    add, sub = node(m, "Add"), node(m, "Sub")
    # Add (fp32) reads MatMul_0's rounded output and the untouched fp32 constant.
    assert add.input[1] == "fp16_max"
    cast = producer(m, add.input[0])
    assert cast.op_type == "Cast" and add.input[0] == "flipped"
    # MatMul_1 (fp16) reads Sub's fp32 output through a Cast pair.
    mm1 = node(m, "MatMul_1")
    back = producer(m, mm1.input[0])
    down = producer(m, back.input[0])
    assert (back.op_type, down.op_type) == ("Cast", "Cast") and down.input[0] == sub.output[0]
    assert [a.i for a in down.attribute] == [TensorProto.FLOAT16]
    # The flip weights are replaced by a rounded fp32 copy; the graph output keeps its name.
    weights = {i.name for i in m.graph.initializer}
    assert "flip" not in weights and "fp16_max" in weights
    assert m.graph.output[0].name == "y" and producer(m, "y").op_type == "Cast"
    # every tensor stays fp32
    assert all(i.data_type == TensorProto.FLOAT for i in m.graph.initializer)


def test_emulated_fp16_weights_saturate():
    m = fp16_max_model()
    for init in m.graph.initializer:
        if init.name == "fp16_max":
            init.CopyFrom(numpy_helper.from_array(np.array(1e6, np.float32), "fp16_max"))
    out = graph.to_fp16(m, keep=set())
    values = [numpy_helper.to_array(i) for i in out.graph.initializer]
    assert any(v.shape == () and v == FP16_MAX for v in values)


def test_typed_fp16_computes_in_half_and_casts_at_boundaries():
    m = check(graph.to_fp16(fp16_max_model(), keep={"Add", "Sub"}, emulate=False))
    types = onnx_model.tensor_types(m)
    mm0, add, mm1 = node(m, "MatMul_0"), node(m, "Add"), node(m, "MatMul_1")
    assert types[mm0.output[0]] == TensorProto.FLOAT16
    assert types[add.input[0]] == TensorProto.FLOAT and types[add.output[0]] == TensorProto.FLOAT
    assert types[mm1.input[0]] == TensorProto.FLOAT16 and types[mm1.input[1]] == \
        TensorProto.FLOAT16
    assert types["y"] == TensorProto.FLOAT and types["x"] == TensorProto.FLOAT
    all_half = check(graph.to_fp16(fp16_max_model(), keep=set(), emulate=False))
    assert ops(all_half).count("Cast") == 2  # the input in, the output back


def test_typed_fp16_leaves_casts_and_resize_scales_alone():
    nodes = [
        helper.make_node("Cast", ["x"], ["xc"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Resize", ["xc", "", "scales"], ["y"], name="resize", mode="nearest"),
    ]
    g = helper.make_graph(nodes, "resize",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 2, 2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 4, 4])],
                          [numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32),
                                                   "scales")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    assignment, mism, _ = layer_precisions.resolve_precisions(m, "fp16", {"cast": "float16"},
                                                              emulate=False)
    assert assignment == {"cast": "float32", "resize": "float16"}
    assert mism == [("cast", "float16", "float32")]
    out = check(graph.apply_precisions(m, assignment, emulate=False))
    assert node(out, "resize").input[2] == "scales"


# -- int8 --------------------------------------------------------------------------------------

AMAX = {"x": 2.0, "h": 5.0, "r": 4.0, "y": 9.0}


def test_qdq_quantizes_activations_and_per_channel_weights():
    m = check(graph.to_qdq(onnx_model.ensure_node_names(mlp()), AMAX, keep=set()))
    fc0, fc1 = node(m, "fc0"), node(m, "fc1")
    q = producer(m, producer(m, fc0.input[0]).input[0])
    assert q.op_type == "QuantizeLinear" and q.input[0] == "x"
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    assert inits[q.input[1]] == np.float32(2.0 / 127)
    assert inits[q.input[2]].dtype == np.int8 and inits[q.input[2]] == 0
    # Gemm with transB: per output channel = axis 0 of w0; MatMul [K, N]: axis 1.
    for n, axis, channels in ((fc0, 0, 8), (fc1, 1, 4)):
        dq = producer(m, n.input[1])
        assert dq.op_type == "DequantizeLinear"
        assert [a.i for a in dq.attribute if a.name == "axis"] == [axis]
        assert inits[dq.input[0]].dtype == np.int8 and inits[dq.input[1]].shape == (channels,)
        assert np.abs(inits[dq.input[0]]).max() == 127
    assert fc0.input[2] == "b0"  # bias stays fp32
    assert "w0" not in inits and "w1" not in inits


def test_qdq_weights_dequantize_close_to_the_originals():
    m = graph.to_qdq(onnx_model.ensure_node_names(mlp()), AMAX, keep=set())
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    dq = producer(m, node(m, "fc1").input[1])
    w = inits[dq.input[0]].astype(np.float32) * inits[dq.input[1]][None, :]
    original = numpy_helper.to_array(mlp().graph.initializer[2])
    assert np.abs(w - original).max() <= np.abs(original).max(axis=0).max() / 127 / 2 + 1e-6


def test_qdq_keep_fp16_rest_and_old_opsets():
    base = onnx_model.ensure_node_names(mlp())
    kept = check(graph.to_qdq(base, AMAX, keep={"fc1"}))
    assert ops(kept).count("QuantizeLinear") == 1 and node(kept, "fc1").input[1] == "w1"
    best = check(graph.to_qdq(base, AMAX, keep=set(), fp16_rest=True))
    relu = node(best, "Relu_1")
    assert producer(best, relu.input[0]).op_type == "Cast"
    old = check(graph.to_qdq(onnx_model.ensure_node_names(mlp(opset=11)), AMAX, keep=set()))
    # Before opset 13 (no DequantizeLinear axis) emulation still quantizes weights per output
    # channel, as TensorRT does: the dequantized values become fp32 weights.
    assert not any(n.op_type == "DequantizeLinear" and n.input[0].startswith("w")
                   for n in old.graph.node)
    inits = {i.name: numpy_helper.to_array(i) for i in old.graph.initializer}
    w1 = inits[node(old, "fc1").input[1]]
    original = numpy_helper.to_array(mlp().graph.initializer[2])
    step = np.abs(original).max(axis=0) / 127
    assert w1.dtype == np.float32 and np.all(np.abs(w1 - original) <= step / 2 + 1e-6)
    typed = graph.to_qdq(onnx_model.ensure_node_names(mlp(opset=11)), AMAX, keep=set(),
                         emulate=False)
    assert all(not n.attribute for n in typed.graph.node if n.op_type == "DequantizeLinear")
    missing = graph.to_qdq(base, {"x": 1.0}, keep=set())  # no range for "r": fc1 stays fp32
    assert ops(missing).count("QuantizeLinear") == 1


def test_qdq_then_typed_fp16():
    m = check(graph.to_qdq(onnx_model.ensure_node_names(mlp()), AMAX, keep=set(), fp16_rest=True,
                           emulate=False))
    types = onnx_model.tensor_types(m)
    relu = node(m, "Relu_1")
    assert types[relu.output[0]] == TensorProto.FLOAT16


# -- outputs -----------------------------------------------------------------------------------

def test_mark_outputs():
    m = onnx_model.ensure_node_names(mlp())
    every = onnx_model.mark_outputs(m, ["*"])
    assert [o.name for o in every.graph.output] == ["y", "h", "r"]
    assert all(o.type.tensor_type.elem_type == TensorProto.FLOAT for o in every.graph.output)
    assert [o.name for o in onnx_model.mark_outputs(m, ["Relu_1"]).graph.output] == ["y", "r"]
    assert [o.name for o in onnx_model.mark_outputs(m, ["h", "y"]).graph.output] == ["y", "h"]
    assert [o.name for o in m.graph.output] == ["y"]  # the input model is untouched
    with pytest.raises(AgentError) as err:
        onnx_model.mark_outputs(m, ["nope"])
    assert err.value.code == "bad_argument"
    shapes = onnx_model.mark_outputs(onnx_model.ensure_node_names(shape_model()), ["*"])
    assert {o.name for o in shapes.graph.output} == {"y", "s2", "c", "m", "r"}
