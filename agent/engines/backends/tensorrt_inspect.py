"""Reading TensorRT's answers: which ONNX nodes a TensorRT layer comes from (layer names and
metadata), what the engine inspector's JSON says each layer runs in, the precision mismatches
that follow, and the ONNX parser's errors as one ``AgentError``. Pure functions of the text
TensorRT produces (8.2 - 10.x and 11 formats); no TensorRT needed, so
``tests/unit/engines/test_tensorrt_inspect.py`` checks them on recorded strings. Worker side:
Python >= 3.6.
"""

import json
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from agent.engines.backends.tensorrt_plan import PRECISION_RANK
from agent.errors import AgentError

# -- layer names <-> ONNX node names (pure) --------------------------------------------------

_METADATA_NODE = re.compile(r"\[ONNX Layer: (.*?)\](?=$|[\x1e\x1f\n\[ ,;])", re.S)
_FOREIGN = re.compile(r"^\{ForeignNode\[(.*)\]\}$", re.S)
# What the parser and the builder add to a node's name: "_<n>" for extra layers of one node
# (a global counter), "_output" / "_output_<n>", and reformat / copy annotations.
_SUFFIXES = (
    re.compile(r"^(.*)_output(?:_\d+)?$", re.S),
    re.compile(r"^(.*)_\d+$", re.S),
    re.compile(r"^(.*) (?:input|output) reformatter \d+$", re.S),
    re.compile(r"^(.*)\s*\[.*\]$", re.S),
)


def _metadata_node(text: str) -> str:
    """The node name in one ``[ONNX Layer: ...]`` entry. The parser appends more after the
    name: the node's filtered doc string on its own lines (8.6), `` | Local Function: f``
    (10.x)."""
    for sep in ("\n", " | "):
        text = text.split(sep, 1)[0]
    return text.strip()


def _resolve_part(part: str, known: Dict[str, int], depth: int = 0) -> List[str]:
    part = part.strip()
    if not part:
        return []
    if part in known:
        return [part]
    if depth > 4:
        return []
    match = re.match(r"^(?:PWN|PointWise)\((.*)\)$", part, re.S)
    if match:  # a pointwise fusion: PWN(PWN(Add_0, Relu_1), Mul_2)
        out: List[str] = []
        for piece in _split_top(match.group(1), ", "):
            out.extend(_resolve_part(piece, known, depth + 1))
        return out
    for pattern in _SUFFIXES:
        m = pattern.match(part)
        if m and m.group(1) != part:
            found = _resolve_part(m.group(1), known, depth + 1)
            if found:
                return found
    return []


def _split_top(text: str, sep: str) -> List[str]:
    """Split on ``sep`` outside parentheses and brackets."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and text.startswith(sep, i):
            parts.append(text[start:i])
            i += len(sep)
            start = i
            continue
        i += 1
    parts.append(text[start:])
    return parts


def layer_onnx_nodes(layer_name: str, node_order: Sequence[str], metadata: str = "") -> List[str]:
    """The ONNX nodes a TensorRT layer (network or engine layer) comes from.

    TensorRT >= 10 records them in the layer metadata (``[ONNX Layer: name]``, one per fused
    node): that wins. Otherwise the name is taken apart: the parser names layers after the node
    (the backend names every node before parsing, see ``onnx_model.load_model``), adds ``_<n>`` for
    a node's extra layers and ``_output``; the builder joins fused layers with `` + ``, wraps
    pointwise fusions in ``PWN(...)`` and Myelin regions in ``{ForeignNode[first...last]}``
    (every node between the two, in graph order). Unknown pieces (``(Unnamed Layer* 3)
    [Shuffle]``, reformatters, the Casts and Q/DQ nodes a rewrite added) map to nothing."""
    known = {name: i for i, name in enumerate(node_order)}
    out: List[str] = []

    def add(names: Sequence[str]) -> None:
        for n in names:
            if n not in out:
                out.append(n)

    if metadata:
        add([n for n in (_metadata_node(m) for m in _METADATA_NODE.findall(metadata))
             if n in known])
        if out:
            return out
    if layer_name in known:
        return [layer_name]
    foreign = _FOREIGN.match(layer_name.strip())
    if foreign:
        inner = foreign.group(1)
        if "..." in inner:
            first, _, last = inner.partition("...")
            a, b = _resolve_part(first, known), _resolve_part(last, known)
            if a and b:
                lo, hi = sorted((known[a[0]], known[b[-1]]))
                add(list(node_order[lo:hi + 1]))
                return out
            add(a + b)
            return out
        layer_name = inner
    for part in _split_top(layer_name, " + "):
        add(_resolve_part(part, known))
    return out


# -- engine inspector output (pure) ----------------------------------------------------------

_DTYPE_WORDS = (
    ("int8", re.compile(r"\b(?:Int8|INT8|int8|I8)\b")),
    ("fp8", re.compile(r"\b(?:FP8|Fp8|fp8|E4M3)\b")),
    ("float16", re.compile(r"\b(?:FP16|Half|half|fp16)\b")),
    ("bfloat16", re.compile(r"\b(?:BF16|BFloat16|bf16)\b")),
    ("float32", re.compile(r"\b(?:FP32|Float|float|fp32)\b")),
    ("int32", re.compile(r"\b(?:Int32|INT32|int32)\b")),
    ("int64", re.compile(r"\b(?:Int64|INT64|int64)\b")),
    ("bool", re.compile(r"\b(?:Bool|BOOL|bool)\b")),
    ("uint8", re.compile(r"\b(?:UInt8|UINT8|uint8)\b")),
)


def format_precision(text: str) -> Optional[str]:
    """The data type in an inspector ``Format/Datatype`` string (``"Row major linear FP32"``,
    ``"Channel major FP16 format where channel % 8 == 0"``, or the short ``"Half"``)."""
    for name, pattern in _DTYPE_WORDS:
        if pattern.search(text or ""):
            return name
    return None


class EngineLayer(object):
    def __init__(self, name: str, layer_type: str, precision: Optional[str],
                 metadata: str) -> None:
        self.name = name
        self.layer_type = layer_type
        self.precision = precision
        self.metadata = metadata

    def __repr__(self) -> str:
        return "EngineLayer({!r}, {}, {})".format(self.name, self.layer_type, self.precision)


def tensor_precision(tensor: Dict[str, Any]) -> Optional[str]:
    """One inspector tensor's data type: ``Format/Datatype`` (8.2 - 10.x) or the separate
    ``DataType`` (and ``Format``) keys of TensorRT 11 (the issue 34 review of the 11.x
    inspector; ``Datatype``, an earlier reading, is still accepted)."""
    for key in ("DataType", "Datatype", "Format/Datatype", "Format"):
        if key in tensor:
            found = format_precision(str(tensor.get(key, "")))
            if found:
                return found
    return None


def engine_io_names(info: str) -> List[str]:
    """The engine's I/O tensor names: ``Bindings`` (8.x - 10.x) or ``I/O Tensors`` (11)."""
    try:
        doc = json.loads(info)
    except ValueError:
        return []
    if not isinstance(doc, dict):
        return []
    names = doc.get("Bindings", doc.get("I/O Tensors")) or []
    return [n if isinstance(n, str) else str(n.get("Name", "")) for n in names
            if isinstance(n, (str, dict))]


def parse_engine_information(info: str) -> List[EngineLayer]:
    """Layers of ``get_engine_information(LayerInformationFormat.JSON)``, in the JSON of 8.2 -
    10.x or 11. A layer's precision is its first output's data type (the input's for layers
    without outputs: what a layer computes in is what it produces, inputs may still be in the
    producer's type); None when the engine was built without detailed profiling (the entries
    are then bare names)."""
    try:
        doc = json.loads(info)
    except ValueError:
        return []
    layers: List[EngineLayer] = []
    for entry in doc.get("Layers", []) if isinstance(doc, dict) else []:
        if isinstance(entry, str):
            layers.append(EngineLayer(entry, "", None, ""))
            continue
        if not isinstance(entry, dict):
            continue
        precision = None
        for key in ("Outputs", "Inputs"):
            for tensor in entry.get(key) or []:
                if isinstance(tensor, dict):
                    precision = tensor_precision(tensor)
                    if precision:
                        break
            if precision:
                break
        layers.append(EngineLayer(str(entry.get("Name", "")), str(entry.get("LayerType", "")),
                                  precision, str(entry.get("Metadata", ""))))
    return layers


def node_precisions(layers: Sequence[EngineLayer], node_order: Sequence[str]) -> Dict[str, str]:
    """ONNX node -> the precision the engine runs it in. A node split over several engine
    layers gets the lowest float precision among them (reformat layers are ignored)."""
    out: Dict[str, str] = {}
    for layer in layers:
        if not layer.precision or layer.layer_type.lower() in ("reformat", "noop"):
            continue
        for node in layer_onnx_nodes(layer.name, node_order, layer.metadata):
            old = out.get(node)
            if old is None or (
                layer.precision in PRECISION_RANK
                and PRECISION_RANK[layer.precision] < PRECISION_RANK.get(old, 99)
            ):
                out[node] = layer.precision
    return out


def dla_nodes(layers: Sequence[EngineLayer], node_order: Sequence[str]) -> List[str]:
    """The ONNX nodes the engine inspector shows on the DLA: layers of type DLA (TensorRT
    merges a DLA subgraph into one ``{ForeignNode[first...last]}`` layer of that type)."""
    out: List[str] = []
    for layer in layers:
        if "dla" in layer.layer_type.lower():
            out.extend(n for n in layer_onnx_nodes(layer.name, node_order, layer.metadata)
                       if n not in out)
    return out


def precision_mismatches(asked: Dict[str, str], got: Dict[str, str],
                         floor: Optional[str] = None) -> List[Tuple[str, str, str]]:
    """(node, asked, got) for each node asked a float/int8 precision that the engine runs in
    another float/int8 precision, and, with ``floor`` (``plan_floor``), for every other node the
    engine runs below it (an fp32 plan's layers in fp16). Nodes the engine does not show, or
    whose layers output integers or booleans, are not mismatches (they cannot be
    constrained)."""
    out = []
    for node in sorted(set(asked) | (set(got) if floor else set())):
        have = got.get(node)
        if have not in PRECISION_RANK:
            continue
        if node in asked:
            if have != asked[node]:
                out.append((node, asked[node], str(have)))
        elif floor is not None and PRECISION_RANK[have] < PRECISION_RANK[floor]:
            out.append((node, floor, str(have)))
    return out


# -- parser errors (pure) --------------------------------------------------------------------

def parser_error(errors: Sequence[Tuple[str, str, str]], model_path: str) -> AgentError:
    """One AgentError from the parser's (code name, description, node) errors: an unsupported
    operator, type or shape -> ``unsupported_model``; anything else -> ``bad_model``."""
    if not errors:
        return AgentError("bad_model", "the ONNX parser rejected {} without saying why".format(
            model_path))
    unsupported = any("UNSUPPORTED" in code.upper() for code, _, _ in errors)
    lines = ["{}{}: {}".format(code, " (node {})".format(node) if node else "", desc.strip())
             for code, desc, node in errors]
    if unsupported:
        return AgentError("unsupported_model",
                          "TensorRT's ONNX parser cannot build {}: {}".format(
                              model_path, "; ".join(lines)), {"parser_errors": lines})
    return AgentError("bad_model",
                      "TensorRT's ONNX parser rejected {} (expected a valid ONNX model): "
                      "{}".format(model_path, "; ".join(lines)), {"parser_errors": lines})
