"""ONNX graph rewrites shared by both backends: layer list, fp16 islands, int8 Q/DQ, outputs.

Layer names are ONNX node names everywhere in the agent; ``load_model`` names unnamed nodes
``<OpType>_<index>`` (index in the graph's node list) so the names are stable.

Precision rewrites take an assignment ``node name -> "float32" | "float16" | "int8"``
(``resolve_precisions`` turns a build precision plus ``--layer-precisions`` into one):

- float16, emulated (the host backend): the node's float32 inputs, outputs and initializers are
  rounded to fp16 with explicit Cast(fp32->fp16)->Cast(fp16->fp32) pairs and the node itself
  computes in fp32. ONNX Runtime's CPU provider upcasts fp16 ops to fp32 and drops its own cast
  pairs, so a plainly fp16-converted model never overflows; explicit pairs are kept. Rounding at
  every reduced-precision node's inputs also reproduces TensorRT's reformat at precision
  boundaries: a large fp32 output overflows again when an fp16 layer reads it.
- float16, typed (TensorRT strongly typed networks, >= 10.12 / 11): inputs are cast to fp16,
  the node computes in fp16 with fp16 initializers, and outputs are cast back to fp32 where an
  fp32 node or a graph output reads them.
- int8: symmetric QuantizeLinear/DequantizeLinear (zero point 0, scale = amax / 127) on the
  activation inputs of Conv / ConvTranspose / Gemm / MatMul, and symmetric int8 weights
  per output channel (emulated below opset 13: dequantized fp32 weights; typed: per tensor
  below opset 13). Biases stay fp32. TensorRT's own build-time rewrites (constant and
  BatchNormalization folding, activation fusion) are in ``emulation``.

Weights rounded to fp16 saturate at +-65504 instead of becoming inf. Nodes with subgraphs
(If / Loop / Scan) always stay fp32. This module imports onnx only (never onnxruntime or
tensorrt). Worker side: Python >= 3.6.
"""

import hashlib
import os
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from agent.engines.backends import emulation
from agent.engines.backends.base import TensorSpec
from agent.errors import AgentError

# Bump when a rewrite changes numerics: it enters engine-cache keys through the backends.
REWRITE_VERSION = "2"

FLOAT32 = TensorProto.FLOAT
FLOAT16 = TensorProto.FLOAT16
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)
FP16_MAX = float(np.finfo(np.float16).max)
INT8_MAX = 127.0

# Nodes that make float tensors without computing on data: never candidate layers.
NON_COMPUTE_OPS = frozenset([
    "Constant", "ConstantOfShape", "Shape", "Size", "EyeLike", "RandomNormal", "RandomUniform",
    "RandomNormalLike", "RandomUniformLike",
])
CONTROL_FLOW_OPS = frozenset(["If", "Loop", "Scan"])
# Ops whose output type is fixed by an attribute or by a typed input: they cannot be retyped
# to fp16 in a strongly typed graph (emulation rounds them like any other node).
FIXED_TYPE_OPS = frozenset(["Cast", "CastLike", "QuantizeLinear", "DequantizeLinear"])
# Inputs that must stay float32 whatever the node computes in (typed fp16 only).
FP32_ONLY_INPUTS = {"Resize": (1, 2), "Upsample": (1,)}
QUANTIZABLE_OPS = frozenset(["Conv", "ConvTranspose", "Gemm", "MatMul"])
BIAS_INPUTS = {"Conv": 2, "ConvTranspose": 2, "Gemm": 2}

LAYER_PRECISIONS = ("float32", "float16", "int8")
ModelOrBytes = Union[onnx.ModelProto, bytes]


# -- loading ---------------------------------------------------------------------------------

def _describe(data: bytes) -> str:
    """What some bytes look like, for 'expected ONNX, found ...' messages."""
    if not data:
        return "an empty file"
    if data.startswith(b"\x93NUMPY"):
        return "a NumPy .npy file"
    if data.startswith(b"PK\x03\x04"):
        return "a zip archive (.npz, a PyTorch checkpoint?)"
    if data.startswith(b"\x89HDF"):
        return "an HDF5 file (a Keras model?)"
    head = data[:48]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    if text and all(c.isprintable() or c in "\r\n\t" for c in text):
        return "text starting with {!r}".format(text)
    return "{} bytes starting with {}".format(len(data), data[:8].hex())


def parse_model(data: bytes, source: str = "model",
                external_dir: Optional[str] = None) -> onnx.ModelProto:
    """Parse and check ONNX bytes; ``source`` names the file in error messages. External
    tensor data is inlined from ``external_dir`` (else refused), before the checker runs."""
    from google.protobuf.message import DecodeError  # type: ignore  # onnx's own dependency

    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise AgentError("bad_model",
                         "{}: expected an ONNX model (protobuf ModelProto), found {} that does "
                         "not parse ({}); truncated or not ONNX".format(source, _describe(data),
                                                                       exc))
    if not data or model.ir_version <= 0 or not model.HasField("graph") \
            or not len(model.graph.node) or not model.opset_import:
        raise AgentError("bad_model",
                         "{}: expected an ONNX model with an IR version, opsets and a graph of "
                         "nodes, found {} ({} bytes)".format(source, _describe(data), len(data)))
    from agent.engines.model_check import inline_external_data  # every tensor, subgraphs included

    inline_external_data(model, source, external_dir)
    _check(model, source)
    ensure_node_names(model)
    return model


def _check(model: onnx.ModelProto, source: str) -> None:
    if model.ByteSize() > 2 ** 31 - 1:
        return  # the checker cannot take protos over 2 GB; the backend will tell
    # Outputs whose shape nothing can infer (a Reshape fed by Shape) are declared type-only,
    # which ONNX Runtime and TensorRT take but the checker refuses: check them as if they had
    # an unknown rank, and put them back as they were.
    shapeless = [vo for vo in model.graph.output if vo.type.HasField("tensor_type")
                 and not vo.type.tensor_type.HasField("shape")]
    for vo in shapeless:
        vo.type.tensor_type.shape.SetInParent()
    try:
        onnx.checker.check_model(model)
    except (onnx.checker.ValidationError, ValueError, RuntimeError) as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        lowered = text.lower()
        if "no op registered" in lowered or "opset" in lowered or "ir_version" in lowered \
                or "not supported" in lowered or "unsupported" in lowered:
            raise AgentError("unsupported_model",
                             "{}: expected operators and opsets this onnx {} knows, found: "
                             "{}".format(source, onnx.__version__, text))
        raise AgentError("bad_model",
                         "{}: expected a valid ONNX graph, found: {}".format(source, text))
    finally:
        for vo in shapeless:
            vo.type.tensor_type.ClearField("shape")


def load_model(path: str) -> onnx.ModelProto:
    """Read, parse, check and name an ONNX model (external data is loaded from its folder)."""
    if not os.path.isfile(path):
        raise AgentError("file_not_found", "model {} {} (expected an ONNX file)".format(
            path, "is a directory" if os.path.isdir(path) else "does not exist"))
    with open(path, "rb") as f:
        data = f.read()
    return parse_model(data, path, os.path.dirname(os.path.abspath(path)))


def ensure_node_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """Name unnamed nodes ``<OpType>_<index>`` and make duplicate names unique, in place."""
    nodes = model.graph.node
    taken = set(n.name for n in nodes if n.name)
    seen: Set[str] = set()
    for index, node in enumerate(nodes):
        if node.name and node.name not in seen:
            seen.add(node.name)
            continue
        candidate = "{}_{}".format(node.name or node.op_type, index)
        while candidate in taken or candidate in seen:
            candidate += "_"
        node.name = candidate
        seen.add(candidate)
    return model


def model_digest(model_or_bytes: ModelOrBytes) -> str:
    """sha256 of the model's serialized bytes."""
    if isinstance(model_or_bytes, (bytes, bytearray)):
        data = bytes(model_or_bytes)
    else:
        data = model_or_bytes.SerializeToString()
    return hashlib.sha256(data).hexdigest()


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


# -- inspection ------------------------------------------------------------------------------

def np_dtype(elem_type: int) -> np.dtype:
    """numpy dtype of an ONNX tensor element type."""
    if hasattr(helper, "tensor_dtype_to_np_dtype"):
        return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    from onnx import mapping  # type: ignore  # onnx < 1.13

    return np.dtype(mapping.TENSOR_TYPE_TO_NP_TYPE[elem_type])


def input_specs(model: onnx.ModelProto) -> List[TensorSpec]:
    """The graph inputs that are not initializers (dynamic dims are None)."""
    inits = set(i.name for i in model.graph.initializer)
    return [_spec(vi) for vi in model.graph.input if vi.name not in inits]


def output_specs(model: onnx.ModelProto) -> List[TensorSpec]:
    return [_spec(vi) for vi in model.graph.output]


def _spec(vi: onnx.ValueInfoProto) -> TensorSpec:
    tt = vi.type.tensor_type
    dims = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else None
                 for d in tt.shape.dim)
    return TensorSpec(vi.name, np_dtype(tt.elem_type) if tt.elem_type else np.float32, dims)


def default_opset(model: onnx.ModelProto) -> int:
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            return int(op.version)
    return 0


def tensor_types(model: onnx.ModelProto) -> Dict[str, int]:
    """Element type of every tensor known from inputs, initializers and shape inference."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - inference is best effort; unknown types stay unknown
        inferred = model
    types: Dict[str, int] = {}
    graph = inferred.graph
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for init in model.graph.initializer:
        types[init.name] = init.data_type
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output:
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    types[node.output[0]] = attr.t.data_type
    return types


def _value_infos(model: onnx.ModelProto) -> Dict[str, onnx.ValueInfoProto]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - best effort, as in tensor_types
        inferred = model
    return {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)}


def _is_float_node(node: onnx.NodeProto, types: Dict[str, int]) -> bool:
    if node.op_type in NON_COMPUTE_OPS:
        return False
    return any(types.get(o) in FLOAT_TYPES for o in node.output if o)


def type_only_node(node: onnx.NodeProto) -> bool:
    """Cast / CastLike / Identity compute nothing: their output type is what they mean (the
    TensorRT 8.x parser makes a Cast an identity layer with an output type), so they are never
    candidates and never constrained."""
    return node.op_type in ("Cast", "CastLike", "Identity")


def float_nodes(model: onnx.ModelProto) -> List[str]:
    """Names of the nodes carrying float computation, in topological (graph) order: the
    candidate layers for precision searches and ``--layer-precisions``."""
    types = tensor_types(model)
    return [n.name for n in model.graph.node
            if _is_float_node(n, types) and not type_only_node(n)]


def _subgraph_reads(model: onnx.ModelProto) -> Set[str]:
    """Tensor names read by nodes inside subgraphs (outer-scope references)."""
    names: Set[str] = set()

    def walk(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            names.update(i for i in node.input if i)
            for attr in node.attribute:
                if attr.HasField("g"):
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)

    for node in model.graph.node:
        for attr in node.attribute:
            if attr.HasField("g"):
                walk(attr.g)
            for g in attr.graphs:
                walk(g)
    return names


def _weight_inputs(node: onnx.NodeProto, inits: Set[str]) -> Set[int]:
    """Input indices holding quantizable weights (initializers at the weight position)."""
    if node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(node.input) > 1 \
            and node.input[1] in inits:
        return {1}
    return set()


def _activation_inputs(node: onnx.NodeProto, inits: Set[str], types: Dict[str, int]
                       ) -> List[int]:
    """Input indices of a quantizable node that get activation Q/DQ."""
    weights = _weight_inputs(node, inits)
    bias = BIAS_INPUTS.get(node.op_type)
    return [i for i, name in enumerate(node.input)
            if name and i not in weights and i != bias and types.get(name) == FLOAT32]


def _quantizable(node: onnx.NodeProto, inits: Set[str], types: Dict[str, int],
                 amax: Optional[Dict[str, float]]) -> bool:
    if node.op_type not in QUANTIZABLE_OPS:
        return False
    if any(types.get(i) not in (FLOAT32, None) for i in node.input[:2] if i):
        return False  # fp16/double inputs: leave them alone
    acts = _activation_inputs(node, inits, types)
    if not acts and not _weight_inputs(node, inits):
        return False
    return amax is None or all(node.input[i] in amax for i in acts)


# -- precision assignment --------------------------------------------------------------------

def resolve_precisions(
    model: onnx.ModelProto,
    precision: str,
    overrides: Optional[Dict[str, str]] = None,
    amax: Optional[Dict[str, float]] = None,
    emulate: bool = True,
) -> Tuple[Dict[str, str], List[Tuple[str, str, str]], List[str]]:
    """What each float node runs in for a build ``precision`` (fp32/fp16/int8/best) with
    per-layer ``overrides`` (node -> float32/float16/int8).

    int8 goes to Conv/ConvTranspose/Gemm/MatMul whose activation ranges are known (``amax``
    None = assume they will be); other int8 requests fall back to float16 in fp16/best builds
    and float32 otherwise. Returns (assignment for every float node, mismatches
    [(node, asked, got)] for explicit overrides not honoured, override names that are nodes
    without float computation). Unknown names raise ``unknown_layer``.
    """
    overrides = dict(overrides or {})
    names = set(n.name for n in model.graph.node)
    unknown = sorted(n for n in overrides if n not in names)
    if unknown:
        raise AgentError("unknown_layer",
                         "--layer-precisions names {} but the model has no such node "
                         "(expected ONNX node names such as {})".format(
                             ", ".join(repr(n) for n in unknown),
                             ", ".join(near_names(model, unknown))),
                         {"unknown": unknown})
    for name, prec in overrides.items():
        if prec not in LAYER_PRECISIONS:
            raise AgentError("bad_argument",
                             "layer precision of {!r} must be one of {}, found {!r}".format(
                                 name, ", ".join(LAYER_PRECISIONS), prec))
    default = {"fp32": "float32", "fp16": "float16", "int8": "int8", "best": "int8"}
    if precision not in default:
        raise AgentError("bad_argument",
                         "precision must be one of fp32, fp16, int8, best, found {!r}".format(
                             precision))
    int8_fallback = "float16" if precision in ("fp16", "best") else "float32"
    types = tensor_types(model)
    inits = set(i.name for i in model.graph.initializer) - set(i.name for i in model.graph.input)
    outer = _subgraph_reads(model) if not emulate else set()
    assignment: Dict[str, str] = {}
    mismatches: List[Tuple[str, str, str]] = []
    float_set = set()
    for node in model.graph.node:
        if not _is_float_node(node, types):
            continue
        float_set.add(node.name)
        asked = overrides.get(node.name, default[precision])
        got = asked
        if got == "int8" and not _quantizable(node, inits, types, amax):
            got = int8_fallback
        if got == "float16" and not _reducible(node, types, emulate, outer):
            got = "float32"
        assignment[node.name] = got
        if node.name in overrides and got != asked:
            mismatches.append((node.name, asked, got))
    ignored = sorted(n for n in overrides if n not in float_set)
    return assignment, mismatches, ignored


def near_names(model: onnx.ModelProto, unknown: Sequence[str], limit: int = 8) -> List[str]:
    """Node names close to the ``unknown`` ones (float layers first), for error messages."""
    import difflib

    types = tensor_types(model)
    layers = [n.name for n in model.graph.node if _is_float_node(n, types)]
    others = [n.name for n in model.graph.node if n.name not in set(layers)]
    out: List[str] = []
    for name in unknown:
        for pool in (layers, others):
            for match in difflib.get_close_matches(name, pool, n=3, cutoff=0.5):
                if match not in out:
                    out.append(match)
    for name in layers + others:  # nothing close: the first float layers
        if len(out) >= min(limit, 3) and out:
            break
        if name not in out:
            out.append(name)
    return out[:limit]


def _reducible(node: onnx.NodeProto, types: Dict[str, int], emulate: bool,
               outer: Set[str]) -> bool:
    if node.op_type in CONTROL_FLOW_OPS:
        return False
    if emulate:
        return True
    if node.op_type in FIXED_TYPE_OPS or any(o in outer for o in node.output):
        return False
    # Typed fp16 retypes float32 tensors only; mixed double/bf16 nodes stay as they are.
    return all(types.get(t) in (FLOAT32, FLOAT16, None) or types.get(t) not in FLOAT_TYPES
               for t in list(node.input) + list(node.output) if t)


# -- rewriting -------------------------------------------------------------------------------

class _Names(object):
    """Fresh tensor/node names that collide with nothing in the graph."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.used: Set[str] = set()
        graph = model.graph
        for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
            self.used.add(vi.name)
        for init in graph.initializer:
            self.used.add(init.name)
        for node in graph.node:
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
            acts = set(_activation_inputs(node, set(weights), types))
            wts = _weight_inputs(node, set(weights))
            for i, name in enumerate(node.input):
                src = to_full(name) if not emulate else name
                if i in acts:
                    node.input[i] = qdq_activation(name, src)
                elif i in wts:
                    node.input[i] = qdq_weight(node, name)
                else:
                    node.input[i] = src
        elif prec == "float16" and emulate:
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
    read = set(i for n in graph.node for i in n.input) | _subgraph_reads(model) | graph_outputs
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


def mark_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy with extra graph outputs: tensor names, node names (all their float outputs), or
    ``"*"`` for every float tensor a node produces. Unknown names raise ``bad_argument``."""
    model = copy_model(model)
    graph = model.graph
    types = tensor_types(model)
    produced = [o for n in graph.node for o in n.output if o]
    by_node = {n.name: [o for o in n.output if o] for n in graph.node}
    inputs = set(vi.name for vi in graph.input)
    targets: List[str] = []
    for name in names:
        if name == "*":
            targets.extend(o for o in produced if types.get(o) in FLOAT_TYPES)
        elif name in by_node and name not in types:
            targets.extend(o for o in by_node[name] if types.get(o) in FLOAT_TYPES)
        elif name in set(produced) or name in inputs:
            targets.append(name)
        else:
            raise AgentError("bad_argument",
                             "cannot mark {!r} as an output: expected a tensor produced by a "
                             "node, a node name or '*', found neither".format(name))
    existing = set(vo.name for vo in graph.output)
    infos = _value_infos(model)
    for name in targets:
        if name in existing:
            continue
        existing.add(name)
        if name in infos:
            graph.output.append(infos[name])
        else:
            graph.output.append(helper.make_tensor_value_info(name, types.get(name, FLOAT32),
                                                              None))
    return model
