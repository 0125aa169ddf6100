"""What to ask TensorRT for a plan, and how to read its answers: pure functions of a
``BuildPlan``, a TensorRT version and the text TensorRT produces (layer names, engine-inspector
JSON, parser errors). No TensorRT needed: ``tests/unit/test_tensorrt_backend.py`` checks them,
and ``agent.engines.backends.tensorrt`` carries them out on a device.

TensorRT versions that matter (docs/tensorrt.md has the table): 8.0.1 (JetPack 4.6), 8.2
(JetPack 4.6.1+), 8.4 / 8.5 (JetPack 5), 8.6, 10.3 (JetPack 6), 10.x (JetPack 7) and >= 10.12 /
11 (explicitly typed only). Older than 8.0 is refused. Worker side: Python >= 3.6.
"""

import json
import re
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.engines.backends.base import BuildPlan, Shape, TensorSpec
from agent.errors import AgentError

if TYPE_CHECKING:
    # mypy checks every TensorRT name the settings can hold against the stubs (10.13 API);
    # names that exist only on older versions are branched on explicitly where used.
    import tensorrt

    _NAMES_USED = (
        tensorrt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH,
        tensorrt.NetworkDefinitionCreationFlag.STRONGLY_TYPED,
        tensorrt.BuilderFlag.FP16, tensorrt.BuilderFlag.INT8, tensorrt.BuilderFlag.TF32,
        tensorrt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS,
        tensorrt.BuilderFlag.PREFER_PRECISION_CONSTRAINTS,
        tensorrt.BuilderFlag.GPU_FALLBACK,
        tensorrt.MemoryPoolType.WORKSPACE, tensorrt.DeviceType.DLA,
        tensorrt.ProfilingVerbosity.DETAILED,
    )

Version = Tuple[int, int, int]
ProfileShapes = Dict[str, Tuple[Shape, Shape, Shape]]

# From this version on, precision is expressed in the graph (implicit INT8 is deprecated from
# 10.1 and gone in 11).
STRONGLY_TYPED_FROM = (10, 12, 0)
# 7.x has no build_serialized_network and no timing cache; 8.0.1 is JetPack 4.6's.
MIN_TENSORRT = (8, 0, 1)
# TensorRT DataType (module alias) -> numpy dtype name. Ours, not ``trt.nptype``: up to 8.5 that
# builds its table with ``np.bool`` (gone in NumPy 1.24), and on 10/11 it raises for bf16/fp8.
# Types without a numpy equivalent map to None (refused with a clear error where met).
NUMPY_DTYPES = (("float32", "float32"), ("float16", "float16"), ("int8", "int8"),
                ("int32", "int32"), ("int64", "int64"), ("bool", "bool"), ("uint8", "uint8"),
                ("bfloat16", None), ("fp8", None), ("int4", None), ("fp4", None),
                ("e8m0", None))
# Layer precision names (Polygraphy's) -> attribute of the tensorrt module.
TRT_DTYPES = {"float32": "float32", "float16": "float16", "int8": "int8"}
# Ranks used to tell which of two precisions is the lower one.
_PRECISION_RANK = {"int8": 0, "fp8": 0, "float16": 1, "bfloat16": 1, "float32": 2}


# -- versions --------------------------------------------------------------------------------

def parse_version(text: str) -> Version:
    """``"8.6.1.6"`` -> (8, 6, 1); missing parts are 0."""
    match = re.match(r"^\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", str(text))
    if not match:
        raise AgentError("backend_unavailable",
                         "TensorRT version must look like 8.6.1, found {!r}".format(text))
    return (int(match.group(1)), int(match.group(2) or 0), int(match.group(3) or 0))


class Features(object):
    """What a TensorRT version offers, as far as this backend cares."""

    def __init__(self, version: Version) -> None:
        self.version = version
        # ONNX networks need EXPLICIT_BATCH on 8.x; 10.x is always explicit batch.
        self.explicit_batch_flag = version < (10, 0, 0)
        # set_memory_pool_limit(WORKSPACE) from 8.4; max_workspace_size before.
        self.memory_pool_api = version >= (8, 4, 0)
        # Tensor-name I/O (num_io_tensors, set_tensor_address, execute_async_v3) from 8.5;
        # the bindings API before (and gone in 10).
        self.tensor_io_api = version >= (8, 5, 0)
        # IEngineInspector and ProfilingVerbosity.DETAILED arrived in 8.2.
        self.engine_inspector = version >= (8, 2, 0)
        # Per-layer metadata naming the ONNX node ("[ONNX Layer: name...]"): the 8.6 parser
        # sets it (onnx-tensorrt release/8.6-GA onnx2trt_utils.cpp), as does every 10.x.
        self.layer_metadata = version >= (8, 6, 0)
        self.strongly_typed = version >= STRONGLY_TYPED_FROM
        # Calibrators and set_dynamic_range exist up to 10.x.
        self.implicit_int8 = version < (11, 0, 0)
        # OBEY / PREFER_PRECISION_CONSTRAINTS arrived in 8.2; 8.0 has only STRICT_TYPES.
        self.constraint_flags = version >= (8, 2, 0)
        self.supported = version >= MIN_TENSORRT
        # DLA on Jetson: up to 10.7, none in 11.0 - 11.4.0, back in 11.4.1 (AGX Orin, strongly
        # typed only). 10.8 - 10.x: the DLA libraries are no longer shipped for Jetson.
        self.dla = version < (10, 8, 0) or version >= (11, 4, 1)

    def to_dict(self) -> Dict[str, Any]:
        return {k: v for k, v in sorted(vars(self).items()) if k != "version"}


# -- plan -> builder settings (pure) ---------------------------------------------------------

class BuilderSettings(object):
    """The builder calls a plan produces on one TensorRT version (names, not enum values)."""

    def __init__(self) -> None:
        self.network_flags: List[str] = []
        self.set_flags: List[str] = []
        self.clear_flags: List[str] = []
        # ("memory_pool" or "max_workspace_size", bytes)
        self.workspace: Optional[Tuple[str, int]] = None
        self.dla_core: Optional[int] = None
        self.detailed_profiling = False
        self.layer_constraints = False  # apply layer.precision / set_output_type
        self.strongly_typed = False
        self.int8_source: Optional[str] = None  # "calibrator" | "ranges" | "qdq" | None
        # Weakly typed: the precision every constrainable layer not named gets (see defect
        # "weak typing lowers every layer" in docs/tensorrt.md), None to leave them free.
        self.pin_others: Optional[str] = None
        self.notes: List[str] = []

    def to_dict(self) -> Dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(vars(self).items())}


DLA_VERSIONS_NOTE = ("TensorRT {} is not listed with DLA on Jetson (DLA: TensorRT <= 10.7, or "
                     ">= 11.4.1 on AGX Orin, strongly typed)")
# The precision a weakly typed plan allows every layer it does not name (None: any).
_PLAN_FLOOR = {"fp32": "float32", "fp16": "float16", "int8": None, "best": None}


def version_text(version: Version) -> str:
    return ".".join(str(v) for v in version)


def check_supported(version: Version) -> None:
    """``unsupported_tensorrt`` for TensorRT older than ``MIN_TENSORRT``."""
    if not Features(version).supported:
        raise AgentError(
            "unsupported_tensorrt",
            "TensorRT {} is too old: this agent needs TensorRT >= {} (JetPack >= 4.6); 7.x has "
            "no build_serialized_network and no timing cache".format(
                version_text(version), version_text(MIN_TENSORRT)))


def _check_dla(plan: BuildPlan, features: Features) -> None:
    """What can be refused before TensorRT is asked; the device's own count
    (``builder.num_DLA_cores``) is checked by the backend before the build."""
    if plan.dla_core is None:
        return
    if int(plan.dla_core) < 0:
        raise AgentError("bad_argument",
                         "--dla-core must be >= 0, found {}".format(plan.dla_core))
    if plan.precision == "fp32" and "float16" not in plan.layer_precisions.values() \
            and "int8" not in plan.layer_precisions.values():
        # DLA runs fp16 and int8 only: an fp32 plan would silently run on the GPU.
        raise AgentError(
            "unsupported_precision",
            "--dla-core {} with precision fp32: DLA runs fp16 or int8 only, so every layer "
            "would fall back to the GPU; expected --precision fp16 or int8".format(
                plan.dla_core))


def builder_settings(plan: BuildPlan, version: Version) -> BuilderSettings:
    """What to ask TensorRT for ``plan`` on TensorRT ``version``."""
    check_supported(version)
    features = Features(version)
    _check_dla(plan, features)
    s = BuilderSettings()
    s.strongly_typed = features.strongly_typed
    asked = set(plan.layer_precisions.values())
    if s.strongly_typed:
        # Precision lives in the graph; FP16/INT8 flags and constraints are refused here.
        s.network_flags.append("STRONGLY_TYPED")
        if plan.needs_calibration:
            s.int8_source = "qdq"
    else:
        if features.explicit_batch_flag:
            s.network_flags.append("EXPLICIT_BATCH")
        if plan.precision == "int8" and "float16" in asked:
            # The FP16 flag would let every layer go fp16 (NvInfer.h: unconstrained layers are
            # chosen "based on global performance considerations and the flags"), and an int8
            # engine cannot pin "int8 where possible, else fp32" per layer.
            raise AgentError(
                "unsupported_precision",
                "int8 with float16 layers on TensorRT {} (weakly typed) would let every layer "
                "run in fp16; expected float32 layers (--keep-precision float32), precision "
                "best, or TensorRT >= {} (strongly typed)".format(
                    version_text(version), version_text(STRONGLY_TYPED_FROM)))
        if plan.precision in ("fp16", "best") or "float16" in asked:
            s.set_flags.append("FP16")
        if plan.needs_calibration:
            s.set_flags.append("INT8")
            algorithm = plan.calibration.algorithm if plan.calibration else "entropy2"
            s.int8_source = "ranges" if algorithm == "percentile" else "calibrator"
        constraints = plan.precision_constraints
        if plan.layer_precisions and constraints == "none":
            # Per-layer precisions do nothing without a constraints flag (Polygraphy warns
            # and ignores them); a precision search relies on them, so prefer is implied.
            constraints = "prefer"
            s.notes.append("layer precisions need precision constraints: using prefer")
        if constraints != "none" and not features.constraint_flags:
            # TensorRT 8.0: STRICT_TYPES (constraints that may fall back, like prefer).
            s.set_flags.append("STRICT_TYPES")
            if constraints == "obey":
                s.notes.append("TensorRT 8.0 has no OBEY_PRECISION_CONSTRAINTS: STRICT_TYPES "
                               "used (may fall back; mismatches are reported)")
        elif constraints == "obey":
            s.set_flags.append("OBEY_PRECISION_CONSTRAINTS")
        elif constraints == "prefer":
            s.set_flags.append("PREFER_PRECISION_CONSTRAINTS")
        s.layer_constraints = bool(plan.layer_precisions)
        floor = _PLAN_FLOOR[plan.precision]
        lower = [p for p in asked if p != floor and floor is not None
                 and _PRECISION_RANK[p] < _PRECISION_RANK[floor]]
        if lower:
            # A flag set for a few layers must not lower the others: pin them to the plan's own
            # precision, as the strongly typed and host paths compute them.
            s.pin_others = floor
            s.notes.append("layers not named are pinned to {} ({} asked for some)".format(
                floor, "/".join(sorted(set(lower)))))
    # TF32 would silently reduce every float32 layer (pinned ones too): only "best" allows it.
    if plan.precision == "best":
        s.set_flags.append("TF32")
    else:
        s.clear_flags.append("TF32")
    if plan.workspace_bytes:
        api = "memory_pool" if features.memory_pool_api else "max_workspace_size"
        s.workspace = (api, int(plan.workspace_bytes))
    if plan.dla_core is not None:
        s.dla_core = int(plan.dla_core)
        s.set_flags.append("GPU_FALLBACK")
        if not features.dla:
            s.notes.append(DLA_VERSIONS_NOTE.format(version_text(version)))
    if features.engine_inspector:
        s.detailed_profiling = True
    else:
        s.notes.append("engine inspector unavailable before TensorRT 8.2: layer precisions "
                       "are not read back")
    return s


def network_creation_flags(trt: Any, settings: BuilderSettings) -> int:
    flags = 0
    for name in settings.network_flags:
        flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, name))
    return flags


def apply_builder_settings(trt: Any, config: "tensorrt.IBuilderConfig",
                           settings: BuilderSettings) -> None:
    """Carry out ``settings`` on a builder config (layer precisions and profiles apart).
    ``trt`` is the tensorrt module (a recorded fake in the unit tests)."""
    for name in settings.set_flags:
        config.set_flag(getattr(trt.BuilderFlag, name))
    for name in settings.clear_flags:
        config.clear_flag(getattr(trt.BuilderFlag, name))
    if settings.workspace is not None:
        api, size = settings.workspace
        if api == "memory_pool":
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, size)
        else:
            config.max_workspace_size = size  # type: ignore[attr-defined]  # TensorRT < 8.4
    if settings.dla_core is not None:
        # Checked against builder.num_DLA_cores by the backend before the build.
        config.default_device_type = trt.DeviceType.DLA
        config.DLA_core = settings.dla_core
    if settings.detailed_profiling:
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED


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
    (the backend names every node before parsing, see ``graph.load_model``), adds ``_<n>`` for
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
    ``Datatype`` (and ``Format``) keys of TensorRT 11."""
    for key in ("Datatype", "Format/Datatype", "Format"):
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
                layer.precision in _PRECISION_RANK
                and _PRECISION_RANK[layer.precision] < _PRECISION_RANK.get(old, 99)
            ):
                out[node] = layer.precision
    return out


def plan_floor(precision: str) -> Optional[str]:
    """The lowest precision a plan allows the layers it does not name (None: any)."""
    return _PLAN_FLOOR.get(precision)


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
        if have not in _PRECISION_RANK:
            continue
        if node in asked:
            if have != asked[node]:
                out.append((node, asked[node], str(have)))
        elif floor is not None and _PRECISION_RANK[have] < _PRECISION_RANK[floor]:
            out.append((node, floor, str(have)))
    return out


# -- shapes (pure) ---------------------------------------------------------------------------

def _dynamic(dim: Any) -> bool:
    return dim is None or bool(isinstance(dim, (int, np.integer)) and dim < 0)


def profile_shapes(inputs: Sequence[TensorSpec], shapes: ProfileShapes) -> ProfileShapes:
    """The optimization profile: plan.shapes checked against the network inputs. Inputs with
    dynamic dimensions need an entry (``dynamic_shape`` otherwise); static inputs may omit
    theirs. Every shape must have the input's rank and keep its static dimensions."""
    names = {spec.name for spec in inputs}
    unknown = sorted(set(shapes) - names)
    if unknown:
        raise AgentError("bad_argument",
                         "shape given for {!r}, which is not a model input (inputs: {})".format(
                             unknown[0], ", ".join(sorted(names))))
    out: ProfileShapes = {}
    missing = []
    for spec in inputs:
        dynamic = any(_dynamic(d) for d in spec.shape)
        if spec.name not in shapes:
            if dynamic:
                missing.append(spec)
            continue
        triple = tuple(tuple(int(d) for d in s) for s in shapes[spec.name])
        if len(triple) != 3:
            raise AgentError("bad_argument",
                             "input {!r}: expected (min, opt, max) shapes, found {}".format(
                                 spec.name, len(triple)))
        for label, shape in zip(("min", "opt", "max"), triple):
            ok = len(shape) == len(spec.shape) and all(
                _dynamic(want) or want == got for want, got in zip(spec.shape, shape))
            if not ok or any(d < 0 for d in shape):
                raise AgentError(
                    "bad_argument",
                    "input {!r}: {} shape {} does not fit the model's shape {}".format(
                        spec.name, label, list(shape), shape_text(spec.shape)))
        lo, opt, hi = triple
        if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
            raise AgentError("bad_argument",
                             "input {!r}: expected min <= opt <= max per dimension, found {} "
                             "{} {}".format(spec.name, list(lo), list(opt), list(hi)))
        out[spec.name] = (lo, opt, hi)
    if missing:
        raise AgentError(
            "dynamic_shape",
            "input(s) {} have dynamic dimensions and no shape profile was given (expected "
            "min/opt/max shapes for each, e.g. {}:{})".format(
                ", ".join("{!r} {}".format(s.name, shape_text(s.shape)) for s in missing),
                missing[0].name,
                "x".join("1" if _dynamic(d) else str(int(d)) for d in missing[0].shape)),
            {"inputs": [s.name for s in missing]})
    return out


def shape_text(shape: Sequence[Any]) -> str:
    return "[" + ", ".join("?" if _dynamic(d) else str(int(d)) for d in shape) + "]"


def calibration_shapes(inputs: Sequence[TensorSpec], profile: ProfileShapes,
                       batch_size: int) -> Tuple[int, Dict[str, Shape], List[str]]:
    """The batch size and per-input shapes calibration runs with, plus notes.

    A static leading dimension fixes the batch size (the requested one is overridden with a
    note); a dynamic one takes the requested batch size; other dynamic dimensions take the
    profile's opt value."""
    notes: List[str] = []
    static = sorted({int(s.shape[0]) for s in inputs if s.shape and not _dynamic(s.shape[0])})
    batch = int(batch_size)
    if static:
        if len(static) > 1:
            raise AgentError("unsupported_model",
                             "inputs have different fixed batch sizes {}: cannot "
                             "calibrate".format(static))
        if static[0] != batch:
            notes.append("calibration batch size {} replaced by the model's fixed batch "
                         "size {}".format(batch, static[0]))
            batch = static[0]
    out: Dict[str, Shape] = {}
    for spec in inputs:
        opt = profile[spec.name][1] if spec.name in profile else None
        dims = []
        for axis, dim in enumerate(spec.shape):
            if not _dynamic(dim):
                dims.append(int(dim))
            elif axis == 0:
                dims.append(batch)
            else:
                dims.append(int(opt[axis]) if opt is not None else 1)
        out[spec.name] = tuple(dims)
    return batch, out, notes


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
