"""Is a model already quantized? Explicit quantization (Q/DQ) read off the ONNX graph.

TensorRT Model Optimizer's ONNX PTQ, onnxruntime's ``quantize_static(..., QuantFormat.QDQ)``
and models shipped quantized carry their INT8 scales in QuantizeLinear / DequantizeLinear
pairs. TensorRT builds such a network in explicit-precision mode: it ignores a calibrator,
needs the INT8 flag on the weakly typed path (< 10.12), and runs the layers the pairs
surround in int8 (Q/DQ fusion). So a Q/DQ model is never calibrated again, and its pairs are
fixed: only the layers outside them take a build's precision.

``quantization(model)``:

- ``none``: no QuantizeLinear / DequantizeLinear node;
- ``explicit``: Q/DQ, and every Conv / ConvTranspose / Gemm / MatMul reads a dequantized input;
- ``mixed``: Q/DQ, but some of those layers read none (left in float by the quantizer, e.g.
  ModelOpt's unsupported convolutions or onnxruntime's ``nodes_to_exclude``).

``explicit_nodes(model)`` names the nodes whose precision the pairs decide: the Q/DQ nodes
themselves and every node reading a DequantizeLinear output. Pure (reads the top-level graph,
changes nothing; subgraphs are not searched). Worker side: Python >= 3.6.
"""

from typing import Set

import onnx

QDQ_OPS = frozenset(["QuantizeLinear", "DequantizeLinear"])
# The layers a quantizer targets: whether all or some of them read Q/DQ tells explicit from mixed.
_INT8_LAYERS = frozenset(["Conv", "ConvTranspose", "Gemm", "MatMul"])
_INT_OUTPUT_OPS = frozenset(["Shape", "Size", "NonZero", "ArgMax", "ArgMin"])
# What a Q/DQ model's engine is called everywhere (build output, job status, meta.json, the
# dashboard); DeepStream maps it to network-mode=1.
EXPLICIT_LABEL = "int8 (explicit)"


def _dequantized(model: onnx.ModelProto) -> Set[str]:
    return set(o for n in model.graph.node if n.op_type == "DequantizeLinear"
               for o in n.output if o)


def explicit_nodes(model: onnx.ModelProto) -> Set[str]:
    """Names of the Q/DQ nodes and of the nodes reading a dequantized tensor (empty for a
    model without Q/DQ)."""
    dq = _dequantized(model)
    return set(n.name for n in model.graph.node
               if n.op_type in QDQ_OPS or any(i in dq for i in n.input))


def quantization(model: onnx.ModelProto) -> str:
    """``none``, ``explicit`` or ``mixed`` (module notes)."""
    if not any(n.op_type in QDQ_OPS for n in model.graph.node):
        return "none"
    dq = _dequantized(model)
    layers = [n for n in model.graph.node if n.op_type in _INT8_LAYERS]
    if all(any(i in dq for i in n.input) for n in layers):
        return "explicit"
    return "mixed"


def label(precision: str, quantization: str) -> str:
    """The precision to show for an engine: ``int8 (explicit)`` for a Q/DQ model whatever
    the float precision of its other layers, else the build's precision."""
    return EXPLICIT_LABEL if quantization in ("explicit", "mixed") else precision


def of_file(path: str) -> str:
    """``quantization`` of the ONNX file at ``path`` (a pre-check before a build: an int8
    build of a Q/DQ model needs no calibration data)."""
    from agent.engines.backends import onnx_model

    return quantization(onnx_model.load_model(path))


def int8_layers(model: onnx.ModelProto) -> Set[str]:
    """The layers a Q/DQ model runs in int8: nodes reading a dequantized tensor, except the
    Q/DQ nodes themselves (TensorRT fuses them into their layers) and nodes whose output is
    an integer whatever they read (Shape, ...)."""
    other = set(n.name for n in model.graph.node
                if n.op_type in QDQ_OPS or n.op_type in _INT_OUTPUT_OPS)
    return explicit_nodes(model) - other
