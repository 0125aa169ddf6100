"""TensorRT's build-time rewrites, done on the ONNX graph before the host emulates a precision.

TensorRT does not run an ONNX graph node by node: its parser turns Constant nodes into weights,
its builder folds BatchNormalization (and the per-channel Mul/Add form many exporters write for
it) into the preceding convolution's weights (in fp32, before any precision is applied), fuses
activations into the layer that feeds them, and quantizes Conv/Deconv/FC weights per output
channel. Emulating fp16/int8 on the naive graph reports
failures a device build does not have (a BN variance of 1e8 overflows fp16 on the host, never on
the device). ``prepare`` applies those rewrites; docs/emulation.md cites the TensorRT
documentation behind each, ``emulation_folds`` does them. ``NAIVE_ENV`` set to 1 turns them off
(the naive result).

Layer names stay those of the ONNX model: a node folded into another is reported in
``merged`` (folded name -> the node that now computes it), so ``--layer-precisions`` naming a
folded BatchNormalization applies to its convolution, as TensorRT's fused layer would.

Worker side: Python >= 3.6. Imports onnx and numpy only.
"""

import os
from typing import Dict, List, Set, Tuple

import onnx

from agent.engines.backends.emulation_folds import (
    WEIGHTED_OPS,
    consumers_of,
    fold_affine,
    fold_batch_norms,
    fold_constants,
)

NAIVE_ENV = "JETSON_AGENT_NAIVE_EMULATION"
# Bump when a rewrite changes numerics (enters engine-cache keys through the fingerprint).
VERSION = "2"

# Activations TensorRT fuses into the convolution / fully connected layer before them.
FUSED_ACTIVATIONS = frozenset(["Relu", "LeakyRelu", "Sigmoid", "Tanh", "Clip", "Elu",
                               "HardSigmoid", "Softsign", "Softplus", "ThresholdedRelu",
                               "Selu"])


def enabled() -> bool:
    return os.environ.get(NAIVE_ENV, "").strip().lower() not in ("1", "true", "yes", "on")


def fingerprint() -> str:
    return "trt-{}".format(VERSION) if enabled() else "naive"


def prepare(model: onnx.ModelProto) -> Tuple[onnx.ModelProto, Dict[str, str]]:
    """The model as TensorRT's builder sees it (in place): constants folded, BatchNormalization
    folded into the Conv/Gemm/MatMul before it (or turned into a precomputed scale and shift).
    Returns (model, merged: folded node name -> the node that computes it now)."""
    if not enabled():
        return model, {}
    fold_constants(model)
    merged = fold_batch_norms(model)
    merged.update(fold_affine(model))
    # A node folded into one that was folded further reports the last one.
    for name, into in list(merged.items()):
        seen = set()
        while into in merged and into not in seen:
            seen.add(into)
            into = merged[into]
        merged[name] = into
    return model, merged


def _fusions(graph: onnx.GraphProto) -> List[Tuple[onnx.NodeProto, onnx.NodeProto, str]]:
    """(Conv/Gemm/MatMul, the activation TensorRT fuses into it, the tensor between): the
    activation is the tensor's only reader and the tensor is no graph output."""
    outputs = set(vo.name for vo in graph.output)
    consumers = consumers_of(graph)
    found = []
    for node in graph.node:
        if node.op_type not in WEIGHTED_OPS or len(node.output) != 1:
            continue
        t = node.output[0]
        readers = consumers.get(t, [])
        if t not in outputs and len(readers) == 1 and readers[0].op_type in FUSED_ACTIVATIONS:
            found.append((node, readers[0], t))
    return found


def fused_edges(model: onnx.ModelProto, assignment: Dict[str, str]) -> Set[str]:
    """Tensors between a Conv/Gemm/MatMul and the activation TensorRT fuses into it (its only
    reader, same precision): never written in reduced precision, so never rounded."""
    if not enabled():
        return set()
    return set(t for node, act, t in _fusions(model.graph)
               if assignment.get(node.name, "float32") != "float32"
               and assignment.get(act.name, "float32") != "float32")


def layer_groups(model: onnx.ModelProto) -> Dict[str, str]:
    """Node name -> the node whose TensorRT layer computes it, for every node folded or fused
    into another (a BatchNormalization or per-channel Mul/Add folded into its Conv, an
    activation fused into it): one layer, one precision, so a precision search offers the
    group as one candidate. Nodes absent compute themselves. Reads a copy of ``model``."""
    if not enabled():
        return {}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    prepared, merged = prepare(copy)
    groups = dict(merged)
    for node, act, _ in _fusions(prepared.graph):
        groups[act.name] = node.name
    return groups
