"""Reading ONNX models, and what their graphs hold: shared by both backends and the tools.

``parse_model`` / ``load_model`` parse, check and name a model: layer names are ONNX node names
everywhere in the agent, and unnamed nodes are named ``<OpType>_<index>`` (index in the graph's
node list) so the names are stable. The rest reads a graph (input/output specs, tensor types,
the opset) or marks tensors as extra outputs (``mark_outputs``: calibration, layerwise
comparison). This module imports onnx only (never onnxruntime or tensorrt). Worker side:
Python >= 3.6.
"""

import hashlib
import os
from typing import Dict, List, Optional, Sequence, Set, Union

import numpy as np
import onnx
from onnx import TensorProto, helper

from agent.engines.backends.base import TensorSpec
from agent.errors import AgentError

FLOAT32 = TensorProto.FLOAT
FLOAT16 = TensorProto.FLOAT16
FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16)

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


_PLUGIN_DOMAIN = "jetson-agent.trt-plugin"  # only while checking


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
    # TensorRT plugin ops (EfficientNMS_TRT...) sit in the default domain, where the checker
    # wants a schema: check them as ops of a custom domain (whose nodes it leaves alone), so
    # the rest of the graph is still checked and TensorRT's plugin registry decides on them.
    from agent.engines.plugins import is_plugin_op

    moved = [n for n in model.graph.node if not n.domain and is_plugin_op(n.op_type, "")]
    for node in moved:
        node.domain = _PLUGIN_DOMAIN
    if moved:
        model.opset_import.add(domain=_PLUGIN_DOMAIN, version=1)
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
        for node in moved:
            node.domain = ""
        if moved:
            del model.opset_import[len(model.opset_import) - 1]


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


def subgraph_reads(model: onnx.ModelProto) -> Set[str]:
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
