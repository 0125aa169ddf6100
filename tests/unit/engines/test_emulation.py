"""TensorRT's build-time rewrites before emulated reduced precision
(agent.engines.backends.emulation)."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.engines.backends import emulation, graph, onnx_model
from agent.engines.backends.base import BuildPlan
from agent.engines.backends.onnxruntime import create


def conv_bn(opset=13, var=1e8, constant_stats=True):
    """x[1,3,8,8] -> Conv(4) -> BatchNormalization (huge running variance, statistics from
    Constant nodes) -> Relu -> y. Exact in fp32; a naive fp16 cast of the variance is inf."""
    rng = np.random.RandomState(0)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    stats = {"gamma": np.full(4, 2e3, np.float32), "beta": np.full(4, 0.5, np.float32),
             "mean": np.full(4, 0.1, np.float32), "var": np.full(4, var, np.float32)}
    nodes, inits = [], [numpy_helper.from_array(w, "w")]
    for name, value in stats.items():
        if constant_stats:
            nodes.append(helper.make_node("Constant", [], [name], name="const_" + name,
                                          value=numpy_helper.from_array(value, name)))
        else:
            inits.append(numpy_helper.from_array(value, name))
    nodes += [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["b"],
                         name="bn", epsilon=1e-5),
        helper.make_node("Relu", ["b"], ["y"], name="relu"),
    ]
    g = helper.make_graph(nodes, "conv_bn",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
                          inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(m)
    return m


def run(model_or_path, x):
    import onnxruntime as ort

    data = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) \
        else open(model_or_path, "rb").read()
    sess = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


X = np.random.RandomState(1).random_sample((1, 3, 8, 8)).astype(np.float32)


def test_constants_and_batch_norm_fold_into_the_conv_in_fp32():
    m = conv_bn()
    ref = run(m, X)
    folded, merged = emulation.prepare(onnx_model.copy_model(m))
    assert merged == {"bn": "conv"}
    assert [n.op_type for n in folded.graph.node] == ["Conv", "Relu"]
    assert np.allclose(run(folded, X), ref, rtol=1e-5, atol=1e-5)


def test_fp16_emulation_matches_a_device_not_the_naive_graph(tmp_path, monkeypatch):
    m = conv_bn()
    path = str(tmp_path / "m.onnx")
    onnx.save(m, path)
    ref = run(m, X)
    backend = create()

    def fp16(name):
        return run(backend.build(path, BuildPlan("fp16"), str(tmp_path / name)).engine_path, X)

    out = fp16("trt.onnx")
    assert np.isfinite(out).all() and np.allclose(out, ref, rtol=1e-2, atol=1e-2)
    monkeypatch.setenv(emulation.NAIVE_ENV, "1")
    assert backend.fingerprint()["emulation"] == "naive"
    naive = fp16("naive.onnx")  # the false alarm: the variance overflows fp16
    assert not np.allclose(naive, ref, rtol=1e-2, atol=1e-2)


def test_layer_precisions_on_a_folded_layer_apply_to_its_conv(tmp_path):
    path = str(tmp_path / "m.onnx")
    onnx.save(conv_bn(), path)
    plan = BuildPlan("fp16", layer_precisions={"bn": "float32"}, precision_constraints="obey")
    result = create().build(path, plan, str(tmp_path / "e.onnx"))
    assert result.layer_precisions["conv"] == "float32"
    assert result.layer_precisions["bn"] == "float32"
    assert result.details["folded_layers"] == {"bn": "conv"}


def test_standalone_batch_norm_keeps_its_name_with_fp16_friendly_statistics():
    m = conv_bn(constant_stats=False)
    # A second reader of the conv output stops the fold: the BN stays a scale layer.
    m.graph.node.append(helper.make_node("Sigmoid", ["c"], ["s"], name="other"))
    m.graph.output.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, [1, 4, 8, 8]))
    ref = run(m, X)
    folded, merged = emulation.prepare(onnx_model.copy_model(m))
    assert merged == {}
    bn = next(n for n in folded.graph.node if n.name == "bn")
    inits = {i.name: numpy_helper.to_array(i) for i in folded.graph.initializer}
    assert max(float(np.abs(inits[n]).max()) for n in bn.input[1:]) < 65504
    assert np.allclose(run(folded, X), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("opset", [11, 13])
def test_int8_weights_are_per_output_channel_whatever_the_opset(opset, monkeypatch):
    # A conv whose output channel 0 has weights 1000x smaller than the others, from a
    # Constant node: per tensor they round to zero, per channel they survive.
    w = np.random.RandomState(2).standard_normal((4, 3, 3, 3)).astype(np.float32)
    w[0] *= 1e-3
    g = helper.make_graph(
        [helper.make_node("Constant", [], ["w"], name="const_w",
                          value=numpy_helper.from_array(w, "w")),
         helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1, 1, 1, 1])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    ref = run(m, X)

    def channel0_error():
        prepared, _ = emulation.prepare(onnx_model.copy_model(m))
        # (Naively, Constant-node weights are an activation: quantized per tensor by range.)
        amax = {"x": 1.0, "w": float(np.abs(w).max())}
        out = run(graph.apply_precisions(prepared, {"conv": "int8"}, amax=amax), X)
        return np.abs(out[0, 0] - ref[0, 0]).max() / np.abs(ref[0, 0]).max()

    assert channel0_error() < 0.05
    if opset < 13:  # the naive emulation quantized these weights per tensor (if at all)
        monkeypatch.setenv(emulation.NAIVE_ENV, "1")
        assert channel0_error() > 0.5


def test_fused_activation_input_is_not_rounded():
    m, _ = emulation.prepare(conv_bn(var=1.0))
    assignment = {"conv": "float16", "relu": "float16"}
    assert emulation.fused_edges(m, assignment) == {"b"}
    q = graph.apply_precisions(m, assignment, emulate=True,
                               fused=emulation.fused_edges(m, assignment))
    relu = next(n for n in q.graph.node if n.name == "relu")
    assert relu.input[0] == "b"  # read straight from the conv, no Cast pair between


def test_int8_that_quantizes_nothing_says_so(tmp_path):
    from agent.engines.backends.base import CalibrationSettings

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "relu",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])])
    path = str(tmp_path / "relu.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), path)
    data = str(tmp_path / "calib.npz")
    np.savez(data, x=np.random.RandomState(0).random_sample((4, 4)).astype(np.float32))
    plan = BuildPlan("int8", calibration=CalibrationSettings(data=data, batch_size=2))
    result = create().build(path, plan, str(tmp_path / "e.onnx"))
    assert result.details["counts"]["int8"] == 0 and "no layer" in result.details["warning"]


def test_per_channel_mul_and_add_after_a_conv_fold_like_a_batch_norm():
    rng = np.random.RandomState(3)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    scale = rng.uniform(0.5, 2, (1, 4, 1, 1)).astype(np.float32)
    shift = rng.standard_normal((1, 4, 1, 1)).astype(np.float32)
    odd = np.ones((1, 1, 1, 1, 1), np.float32)  # would add a dimension: never folded
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Mul", ["c", "scale"], ["m"], name="mul"),
         helper.make_node("Add", ["shift", "m"], ["a"], name="add"),
         helper.make_node("Mul", ["a", "odd"], ["y"], name="odd_mul")],
        "affine", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(a, n) for a, n in ((w, "w"), (scale, "scale"),
                                                    (shift, "shift"), (odd, "odd"))])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    ref = run(m, X)
    folded, merged = emulation.prepare(onnx_model.copy_model(m))
    assert merged == {"mul": "conv", "add": "conv"}
    assert [n.name for n in folded.graph.node] == ["conv", "odd_mul"]
    assert np.allclose(run(folded, X), ref, rtol=1e-5, atol=1e-5)


def test_folded_and_fused_nodes_are_one_search_candidate(monkeypatch):
    from agent.precision.searcher import layer_groups

    m = conv_bn()
    before = m.SerializeToString()
    # The BatchNormalization folds into the Conv, the Relu fuses into it: one TensorRT layer.
    assert emulation.layer_groups(m) == {"bn": "conv", "relu": "conv"}
    assert m.SerializeToString() == before  # read from a copy
    assert layer_groups(m, ["conv", "bn", "relu"]) == {"conv": ["conv", "bn", "relu"]}
    # A group is named by its first candidate node (a pinned Conv is no candidate).
    assert layer_groups(m, ["bn", "relu"]) == {"bn": ["bn", "relu"]}
    monkeypatch.setenv(emulation.NAIVE_ENV, "1")  # no rewrites: every node its own layer
    assert layer_groups(m, ["conv", "bn", "relu"]) == {"conv": ["conv"], "bn": ["bn"],
                                                       "relu": ["relu"]}
