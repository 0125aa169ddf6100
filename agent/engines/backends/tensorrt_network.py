"""TensorRT glue shared by the build and the runner (``tensorrt_build`` and ``tensorrt_runner``):
the process-wide logger, our dtype table, network inputs, per-layer precision constraints,
layerwise output marking (Polygraphy's rule), dynamic ranges, a built engine's layers read
through the engine inspector, and the file that remembers an engine's DLA core.

TensorRT is imported lazily (callers pass the module in). Worker side: Python >= 3.6.
"""

import importlib
import json
import logging
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.engines.backends.base import Shape, TensorSpec
from agent.engines.backends.tensorrt_inspect import (
    EngineLayer,
    layer_onnx_nodes,
    parse_engine_information,
)
from agent.engines.backends.tensorrt_plan import NUMPY_DTYPES, TRT_DTYPES
from agent.errors import AgentError
from agent.fsio import atomic_write

if TYPE_CHECKING:  # the stubs (scripts/lib/trt_stubs.py)
    import tensorrt

log = logging.getLogger("agent.engines.backends.tensorrt")  # one name for all TensorRT messages


_LOGGER: Any = None


def _make_logger() -> Any:
    """The process-wide TensorRT logger. TensorRT keeps the first logger it was given while any
    builder or runtime lives, so a nested builder (the range engine of the percentile path) or
    a runner inside a build would log into the outer one: there is one logger, it routes to
    ``logging`` and keeps the last errors and warnings for the current job's messages."""
    global _LOGGER
    import tensorrt as trt

    if _LOGGER is not None and _LOGGER.module is trt:
        return _LOGGER

    class Logger(trt.ILogger):  # type: ignore[misc]
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.module = trt
            self.messages: List[str] = []  # the last 50 errors and warnings
            self.count = 0  # how many were ever kept: marks stay valid after trimming

        def log(self, severity: "trt.ILogger.Severity", msg: str) -> None:
            level = int(severity)
            if level <= int(trt.ILogger.Severity.ERROR):
                log.error("TensorRT: %s", msg)
            elif level <= int(trt.ILogger.Severity.WARNING):
                log.warning("TensorRT: %s", msg)
            else:
                log.debug("TensorRT: %s", msg)
                return
            self.messages.append(msg)
            self.count += 1
            del self.messages[:-50]

        def mark(self) -> int:
            """Where the current job's messages start (for ``since``)."""
            return self.count

        def since(self, mark: int) -> List[str]:
            """The errors and warnings kept since ``mark`` (at most the last 50)."""
            new = self.count - mark
            return list(self.messages[-new:]) if new > 0 else []

    _LOGGER = Logger()
    return _LOGGER


def numpy_dtype(trt: Any, dtype: Any, what: str) -> Any:
    """The numpy type of a TensorRT data type, from our table (``NUMPY_DTYPES``), not
    ``trt.nptype`` (broken on NumPy >= 1.24 up to TensorRT 8.5, raising for bf16/fp8)."""
    for alias, name in NUMPY_DTYPES:
        if hasattr(trt, alias) and dtype == getattr(trt, alias):
            if name is None:
                raise AgentError(
                    "unsupported_model",
                    "{} has TensorRT type {}, which has no numpy equivalent (expected float32, "
                    "float16, int8, int32, int64, bool or uint8 I/O)".format(what, alias))
            return np.dtype(name).type
    raise AgentError("unsupported_model",
                     "{} has an unknown TensorRT type {}".format(what, dtype))


def _ints(dims: "tensorrt.Dims") -> Tuple[int, ...]:
    return tuple(int(dims[i]) for i in range(len(dims)))


def _dims(dims: "tensorrt.Dims") -> Tuple[Optional[int], ...]:
    """A TensorRT shape as a TensorSpec shape (None for dynamic dimensions)."""
    return tuple(None if d < 0 else d for d in _ints(dims))


def _set_profile_shape(profile: "tensorrt.IOptimizationProfile", name: str, lo: Shape,
                       opt: Shape, hi: Shape) -> None:
    import tensorrt as trt

    profile.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))


def _network_inputs(network: "tensorrt.INetworkDefinition") -> List[TensorSpec]:
    import tensorrt as trt

    specs = []
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        specs.append(TensorSpec(tensor.name,
                                numpy_dtype(trt, tensor.dtype, "input {!r}".format(tensor.name)),
                                _dims(tensor.shape)))
    return specs


_INTEGER_DTYPES = ("int32", "int64", "bool", "uint8", "int8", "int4", "fp8")
# IDENTITY: the 8.x parser imports Cast as an identity layer with setOutputType (onnx-tensorrt
# builtin_op_importers.cpp); pinning it to float32 would delete the cast. CAST: the same on 10.
_UNCONSTRAINABLE_LAYERS = ("CONSTANT", "SHAPE", "ASSERTION", "CONDITION", "CONDITIONAL_INPUT",
                           "CONDITIONAL_OUTPUT", "TRIP_LIMIT", "ITERATOR", "LOOP_OUTPUT",
                           "RECURRENCE", "IDENTITY", "CAST")


def apply_layer_precisions(
    trt: Any, network: "tensorrt.INetworkDefinition", asked: Dict[str, str],
    node_order: Sequence[str], others: Optional[str] = None,
) -> Tuple[Dict[str, List[str]], List[Tuple[str, str]]]:
    """Set ``layer.precision`` (and, for float precisions, every output type) on the network
    layers of each asked ONNX node, and with ``others`` on every other layer that can be
    constrained. Returns (node -> constrained layer names, [(layer, why skipped)]): layers
    with integer/bool outputs, shape-tensor outputs, constant and shape layers, casts and
    identities cannot be constrained (only asked layers are listed as skipped)."""
    applied: Dict[str, List[str]] = {}
    skipped: List[Tuple[str, str]] = []
    fixed_types = [getattr(trt.LayerType, n) for n in _UNCONSTRAINABLE_LAYERS
                   if hasattr(trt.LayerType, n)]
    int_types = [getattr(trt, n) for n in _INTEGER_DTYPES if hasattr(trt, n)]
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        nodes = [n for n in layer_onnx_nodes(layer.name, node_order,
                                             getattr(layer, "metadata", "") or "")
                 if n in asked]
        if not nodes:
            if others is not None:
                _pin_quietly(trt, layer, others, fixed_types, int_types)
            continue
        precision = asked[nodes[0]]
        if layer.type in fixed_types:
            skipped.append((layer.name, "{} layer".format(layer.type)))
            continue
        why = ""
        for j in range(layer.num_outputs):
            tensor = layer.get_output(j)
            if tensor.dtype in int_types and not (precision == "int8" and tensor.dtype == trt.int8):
                why = "{} output".format(tensor.dtype)
            elif getattr(tensor, "is_shape_tensor", False):
                why = "shape tensor output"
        if why:
            skipped.append((layer.name, why))
            continue
        dtype = getattr(trt, TRT_DTYPES[precision])
        layer.precision = dtype
        if precision != "int8":  # an int8 layer may still hand float to its consumers
            for j in range(layer.num_outputs):
                layer.set_output_type(j, dtype)
        for node in nodes:
            applied.setdefault(node, []).append(layer.name)
    return applied, skipped


def _pin_quietly(trt: Any, layer: "tensorrt.ILayer", precision: str, fixed_types: List[Any],
                 int_types: List[Any]) -> bool:
    """Pin a layer nobody named to the plan's precision when it can be constrained."""
    if layer.type in fixed_types:
        return False
    for j in range(layer.num_outputs):
        tensor = layer.get_output(j)
        if tensor.dtype in int_types or getattr(tensor, "is_shape_tensor", False):
            return False
    dtype = getattr(trt, TRT_DTYPES[precision])
    layer.precision = dtype
    if precision != "int8":
        for j in range(layer.num_outputs):
            # A network output keeps its type: pinning must not change the engine's I/O.
            if not getattr(layer.get_output(j), "is_network_output", False):
                layer.set_output_type(j, dtype)
    return True


_LOOP_START = ("TRIP_LIMIT", "ITERATOR", "RECURRENCE")
_NOT_MARKED = ("SHAPE", "CONSTANT")


def mark_layerwise(trt: Any, network: "tensorrt.INetworkDefinition") -> List[str]:
    """Mark every layer output the range engine may expose; returns the network's outputs.

    Polygraphy's ``backend.trt.util.mark_layerwise`` when Polygraphy is installed (it tracks
    TensorRT's layer types across versions); otherwise the same rule: no shape or constant
    layers, nothing inside a loop body (between a loop's first layer and its LOOP_OUTPUT), as
    TensorRT cannot expose those."""
    try:  # optional (requirements-jetson*.txt): the rule below is Polygraphy's
        polygraphy_trt: Any = importlib.import_module("polygraphy.backend.trt.util")
    except ImportError:
        polygraphy_trt = None
    if polygraphy_trt is not None and hasattr(polygraphy_trt, "mark_layerwise"):
        polygraphy_trt.mark_layerwise(network)
    else:
        starts = [getattr(trt.LayerType, n) for n in _LOOP_START if hasattr(trt.LayerType, n)]
        skip = [getattr(trt.LayerType, n) for n in _NOT_MARKED if hasattr(trt.LayerType, n)]
        end = getattr(trt.LayerType, "LOOP_OUTPUT", None)
        in_loop = False
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if layer.type in starts:
                in_loop = True
            elif end is not None and layer.type == end:
                in_loop = False
            if in_loop or layer.type in skip:
                continue
            for j in range(layer.num_outputs):
                tensor = layer.get_output(j)
                if tensor is not None and not tensor.is_network_output:
                    network.mark_output(tensor)
    return [network.get_output(i).name for i in range(network.num_outputs)]


def _set_dynamic_ranges(network: "tensorrt.INetworkDefinition", amax: Dict[str, float]) -> int:
    """Implicit INT8 without a calibrator (percentile): each known tensor gets its range."""
    count = 0
    tensors = [network.get_input(i) for i in range(network.num_inputs)]
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        tensors.extend(layer.get_output(j) for j in range(layer.num_outputs))
    for tensor in tensors:
        value = amax.get(tensor.name)
        if value is not None and value > 0:
            tensor.set_dynamic_range(-float(value), float(value))
            count += 1
    return count


def inspect_engine(runtime: "tensorrt.Runtime", serialized: Any) -> Optional[List[EngineLayer]]:
    """The built engine's layers as the engine inspector reports them (TensorRT >= 8.2)."""
    import tensorrt as trt

    engine = runtime.deserialize_cuda_engine(serialized)
    if engine is None or not hasattr(engine, "create_engine_inspector"):
        return None
    inspector = engine.create_engine_inspector()
    return parse_engine_information(
        inspector.get_engine_information(trt.LayerInformationFormat.JSON))


# -- plugins ---------------------------------------------------------------------------------

def register_plugins(trt: Any, logger: Any, plugins: Sequence[Dict[str, str]] = ()) -> List[str]:
    """TensorRT's standard plugins (``init_libnvinfer_plugins``, once per process) and the
    plan's plugin libraries (each checked against its pinned SHA-256 first), before a parse
    or a deserialization: an engine with plugin layers does not load without them (NVIDIA's
    samples and Polygraphy do the same). Returns the libraries loaded now."""
    from agent.engines.plugins import verify_pinned

    if not getattr(logger, "plugins_ready", False) and hasattr(trt, "init_libnvinfer_plugins"):
        trt.init_libnvinfer_plugins(logger, "")
        logger.plugins_ready = True
    loaded = getattr(logger, "plugin_libraries", None)
    if loaded is None:
        loaded = logger.plugin_libraries = set()
    done = []
    for entry in plugins:
        path = verify_pinned(entry)
        if path in loaded:
            continue
        registry = trt.get_plugin_registry()
        if hasattr(registry, "load_library"):  # TensorRT >= 8.6
            mark = logger.mark()
            if registry.load_library(path) is None:
                raise AgentError("bad_engine", "TensorRT could not load plugin library {}: "
                                 "{}".format(path, " | ".join(logger.since(mark)[-3:])
                                             or "no message"))
        else:  # before 8.6 a library registers its creators when it is loaded
            import ctypes

            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as exc:
                raise AgentError("bad_engine", "cannot load plugin library {}: {}".format(
                    path, exc))
        loaded.add(path)
        done.append(path)
    return done


def plugins_path(engine_path: str) -> str:
    """The file beside an engine naming the plugin libraries it needs ({path, sha256} list)."""
    return engine_path + ".plugins.json"


def write_plugins(engine_path: str, plugins: Sequence[Dict[str, str]]) -> None:
    path = plugins_path(engine_path)
    if plugins:
        atomic_write(path, json.dumps([dict(p) for p in plugins], sort_keys=True).encode())
    elif os.path.exists(path):
        os.remove(path)


def read_plugins(engine_path: str) -> List[Dict[str, str]]:
    try:
        with open(plugins_path(engine_path), "rb") as f:
            data = f.read(1 << 16)
    except OSError:
        return []
    try:
        items = json.loads(data.decode("utf-8"))
    except ValueError as exc:
        raise AgentError("bad_engine", "{}: expected the engine's plugin list (JSON), found "
                         "unreadable data: {}".format(plugins_path(engine_path), exc))
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise AgentError("bad_engine", "{}: expected a JSON list of objects".format(
            plugins_path(engine_path)))
    return [{"path": str(i.get("path")), "sha256": str(i.get("sha256"))} for i in items[:8]]


# -- DLA placement ---------------------------------------------------------------------------

def dla_placement(trt: Any, network: "tensorrt.INetworkDefinition",
                  config: "tensorrt.IBuilderConfig", node_order: Sequence[str]
                  ) -> Dict[str, List[str]]:
    """Where TensorRT will run each ONNX node of a DLA build: ``config.can_run_on_DLA(layer)``
    (TensorRT >= 8.0.1) for each network layer; a node any of whose layers cannot run on DLA
    is on the GPU (GPU fallback moves it there silently). ``{"dla": [...], "gpu": [...]}``."""
    dla: List[str] = []
    gpu: List[str] = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        nodes = layer_onnx_nodes(layer.name, node_order, getattr(layer, "metadata", "") or "")
        on_dla = bool(config.can_run_on_DLA(layer))
        for node in nodes or [layer.name]:
            if on_dla and node not in gpu:
                if node not in dla:
                    dla.append(node)
            elif not on_dla and node not in gpu:
                gpu.append(node)
                if node in dla:
                    dla.remove(node)
    return {"dla": dla, "gpu": gpu}


# -- the platform an engine was built for ---------------------------------------------------

def platform_path(engine_path: str) -> str:
    """The file beside an engine that records the platform it was built on (JSON)."""
    return engine_path + ".platform.json"


def write_platform(engine_path: str, record: Dict[str, str]) -> None:
    atomic_write(platform_path(engine_path),
                 json.dumps(record, sort_keys=True).encode("utf-8"))


def read_platform(engine_path: str) -> Optional[Dict[str, str]]:
    """The recorded platform, or None for an engine built before it was recorded."""
    try:
        with open(platform_path(engine_path), "rb") as f:
            data = f.read(1 << 16)
    except OSError:
        return None
    try:
        record = json.loads(data.decode("utf-8"))
    except ValueError as exc:
        raise AgentError("bad_engine", "{}: expected the engine's platform record (JSON), "
                         "found unreadable data: {}".format(platform_path(engine_path), exc))
    if not isinstance(record, dict):
        raise AgentError("bad_engine", "{}: expected a JSON object, found {}".format(
            platform_path(engine_path), type(record).__name__))
    return {str(k): str(v) for k, v in record.items()}


# -- DLA core of an engine ------------------------------------------------------------------

def dla_core_path(engine_path: str) -> str:
    """The file beside an engine that names the DLA core it was built for."""
    return engine_path + ".dla-core"


def _write_dla_core(engine_path: str, core: Optional[int]) -> None:
    path = dla_core_path(engine_path)
    if core is not None:
        atomic_write(path, "{}\n".format(int(core)).encode())
    elif os.path.exists(path):
        os.remove(path)


def read_dla_core(engine_path: str) -> Optional[int]:
    """The DLA core an engine was built for (``--dla-core``), None for a GPU engine."""
    try:
        with open(dla_core_path(engine_path), "rb") as f:
            text = f.read(16).decode("ascii", "replace").strip()
    except OSError:
        return None
    if not text:
        return None
    if not text.isdigit() or len(text) > 3:
        raise AgentError("bad_engine", "{}: expected a DLA core number, found {!r}".format(
            dla_core_path(engine_path), text[:20]))
    return int(text)
