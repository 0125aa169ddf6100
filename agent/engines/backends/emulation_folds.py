"""The folds TensorRT's parser and builder make before any precision applies, done on the ONNX
graph in place: Constant nodes become weights, BatchNormalization folds into the Conv / Gemm /
MatMul that alone feeds it (or becomes a precomputed scale and shift), and so does a per-channel
Mul / Add (the decomposed BatchNormalization many exporters write). Arithmetic in float64,
rounded once to fp32. ``emulation.prepare`` decides when they run; docs/emulation.md cites the
TensorRT documentation behind each. Worker side: Python >= 3.6. Imports onnx and numpy only.
"""

from typing import Any, Callable, Dict, List, Optional, Set

import numpy as np
import onnx
from onnx import helper, numpy_helper

WEIGHTED_OPS = ("Conv", "ConvTranspose", "Gemm", "MatMul")


class _Weights(object):
    """The graph's constant weights: read one, add one under a name nothing else uses."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.inits = {i.name: i for i in graph.initializer}
        self.graph_inputs = set(vi.name for vi in graph.input)
        self.used = set(self.inits) | set(t for n in graph.node
                                          for t in list(n.input) + list(n.output))

    def const(self, name: str) -> Optional[np.ndarray]:
        if name in self.inits and name not in self.graph_inputs:
            return numpy_helper.to_array(self.inits[name])
        return None

    def add(self, base: str, array: np.ndarray) -> str:
        name, k = base, 1
        while name in self.used:
            k += 1
            name = "{}_{}".format(base, k)
        self.used.add(name)
        tensor = numpy_helper.from_array(array, name)
        self.graph.initializer.append(tensor)
        self.inits[name] = tensor
        return name


def fold_constants(model: onnx.ModelProto) -> int:
    """Constant nodes (with a tensor value) become initializers: weights the rewrites can see
    (per-channel quantization, BN folding), as TensorRT's parser makes them weights."""
    graph = model.graph
    outputs = set(vo.name for vo in graph.output)
    kept: List[onnx.NodeProto] = []
    folded = 0
    for node in graph.node:
        tensor = None
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and \
                len(node.output) == 1 and node.output[0] not in outputs:
            for attr in node.attribute:
                if attr.name == "value" and attr.HasField("t"):
                    tensor = onnx.TensorProto()
                    tensor.CopyFrom(attr.t)
                elif attr.name == "value_float":
                    tensor = numpy_helper.from_array(np.array(attr.f, dtype=np.float32))
                elif attr.name == "value_floats":
                    tensor = numpy_helper.from_array(np.array(list(attr.floats),
                                                              dtype=np.float32))
                elif attr.name == "value_int":
                    tensor = numpy_helper.from_array(np.array(attr.i, dtype=np.int64))
                elif attr.name == "value_ints":
                    tensor = numpy_helper.from_array(np.array(list(attr.ints), dtype=np.int64))
        if tensor is None:
            kept.append(node)
            continue
        tensor.name = node.output[0]
        graph.initializer.append(tensor)
        folded += 1
    if folded:
        del graph.node[:]
        graph.node.extend(kept)
    return folded


def consumers_of(graph: onnx.GraphProto) -> Dict[str, List[onnx.NodeProto]]:
    out: Dict[str, List[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            if name:
                out.setdefault(name, []).append(node)
    return out


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def fold_batch_norms(model: onnx.ModelProto) -> Dict[str, str]:
    """Fold inference BatchNormalization into the Conv / ConvTranspose / Gemm / MatMul that
    alone feeds it, in float64 then rounded to fp32 once (scale = gamma / sqrt(var + eps),
    W' = W * scale per output channel, b' = (b - mean) * scale + beta); a BN that cannot be
    folded gets its statistics replaced by the precomputed scale and shift (mean 0, var 1 -
    eps), which is what TensorRT's scale layer holds."""
    graph = model.graph
    weights = _Weights(graph)
    const, add_init = weights.const, weights.add
    outputs = set(vo.name for vo in graph.output)
    consumers = consumers_of(graph)
    producer = {o: n for n in graph.node for o in n.output if o}
    merged: Dict[str, str] = {}
    removed: Set[int] = set()

    for bn in graph.node:
        if bn.op_type != "BatchNormalization" or len(bn.input) < 5 or len(
                [o for o in bn.output if o]) != 1:
            continue
        stats = [const(n) for n in bn.input[1:5]]
        if any(s is None for s in stats):
            continue
        gamma, beta, mean, var = [np.asarray(s, dtype=np.float64).ravel() for s in stats]
        eps = float(_attr(bn, "epsilon", 1e-5))
        if not (gamma.size == beta.size == mean.size == var.size) or np.any(var + eps < 0):
            continue
        scale = gamma / np.sqrt(var + eps)
        shift = beta - mean * scale
        prev = producer.get(bn.input[0])
        if prev is not None and _fold_into(prev, bn, scale, shift, const, add_init, consumers,
                                           outputs):
            # The weighted node now writes the BN's output; the BN goes away.
            _absorb(prev, bn, bn.input[0], merged, removed)
            continue
        # Standalone: the same affine map with statistics that fit fp16.
        bn.input[1] = add_init(bn.name + "__scale", scale.astype(np.float32))
        bn.input[2] = add_init(bn.name + "__shift", shift.astype(np.float32))
        bn.input[3] = add_init(bn.name + "__zero_mean", np.zeros(scale.size, np.float32))
        bn.input[4] = add_init(bn.name + "__unit_var",
                               np.full(scale.size, 1.0 - eps, np.float32))
    _remove_nodes(graph, removed)
    _drop_unread(model)
    return merged


def _channel_vector(value: np.ndarray, op: str, out_rank: int, channels: int
                    ) -> Optional[np.ndarray]:
    """A constant Mul/Add operand as one value per output channel of a Conv (axis 1 of an
    NCHW output) or Gemm/MatMul (last axis), or None when it broadcasts otherwise."""
    v = np.asarray(value, dtype=np.float64)
    if v.ndim > out_rank:
        return None  # broadcasting would add dimensions to the output
    if v.size == 1:
        return np.full(channels, float(v.ravel()[0]))
    if v.size != channels or v.ndim > out_rank:
        return None
    shape = (1,) * (out_rank - v.ndim) + v.shape
    axis = 1 if op in ("Conv", "ConvTranspose") else out_rank - 1
    if shape[axis] != channels or any(d != 1 for i, d in enumerate(shape) if i != axis):
        return None
    return v.ravel()


def fold_affine(model: onnx.ModelProto) -> Dict[str, str]:
    """Fold a Mul or Add by a per-channel (or scalar) constant into the Conv / ConvTranspose /
    Gemm / MatMul that alone feeds it, in float64 rounded once to fp32: the decomposed form of
    a BatchNormalization (Conv -> Mul -> Add) many exporters write, taken like the Scale layer
    BatchNormalization becomes. An Add needs a bias input (MatMul has none: it stays)."""
    graph = model.graph
    weights = _Weights(graph)
    const, add_init = weights.const, weights.add
    outputs = set(vo.name for vo in graph.output)
    merged: Dict[str, str] = {}
    removed: Set[int] = set()
    # Built once (not per node: that was quadratic, a third of a build on 900-node models).
    # A fold renames only a weighted node's output, so who reads a tensor never changes; the
    # producers are kept up to date.
    producer = {o: n for n in graph.node for o in n.output if o}
    consumers = consumers_of(graph)

    for node in graph.node:
        if node.op_type not in ("Mul", "Add") or len(node.input) != 2 or len(node.output) != 1:
            continue
        for k in (0, 1):
            c, t = const(node.input[1 - k]), node.input[k]
            prev = producer.get(t)
            if c is None or prev is None or prev.op_type not in WEIGHTED_OPS or \
                    t in outputs or len(consumers.get(t, [])) != 1 or len(prev.input) < 2:
                continue
            if _fold_affine_into(prev, node.op_type, c, const, add_init):
                _absorb(prev, node, t, merged, removed)
                del producer[t]
                producer[node.output[0]] = prev
            break
    if removed:
        _remove_nodes(graph, removed)
        _drop_unread(model)
    return merged


def _fold_affine_into(prev: onnx.NodeProto, op: str, c: np.ndarray,
                      const: Callable[[str], Optional[np.ndarray]],
                      add_init: Callable[[str, np.ndarray], str]) -> bool:
    w = const(prev.input[1])
    if w is None or w.dtype not in (np.float32, np.float64) or w.ndim < 2:
        return False
    if prev.op_type == "Conv":
        channels, axis, rank = w.shape[0], 0, w.ndim
    elif prev.op_type == "ConvTranspose":
        if int(_attr(prev, "group", 1)) != 1:
            return False
        channels, axis, rank = w.shape[1], 1, w.ndim
    elif prev.op_type == "Gemm":
        if int(_attr(prev, "transA", 0)) or float(_attr(prev, "alpha", 1.0)) != 1.0 or \
                float(_attr(prev, "beta", 1.0)) != 1.0 or w.ndim != 2:
            return False
        axis = 0 if int(_attr(prev, "transB", 0)) else 1
        channels, rank = w.shape[axis], 2
    else:  # MatMul: rank-2 weights; the output's last axis
        if w.ndim != 2:
            return False
        channels, axis, rank = w.shape[1], 1, None
    out_rank = rank if rank is not None else 2
    vec = _channel_vector(c, prev.op_type, out_rank, channels)
    if vec is None:
        return False
    bias = None
    if len(prev.input) > 2 and prev.input[2]:
        bias = const(prev.input[2])
        if bias is None:
            return False
        bias = np.broadcast_to(np.asarray(bias, np.float64).ravel(), (channels,)) \
            if np.asarray(bias).size in (1, channels) else None
        if bias is None:
            return False
    if op == "Add":
        if prev.op_type == "MatMul":
            return False
        new_bias = (bias if bias is not None else np.zeros(channels)) + vec
    else:
        shape = [1] * w.ndim
        shape[axis] = channels
        prev.input[1] = add_init(prev.input[1] + "__scaled",
                                 (w.astype(np.float64) * vec.reshape(shape)).astype(np.float32))
        if bias is None:
            return True
        new_bias = bias * vec
    name = add_init(prev.name + "__folded_bias", new_bias.astype(np.float32))
    if len(prev.input) > 2:
        prev.input[2] = name
    else:
        prev.input.append(name)
    return True


def _fold_into(prev: onnx.NodeProto, bn: onnx.NodeProto, scale: np.ndarray, shift: np.ndarray,
               const: Callable[[str], Optional[np.ndarray]],
               add_init: Callable[[str, np.ndarray], str],
               consumers: Dict[str, List[onnx.NodeProto]], outputs: Set[str]) -> bool:
    """Fold the BN's per-channel scale and shift into ``prev``'s weights and bias."""
    if prev.op_type not in WEIGHTED_OPS or bn.input[0] in outputs or \
            len(consumers.get(bn.input[0], [])) != 1 or len(prev.input) < 2:
        return False
    w = const(prev.input[1])
    if w is None or w.dtype not in (np.float32, np.float64):
        return False
    w = w.astype(np.float64)
    c = scale.size
    bias = None
    if len(prev.input) > 2 and prev.input[2]:
        bias = const(prev.input[2])
        if bias is None:
            return False
        bias = np.asarray(bias, np.float64)
    if prev.op_type == "Conv":
        if w.ndim < 3 or w.shape[0] != c:
            return False
        w = w * scale.reshape((c,) + (1,) * (w.ndim - 1))
    elif prev.op_type == "ConvTranspose":
        group = int(_attr(prev, "group", 1))
        if w.ndim < 3 or group != 1 or w.shape[1] != c:
            return False
        w = w * scale.reshape((1, c) + (1,) * (w.ndim - 2))
    elif prev.op_type == "Gemm":
        if w.ndim != 2 or float(_attr(prev, "alpha", 1.0)) != 1.0 or \
                float(_attr(prev, "beta", 1.0)) != 1.0 or int(_attr(prev, "transA", 0)):
            return False
        trans_b = int(_attr(prev, "transB", 0))
        if (w.shape[0] if trans_b else w.shape[1]) != c:
            return False
        w = w * (scale.reshape(c, 1) if trans_b else scale.reshape(1, c))
    else:  # MatMul: BN over the last axis only (rank-2 activations [N, C])
        if w.ndim != 2 or w.shape[1] != c:
            return False
        w = w * scale.reshape(1, c)
    if bias is None:
        bias = np.zeros(c, np.float64)
    if bias.size != c and bias.size != 1:
        return False
    new_bias = (np.broadcast_to(bias, (c,)) * scale + shift).astype(np.float32)
    prev.input[1] = add_init(prev.input[1] + "__bnfold", w.astype(np.float32))
    if prev.op_type == "MatMul":
        return _matmul_bias(prev, bn, new_bias, add_init)
    if len(prev.input) > 2:
        prev.input[2] = add_init(prev.name + "__bnfold_bias", new_bias)
    else:
        prev.input.append(add_init(prev.name + "__bnfold_bias", new_bias))
    return True


def _matmul_bias(prev: onnx.NodeProto, bn: onnx.NodeProto, bias: np.ndarray,
                 add_init: Callable[[str, np.ndarray], str]) -> bool:
    """MatMul has no bias input: the BN node becomes an Add of the folded bias (named as the
    BN, so the layer still exists). Returns False: the BN node stays."""
    del bn.attribute[:]
    bn.op_type = "Add"
    name = add_init(bn.name + "__bnfold_bias", bias)
    del bn.input[1:]
    bn.input.append(name)
    return False


def _absorb(prev: onnx.NodeProto, node: onnx.NodeProto, between: str, merged: Dict[str, str],
            removed: Set[int]) -> None:
    """``prev`` now computes ``node`` too: it writes ``node``'s output in place of the tensor
    ``between`` them, and ``node`` goes away (reported in ``merged``)."""
    for i, name in enumerate(prev.output):
        if name == between:
            prev.output[i] = node.output[0]
    merged[node.name] = prev.name
    removed.add(id(node))


def _remove_nodes(graph: onnx.GraphProto, removed: Set[int]) -> None:
    if removed:
        kept = [n for n in graph.node if id(n) not in removed]
        del graph.node[:]
        graph.node.extend(kept)


def _drop_unread(model: onnx.ModelProto) -> None:
    graph = model.graph
    read = set(i for n in graph.node for i in n.input) | set(vo.name for vo in graph.output)

    def walk(g: onnx.GraphProto) -> None:
        for n in g.node:
            read.update(n.input)
            for a in n.attribute:
                if a.HasField("g"):
                    walk(a.g)
                for sub in a.graphs:
                    walk(sub)

    walk(graph)
    inputs = set(vi.name for vi in graph.input)
    kept = [i for i in graph.initializer if i.name in read or i.name in inputs]
    if len(kept) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept)
