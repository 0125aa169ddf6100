"""Reduced precision inside If / Loop / Scan bodies, emulated on the host.

TensorRT builds the layers inside a conditional or a loop like any other layer: in an fp16
build they run in fp16. The host emulation rewrites the top-level graph (``graph``); this
module carries the precision of a control-flow node into its bodies, recursively: every float
layer inside runs in its owner's precision (one ``--layer-precisions If_0:float32`` keeps a
whole branch in fp32, and a search sees the node as one candidate). Bodies may read tensors of
the outer scope: those names stay as they are, and the rounded copies are new names made
inside the body, so no scope is broken.

What cannot be emulated is counted, never hidden: int8 needs calibration ranges for tensors
inside the bodies, which the calibration (top-level tensors) does not collect, so int8 layers
inside subgraphs run in the owner's fallback precision and ``summary`` says how many.

Pure graph work (onnx and the Cast pairs of ``graph``'s fp16 rounding). Worker side:
Python >= 3.6.
"""

from typing import Any, Callable, Dict, Iterator, List, Set

import onnx
from onnx import helper

from agent.engines.backends import emulation
from agent.engines.backends.emulation_folds import WEIGHTED_OPS
from agent.engines.backends.layer_precisions import QUANTIZABLE_OPS, is_float_layer
from agent.engines.backends.onnx_model import FLOAT16, FLOAT32

Fresh = Callable[[str], str]


def bodies(node: onnx.NodeProto) -> List[onnx.GraphProto]:
    """The subgraphs a node holds (If's branches, Loop's and Scan's body)."""
    return [g for a in node.attribute
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs)]


def nested_types(model: onnx.ModelProto) -> Dict[str, int]:
    """Element types of the tensors inside subgraphs (shape inference writes each body's
    value_info), by name: ONNX names are unique across scopes."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model)
    except Exception:  # noqa: BLE001 - inference is best effort; unknown types stay unknown
        inferred = model
    types: Dict[str, int] = {}

    def visit(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            for body in bodies(node):
                for vi in list(body.input) + list(body.value_info) + list(body.output):
                    if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
                        types[vi.name] = vi.type.tensor_type.elem_type
                for init in body.initializer:
                    types[init.name] = init.data_type
                for inner in body.node:
                    if inner.op_type == "Constant":
                        for attr in inner.attribute:
                            if attr.name == "value" and attr.HasField("t"):
                                types[inner.output[0]] = attr.t.data_type
                visit(body)

    visit(inferred.graph)
    return types


def walk_node(node: onnx.NodeProto) -> Iterator[onnx.NodeProto]:
    """Every node inside ``node``'s subgraphs, nested ones included."""
    for body in bodies(node):
        for inner in body.node:
            yield inner
            yield from walk_node(inner)


def nested_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    """Every node inside the subgraphs of ``graph``'s nodes."""
    for node in graph.node:
        yield from walk_node(node)


def summary(model: onnx.ModelProto, assignment: Dict[str, str], precision: str
            ) -> Dict[str, Any]:
    """What the layers inside subgraphs run in here, for a build of ``precision`` whose
    top-level ``assignment`` is given: {"counts": {precision: n}, "warning": text when some
    cannot run as a device would} ({} for a model without subgraphs)."""
    if not any(bodies(node) for node in model.graph.node):
        return {}
    types = nested_types(model)
    counts = {"float32": 0, "float16": 0, "int8": 0}
    not_int8 = 0
    for node in model.graph.node:
        if not bodies(node):
            continue
        owner = assignment.get(node.name, "float32")
        for inner in walk_node(node):
            if not is_float_layer(inner, types):
                continue
            counts[owner] += 1
            if precision in ("int8", "best") and inner.op_type in QUANTIZABLE_OPS:
                not_int8 += 1
    if not sum(counts.values()):
        return {}
    out: Dict[str, Any] = {"counts": counts}
    if not_int8:
        out["warning"] = (
            "{} Conv/Gemm/MatMul node(s) inside subgraphs run in {} here, not int8 (a device "
            "may quantize them; the host calibrates top-level tensors only)".format(
                not_int8, "fp16" if precision == "best" else "fp32"))
    return out


def round_bodies(node: onnx.NodeProto, types: Dict[str, int], fresh: Fresh) -> None:
    """Emulated fp16 inside ``node``'s subgraphs, in place: each float layer's fp32 inputs and
    outputs are rounded with Cast pairs, as ``graph.apply_precisions`` does at the top level
    (the tensor between a fused Conv/Gemm/MatMul and its activation excepted)."""
    for body in bodies(node):
        _round_graph(body, types, fresh)


def _cast(fresh: Fresh, src: str, dst: str, to: int) -> onnx.NodeProto:
    return helper.make_node("Cast", [src], [dst], name=fresh("Cast__" + dst), to=to)


def _round_graph(graph: onnx.GraphProto, types: Dict[str, int], fresh: Fresh) -> None:
    fused = _fused(graph)
    rounded: Set[str] = set()
    cache: Dict[str, str] = {}
    out: List[onnx.NodeProto] = []

    def round_input(name: str) -> str:
        if name in rounded:
            return name
        if name not in cache:
            h, r = fresh(name + "__fp16"), fresh(name + "__fp16r")
            out.append(_cast(fresh, name, h, FLOAT16))
            out.append(_cast(fresh, h, r, FLOAT32))
            cache[name] = r
        return cache[name]

    for node in list(graph.node):
        after: List[onnx.NodeProto] = []
        if bodies(node):
            round_bodies(node, types, fresh)
        elif is_float_layer(node, types):
            for i, name in enumerate(node.input):
                if name and types.get(name) == FLOAT32 and name not in fused:
                    node.input[i] = round_input(name)
            for i, name in enumerate(node.output):
                if name and types.get(name) == FLOAT32 and name not in fused:
                    raw, h = fresh(name + "__fp32"), fresh(name + "__fp16")
                    node.output[i] = raw
                    after.append(_cast(fresh, raw, h, FLOAT16))
                    after.append(_cast(fresh, h, name, FLOAT32))
                    rounded.add(name)
        out.append(node)
        out.extend(after)
    del graph.node[:]
    graph.node.extend(out)


def _fused(graph: onnx.GraphProto) -> Set[str]:
    """``emulation.fused_edges`` inside a body (all of whose layers share one precision)."""
    if not emulation.enabled():
        return set()
    outputs = set(vo.name for vo in graph.output)
    readers: Dict[str, List[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return set(node.output[0] for node in graph.node
               if node.op_type in WEIGHTED_OPS and len(node.output) == 1
               and node.output[0] not in outputs
               and len(readers.get(node.output[0], [])) == 1
               and readers[node.output[0]][0].op_type in emulation.FUSED_ACTIVATIONS)
