"""Reading TensorRT's answers, without TensorRT: layer names back to ONNX nodes, the engine
inspector's JSON, precision mismatches and parser errors (recorded strings of each version)."""

import json

import pytest

from agent.engines.backends.tensorrt_inspect import (
    layer_onnx_nodes,
    node_precisions,
    parse_engine_information,
    parser_error,
    precision_mismatches,
)

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
