"""The precision rewrites shared by both backends: fp16 islands and int8 Q/DQ in the ONNX graph.

``apply_precisions`` takes an assignment ``node name -> "float32" | "float16" | "int8"``
(``layer_precisions.resolve_precisions`` turns a build precision plus ``--layer-precisions``
into one):

- float16, emulated (the host backend): the node's float32 inputs, outputs and initializers are
  rounded to fp16 with explicit Cast(fp32->fp16)->Cast(fp16->fp32) pairs and the node itself
  computes in fp32. ONNX Runtime's CPU provider upcasts fp16 ops to fp32 and drops its own cast
  pairs, so a plainly fp16-converted model never overflows; explicit pairs are kept. Rounding at
  every reduced-precision node's inputs also reproduces TensorRT's reformat at precision
  boundaries: a large fp32 output overflows again when an fp16 layer reads it.
  A node with subgraphs (If / Loop / Scan) in float16 has its bodies rounded the same way
  (``subgraphs``).
- float16, typed (TensorRT strongly typed networks, >= 10.12 / 11): inputs are cast to fp16,
  the node computes in fp16 with fp16 initializers, and outputs are cast back to fp32 where an
  fp32 node or a graph output reads them.
- int8: symmetric QuantizeLinear/DequantizeLinear (zero point 0, scale = amax / 127) on the
  activation inputs of Conv / ConvTranspose / Gemm / MatMul, and symmetric int8 weights
  per output channel (emulated below opset 13: dequantized fp32 weights; typed: per tensor
  below opset 13). Biases stay fp32. TensorRT's own build-time rewrites (constant and
  BatchNormalization folding, activation fusion) are in ``emulation``.

Weights rounded to fp16 saturate at +-65504 instead of becoming inf. Reading models and marking
outputs is ``onnx_model``'s. This module imports onnx only (never onnxruntime or tensorrt).
Worker side: Python >= 3.6.
"""

from typing import Dict, Iterable, List, Optional, Set, Tuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from agent.engines.backends import emulation, subgraphs
from agent.engines.backends.layer_precisions import (
    activation_inputs,
    resolve_precisions,
    weight_inputs,
)
from agent.engines.backends.onnx_model import (
    FLOAT16,
    FLOAT32,
    copy_model,
    default_opset,
    ensure_node_names,
    subgraph_reads,
    tensor_types,
)
from agent.errors import AgentError

# Bump when a rewrite changes numerics: it enters engine-cache keys through the backends.
REWRITE_VERSION = "3"

FP16_MAX = float(np.finfo(np.float16).max)
INT8_MAX = 127.0
# Inputs that must stay float32 whatever the node computes in (typed fp16 only).
FP32_ONLY_INPUTS = {"Resize": (1, 2), "Upsample": (1,)}


class _Names(object):
    """Fresh tensor/node names that collide with nothing in the graph."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.used: Set[str] = set()
        graph = model.graph
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            self.used.add(vi.name)
        for init in graph.initializer:
            self.used.add(init.name)
        for node in list(graph.node) + list(subgraphs.nested_nodes(graph)):
            self.used.add(node.name)
            self.used.update(node.input)
            self.used.update(node.output)

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.used:
            k += 1
            name = "{}_{}".format(base, k)
        self.used.add(name)
        return name


def _cast(names: _Names, src: str, dst: str, to: int) -> onnx.NodeProto:
    return helper.make_node("Cast", [src], [dst], name=names.fresh("Cast__" + dst), to=to)


def _fp16_weight(array: np.ndarray) -> np.ndarray:
    """fp16 weights, saturating at +-65504 (inf/nan stay)."""
    with np.errstate(over="ignore", invalid="ignore"):
        clipped = np.where(np.isfinite(array), np.clip(array, -FP16_MAX, FP16_MAX), array)
    return clipped.astype(np.float16)


def _weight_axis(node: onnx.NodeProto, rank: int) -> Optional[int]:
    """The output-channel axis of a weight for per-channel scales (None = per tensor)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Conv" and rank >= 2:
        return 0
    if node.op_type == "ConvTranspose" and rank >= 2 and int(attrs.get("group", 1)) == 1:
        return 1
    if node.op_type == "Gemm" and rank == 2:
        return 0 if int(attrs.get("transB", 0)) else 1
    if node.op_type == "MatMul" and rank >= 2:
        return rank - 1
    return None


def _quantize_weight(array: np.ndarray, axis: Optional[int]
                     ) -> Tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 weights and their scales (per channel along ``axis``)."""
    w = array.astype(np.float32)
    if axis is None:
        amax = np.array(np.max(np.abs(w)) if w.size else 0.0, dtype=np.float32)
        scale = np.where(amax > 0, amax / INT8_MAX, 1.0).astype(np.float32)
        q = np.clip(np.rint(w / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
        return q, scale
    moved = np.moveaxis(w, axis, 0).reshape(w.shape[axis], -1)
    channel_max = np.max(np.abs(moved), axis=1) if moved.size else np.zeros(w.shape[axis])
    scale = np.where(channel_max > 0, channel_max / INT8_MAX, 1.0).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.rint(w / scale.reshape(shape)), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def activation_scale(amax: float) -> float:
    """scale = amax / 127; a tensor that was always 0 (or a bad range) gets scale 1/127."""
    if not np.isfinite(amax) or amax <= 0:
        return 1.0 / INT8_MAX
    return float(np.float32(amax / INT8_MAX))


def apply_precisions(
    model: onnx.ModelProto,
    assignment: Dict[str, str],
    amax: Optional[Dict[str, float]] = None,
    emulate: bool = True,
    fused: Optional[Set[str]] = None,
) -> onnx.ModelProto:
    """A copy of ``model`` where each node runs in ``assignment[node]`` (missing = float32).

    int8 nodes need ``amax`` for their activation inputs (``resolve_precisions`` checks).
    ``fused``: tensors inside a fused layer (``emulation.fused_edges``), never rounded.
    Emulated int8 weights are quantized per output channel whatever the opset (below opset
    13, as fp32 initializers holding the dequantized values: what DequantizeLinear gives)."""
    fused = set(fused or ())
    model = ensure_node_names(copy_model(model))
    graph = model.graph
    types = tensor_types(model)
    names = _Names(model)
    inits = {i.name: i for i in graph.initializer}
    graph_inputs = set(vi.name for vi in graph.input)
    weights = {n: i for n, i in inits.items() if n not in graph_inputs}
    graph_outputs = set(vo.name for vo in graph.output)
    new_inits: List[onnx.TensorProto] = []
    amax = amax or {}
    if any(p == "int8" for p in assignment.values()) and default_opset(model) < 10:
        raise AgentError("unsupported_model",
                         "int8 needs QuantizeLinear (opset >= 10), found opset {}".format(
                             default_opset(model)))
    per_channel = default_opset(model) >= 13
    # Emulation quantizes weights per output channel at any opset, as TensorRT does (the
    # naive emulation, ``emulation.NAIVE_ENV``, keeps per tensor below opset 13).
    trt_weights = emulate and emulation.enabled()

    q_cache: Dict[Tuple[str, Optional[int]], str] = {}  # (tensor, axis) -> dequantized name
    round_cache: Dict[str, str] = {}  # fp32 tensor -> its fp16-rounded fp32 copy
    half_cache: Dict[str, str] = {}  # fp32 tensor -> fp16 copy (typed)
    back_cache: Dict[str, str] = {}  # fp16 tensor -> fp32 copy (typed)
    rounded: Set[str] = set()  # tensors already rounded to fp16 (emulated)
    half: Dict[str, str] = {}  # typed: original name -> the name of its fp16 version
    out_nodes: List[onnx.NodeProto] = []
    nested: Dict[str, int] = {}

    def body_types() -> Dict[str, int]:
        """Types inside the bodies and of the outer tensors they read (rounded too)."""
        if not nested:  # inferred once, only for a model with subgraphs in reduced precision
            nested.update(types)
            nested.update(subgraphs.nested_types(model))
        return nested

    def const(base: str, array: np.ndarray) -> str:
        name = names.fresh(base)
        new_inits.append(numpy_helper.from_array(array, name))
        return name

    def qdq_activation(tensor: str, src: str) -> str:
        """Q/DQ of ``tensor`` (its range is looked up by its own name) reading ``src``."""
        key = (tensor, None)
        if key not in q_cache:
            if tensor not in amax:
                raise AgentError("build_failed",
                                 "no calibration range for tensor {!r}".format(tensor))
            scale = const(tensor + "__scale", np.array(activation_scale(amax[tensor]),
                                                       dtype=np.float32))
            zero = const(tensor + "__zero_point", np.array(0, dtype=np.int8))
            q_out = names.fresh(tensor + "__q")
            dq_out = names.fresh(tensor + "__dq")
            out_nodes.append(helper.make_node("QuantizeLinear", [src, scale, zero], [q_out],
                                              name=names.fresh("QuantizeLinear__" + tensor)))
            out_nodes.append(helper.make_node("DequantizeLinear", [q_out, scale, zero],
                                              [dq_out],
                                              name=names.fresh("DequantizeLinear__" + tensor)))
            q_cache[key] = dq_out
        return q_cache[key]

    def qdq_weight(node: onnx.NodeProto, tensor: str) -> str:
        array = numpy_helper.to_array(weights[tensor])
        axis = _weight_axis(node, array.ndim) if (per_channel or trt_weights) else None
        key = (tensor, axis)
        if key not in q_cache and trt_weights and not per_channel:
            # DequantizeLinear takes an axis from opset 13 only: older models get the
            # dequantized per-channel values as fp32 weights (the same numbers).
            q, scale = _quantize_weight(array, axis)
            shape = [1] * q.ndim
            if axis is not None:
                shape[axis] = -1
            q_cache[key] = const(tensor + "__int8dq",
                                 (q.astype(np.float32) * scale.reshape(shape)).astype(
                                     np.float32))
        if key not in q_cache:
            q, scale = _quantize_weight(array, axis)
            q_name = const(tensor + "__int8", q)
            s_name = const(tensor + "__scale", scale)
            z_name = const(tensor + "__zero_point", np.zeros(scale.shape, dtype=np.int8))
            dq_out = names.fresh(tensor + "__dq")
            dq = helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_out],
                                  name=names.fresh("DequantizeLinear__" + tensor))
            if axis is not None:
                dq.attribute.append(helper.make_attribute("axis", axis))
            out_nodes.append(dq)
            q_cache[key] = dq_out
        return q_cache[key]

    def round_fp16(tensor: str) -> str:
        if tensor in rounded:
            return tensor
        if tensor not in round_cache:
            if tensor in weights:
                array = numpy_helper.to_array(weights[tensor])
                round_cache[tensor] = const(tensor + "__fp16r",
                                            _fp16_weight(array).astype(np.float32))
            else:
                h = names.fresh(tensor + "__fp16")
                r = names.fresh(tensor + "__fp16r")
                out_nodes.append(_cast(names, tensor, h, FLOAT16))
                out_nodes.append(_cast(names, h, r, FLOAT32))
                round_cache[tensor] = r
        return round_cache[tensor]

    def to_half(tensor: str) -> str:
        if tensor in half:
            return half[tensor]
        if tensor not in half_cache:
            if tensor in weights:
                array = numpy_helper.to_array(weights[tensor])
                half_cache[tensor] = const(tensor + "__fp16", _fp16_weight(array))
            else:
                h = names.fresh(tensor + "__fp16")
                out_nodes.append(_cast(names, tensor, h, FLOAT16))
                half_cache[tensor] = h
        return half_cache[tensor]

    def to_full(tensor: str) -> str:
        if half.get(tensor) != tensor:
            return tensor  # not an fp16 tensor (or its fp32 twin exists under this name)
        if tensor not in back_cache:
            f = names.fresh(tensor + "__fp32")
            out_nodes.append(_cast(names, tensor, f, FLOAT32))
            back_cache[tensor] = f
        return back_cache[tensor]

    for original in list(graph.node):
        node = onnx.NodeProto()
        node.CopyFrom(original)
        prec = assignment.get(node.name, "float32")
        after: List[onnx.NodeProto] = []
        if prec == "int8":
            acts = set(activation_inputs(node, set(weights), types))
            wts = weight_inputs(node, set(weights))
            for i, name in enumerate(node.input):
                src = to_full(name) if not emulate else name
                if i in acts:
                    node.input[i] = qdq_activation(name, src)
                elif i in wts:
                    node.input[i] = qdq_weight(node, name)
                else:
                    node.input[i] = src
        elif prec == "float16" and emulate:
            if subgraphs.bodies(node):
                subgraphs.round_bodies(node, body_types(), names.fresh)
            for i, name in enumerate(node.input):
                if name and types.get(name) == FLOAT32 and name not in fused:
                    node.input[i] = round_fp16(name)
            for i, name in enumerate(node.output):
                if name and types.get(name) == FLOAT32 and name not in fused:
                    raw = names.fresh(name + "__fp32")
                    node.output[i] = raw
                    h = names.fresh(name + "__fp16")
                    after.append(_cast(names, raw, h, FLOAT16))
                    after.append(_cast(names, h, name, FLOAT32))
                    rounded.add(name)
        elif prec == "float16":
            keep32 = FP32_ONLY_INPUTS.get(node.op_type, ())
            for i, name in enumerate(node.input):
                if not name:
                    continue
                if i in keep32:
                    node.input[i] = to_full(name)
                elif types.get(name) == FLOAT32:
                    node.input[i] = to_half(name)
            for i, name in enumerate(node.output):
                if name and types.get(name) == FLOAT32:
                    if name in graph_outputs:
                        h = names.fresh(name + "__fp16")
                        node.output[i] = h
                        half[name] = h
                        after.append(_cast(names, h, name, FLOAT32))
                    else:
                        half[name] = name
        else:
            for i, name in enumerate(node.input):
                if name and not emulate:
                    node.input[i] = to_full(name)
        out_nodes.append(node)
        out_nodes.extend(after)

    del graph.node[:]
    graph.node.extend(out_nodes)
    graph.initializer.extend(new_inits)
    # Drop weights nothing reads any more (replaced by rounded / int8 copies).
    read = set(i for n in graph.node for i in n.input) | subgraph_reads(model) | graph_outputs
    kept_inits = [i for i in graph.initializer if i.name in read or i.name in graph_inputs]
    del graph.initializer[:]
    graph.initializer.extend(kept_inits)
    if not emulate:
        del graph.value_info[:]  # tensor types changed
    return model


def to_fp16(model: onnx.ModelProto, keep: Iterable[str], emulate: bool = True
            ) -> onnx.ModelProto:
    """Every float node not in ``keep`` runs in reduced precision (see the module doc)."""
    assignment, _, _ = resolve_precisions(
        model, "fp16", {n: "float32" for n in keep}, emulate=emulate)
    return apply_precisions(model, assignment, emulate=emulate)


def to_qdq(model: onnx.ModelProto, amax: Dict[str, float], keep: Iterable[str],
           fp16_rest: bool = False, emulate: bool = True) -> onnx.ModelProto:
    """int8 Q/DQ for every quantizable node not in ``keep`` whose ranges are in ``amax``;
    with ``fp16_rest`` the other float nodes not in ``keep`` run in fp16."""
    assignment, _, _ = resolve_precisions(
        model, "best" if fp16_rest else "int8", {n: "float32" for n in keep}, amax=amax,
        emulate=emulate)
    return apply_precisions(model, assignment, amax=amax, emulate=emulate)
