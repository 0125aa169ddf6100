"""Which precision each layer runs in: the candidate layers of a model (``float_nodes``) and
``resolve_precisions``, which turns a build precision plus ``--layer-precisions`` into an
assignment ``node name -> "float32" | "float16" | "int8"`` that ``graph.apply_precisions``
writes into the graph.

int8 goes to the activation inputs of Conv / ConvTranspose / Gemm / MatMul only (biases stay
fp32); a node with subgraphs (If / Loop / Scan) is one layer whose bodies take its precision
when emulated (``subgraphs``) and stays fp32 in a strongly typed graph, which cannot retype a
Cast or a Q/DQ node either. In a Q/DQ model (``quantization``) the pairs decide int8: the nodes
they cover are left out of the assignment (never candidates, never quantized twice) and the
other layers take the build's float precision. Pure: reads the graph, changes nothing. Worker
side: Python >= 3.6.
"""

from typing import Dict, List, Optional, Sequence, Set, Tuple

import onnx

from agent.engines.backends import quantization
from agent.engines.backends.base import LAYER_PRECISIONS
from agent.engines.backends.onnx_model import (
    FLOAT16,
    FLOAT32,
    FLOAT_TYPES,
    subgraph_reads,
    tensor_types,
)
from agent.errors import AgentError

# Nodes that make float tensors without computing on data: never candidate layers.
NON_COMPUTE_OPS = frozenset([
    "Constant", "ConstantOfShape", "Shape", "Size", "EyeLike", "RandomNormal", "RandomUniform",
    "RandomNormalLike", "RandomUniformLike",
])
CONTROL_FLOW_OPS = frozenset(["If", "Loop", "Scan"])
# Ops whose output type is fixed by an attribute or by a typed input: they cannot be retyped
# to fp16 in a strongly typed graph (emulation rounds them like any other node).
FIXED_TYPE_OPS = frozenset(["Cast", "CastLike", "QuantizeLinear", "DequantizeLinear"])
QUANTIZABLE_OPS = frozenset(["Conv", "ConvTranspose", "Gemm", "MatMul"])
BIAS_INPUTS = {"Conv": 2, "ConvTranspose": 2, "Gemm": 2}


def _is_float_node(node: onnx.NodeProto, types: Dict[str, int]) -> bool:
    if node.op_type in NON_COMPUTE_OPS:
        return False
    return any(types.get(o) in FLOAT_TYPES for o in node.output if o)


def type_only_node(node: onnx.NodeProto) -> bool:
    """Cast / CastLike / Identity compute nothing: their output type is what they mean (the
    TensorRT 8.x parser makes a Cast an identity layer with an output type), so they are never
    candidates and never constrained."""
    return node.op_type in ("Cast", "CastLike", "Identity")


def is_float_layer(node: onnx.NodeProto, types: Dict[str, int]) -> bool:
    """A layer with float computation (a precision candidate)."""
    return _is_float_node(node, types) and not type_only_node(node)


def float_nodes(model: onnx.ModelProto) -> List[str]:
    """Names of the nodes carrying float computation, in topological (graph) order: the
    candidate layers for precision searches and ``--layer-precisions``."""
    types = tensor_types(model)
    return [n.name for n in model.graph.node if is_float_layer(n, types)]


def weight_inputs(node: onnx.NodeProto, inits: Set[str]) -> Set[int]:
    """Input indices holding quantizable weights (initializers at the weight position)."""
    if node.op_type in ("Conv", "ConvTranspose", "Gemm", "MatMul") and len(node.input) > 1 \
            and node.input[1] in inits:
        return {1}
    return set()


def activation_inputs(node: onnx.NodeProto, inits: Set[str], types: Dict[str, int]
                      ) -> List[int]:
    """Input indices of a quantizable node that get activation Q/DQ."""
    weights = weight_inputs(node, inits)
    bias = BIAS_INPUTS.get(node.op_type)
    return [i for i, name in enumerate(node.input)
            if name and i not in weights and i != bias and types.get(name) == FLOAT32]


def _quantizable(node: onnx.NodeProto, inits: Set[str], types: Dict[str, int],
                 amax: Optional[Dict[str, float]]) -> bool:
    if node.op_type not in QUANTIZABLE_OPS:
        return False
    if any(types.get(i) not in (FLOAT32, None) for i in node.input[:2] if i):
        return False  # fp16/double inputs: leave them alone
    acts = activation_inputs(node, inits, types)
    if not acts and not weight_inputs(node, inits):
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
    and float32 otherwise. In a Q/DQ model the nodes its pairs cover
    (``quantization.explicit_nodes``) are not assigned (an override naming one is a mismatch:
    it runs in int8), int8 asks nothing more (int8 builds keep the rest in float32, best in
    float16) and int8 overrides fall back. Returns (assignment for every float node, mismatches
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
    explicit = quantization.explicit_nodes(model)
    if explicit:  # the pairs are the int8 part: the rest runs in the build's float precision
        default = dict(default, int8="float32", best="float16")
    types = tensor_types(model)
    inits = set(i.name for i in model.graph.initializer) - set(i.name for i in model.graph.input)
    outer = subgraph_reads(model) if not emulate else set()
    assignment: Dict[str, str] = {}
    mismatches: List[Tuple[str, str, str]] = []
    float_set = set()
    for node in model.graph.node:
        if not _is_float_node(node, types):
            continue
        float_set.add(node.name)
        asked = overrides.get(node.name, default[precision])
        if node.name in explicit:
            if node.name in overrides and asked != "int8":
                mismatches.append((node.name, asked, "int8"))
            continue
        got = asked
        if got == "int8" and (explicit or not _quantizable(node, inits, types, amax)):
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
    if emulate:
        return True  # control flow included: its bodies take the precision (subgraphs.py)
    if node.op_type in CONTROL_FLOW_OPS:
        return False
    if node.op_type in FIXED_TYPE_OPS or any(o in outer for o in node.output):
        return False
    # Typed fp16 retypes float32 tensors only; mixed double/bf16 nodes stay as they are.
    return all(types.get(t) in (FLOAT32, FLOAT16, None) or types.get(t) not in FLOAT_TYPES
               for t in list(node.input) + list(node.output) if t)

