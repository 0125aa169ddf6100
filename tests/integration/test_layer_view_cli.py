"""The per-layer view on a host: ``jetson-agent inspect`` of a model and of a host engine, and
``jetson-agent bench --profile`` in trtexec's ``--exportProfile`` JSON (issue 34, item 6)."""

import json

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.cli import main
from tests.models import OPSET, fp16_max_model, save


def cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _qdq_conv_bn_plugin():
    """x -> Q/DQ -> Conv -> BatchNormalization -> Relu -> a plugin op (custom domain)."""
    rng = np.random.RandomState(0)
    inits = [numpy_helper.from_array(np.array(0.02, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.int8), "z"),
             numpy_helper.from_array(rng.randn(4, 1, 3, 3).astype(np.float32), "w")]
    for name, value in (("gamma", 1.0), ("beta", 0.0), ("mean", 0.1), ("var", 2.0)):
        inits.append(numpy_helper.from_array(np.full(4, value, np.float32), name))
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="quant"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dequant"),
        helper.make_node("Conv", ["xd", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["b"],
                         name="bn"),
        helper.make_node("Relu", ["b"], ["r"], name="relu"),
        helper.make_node("ScaleChannels_TRT", ["r"], ["y"], name="plugin", domain="trt.plugins"),
    ]
    graph = helper.make_graph(
        nodes, "qdq_conv_bn_plugin",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                   helper.make_opsetid("trt.plugins", 1)])


def test_inspect_model_names_precision_qdq_folds_and_plugins(tmp_path, capsys):
    path = save(_qdq_conv_bn_plugin(), tmp_path / "m.onnx")
    code, out, _ = cli(capsys, "inspect", path, "--fp16", "--json")
    assert code == 0
    doc = json.loads(out)
    rows = {r["name"]: r for r in doc["layers"]}
    assert doc["target"]["kind"] == "model" and doc["target"]["emulated"]
    assert [r["name"] for r in doc["layers"]] == ["quant", "dequant", "conv", "bn", "relu",
                                                  "plugin"]
    # The Conv reads a DQ: the pair decides (int8, explicit), whatever the build's precision.
    assert rows["conv"]["precision"] == "int8 (explicit)" and rows["conv"]["qdq"]
    assert rows["relu"]["precision"] == "float16"
    assert rows["quant"]["qdq"] and rows["dequant"]["qdq"] and not rows["relu"]["qdq"]
    # The BatchNormalization folds into the Conv, as TensorRT's builder folds it.
    assert rows["bn"]["tactic"] == "folded into conv"
    assert rows["bn"]["precision"] == "int8 (explicit)"
    assert rows["plugin"]["plugin"] and doc["target"]["summary"]["plugins"] == [
        "ScaleChannels_TRT"]
    assert all(r["placement"] == "host (emulated)" for r in doc["layers"])
    # --layer-precisions as build takes them; the text view says the same.
    code, out, _ = cli(capsys, "inspect", path, "--fp16", "--layer-precisions", "relu:float32")
    assert code == 0
    line = next(x for x in out.splitlines() if x.startswith("relu "))
    assert "float32" in line
    line = next(x for x in out.splitlines() if x.startswith("conv "))
    assert "int8 (explicit)" in line and "Q/DQ" in line
    assert "plugins: ScaleChannels_TRT" in out and "Q/DQ: 3 layer(s)" in out


def test_inspect_host_engine_and_bench_profile(tmp_path, capsys):
    # The engine a host build wrote shows what that build recorded; bench --profile writes
    # trtexec's --exportProfile JSON (a list: {"count": N}, then one entry per layer).
    model = save(fp16_max_model(), tmp_path / "fp16_max.onnx")
    state = str(tmp_path / "state")
    code, out, _ = cli(capsys, "build", model, "--fp16", "--layer-precisions", "Add:float32",
                       "--state-dir", state, "--json")
    assert code == 0
    engine = json.loads(out)["engine"]
    code, out, _ = cli(capsys, "inspect", engine, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["target"]["kind"] == "engine" and doc["target"]["precision"] == "fp16"
    got = {r["name"]: r["precision"] for r in doc["layers"]}
    assert got == {"MatMul_0": "float16", "Add": "float32", "Sub": "float16",
                   "MatMul_1": "float16"}

    profile = str(tmp_path / "profile.json")
    code, out, _ = cli(capsys, "bench", model, "--fp16", "--iterations", "4", "--duration", "0",
                       "--state-dir", state, "--profile", profile, "--json")
    assert code == 0 and json.loads(out)["target"]["profile"] == profile
    with open(profile) as f:
        exported = json.load(f)
    head, layers = exported[0], exported[1:]
    assert head["count"] == 4 and head["emulated"] and head["backend"] == "onnxruntime"
    assert {"MatMul_0", "Add", "Sub", "MatMul_1"} <= set(r["name"] for r in layers)
    for r in layers:
        assert set(r) == {"name", "timeMs", "averageMs", "medianMs", "percentage"}
        assert r["averageMs"] == pytest.approx(r["timeMs"] / 4)
    assert sum(r["percentage"] for r in layers) == pytest.approx(100.0)
