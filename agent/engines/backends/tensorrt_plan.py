"""What to ask TensorRT for a plan: pure functions of a ``BuildPlan`` and a TensorRT version
(the features a version offers, the builder flags and settings a plan turns into). No TensorRT
needed: ``tests/unit/engines/test_tensorrt_plan.py`` checks them, and
``tensorrt_build`` carries them out on a device. Reading TensorRT's answers is
``tensorrt_inspect``'s, shape profiles are ``tensorrt_shapes``'.

TensorRT versions that matter (docs/tensorrt.md has the table): 8.0.1 (JetPack 4.6), 8.2
(JetPack 4.6.1+), 8.4 / 8.5 (JetPack 5), 8.6, 10.3 (JetPack 6), 10.x (JetPack 7) and >= 10.12 /
11 (explicitly typed only). Older than 8.0 is refused. Worker side: Python >= 3.6.
"""

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from agent.engines.backends.base import BuildPlan
from agent.errors import AgentError
from agent.version_key import version_key

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
PRECISION_RANK = {"int8": 0, "fp8": 0, "float16": 1, "bfloat16": 1, "float32": 2}


# -- versions --------------------------------------------------------------------------------

def parse_version(text: str) -> Version:
    """``"8.6.1.6"`` -> (8, 6, 1); missing parts are 0."""
    version = version_key(text, 3)
    if not version:
        raise AgentError("backend_unavailable",
                         "TensorRT version must look like 8.6.1, found {!r}".format(text))
    return version  # type: ignore[return-value]


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
        # IProgressMonitor (phases, steps, cancel) on the builder config from 10.0.
        self.progress_monitor = version >= (10, 0, 0)

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


# The engine-compatibility settings of TensorRT 8.6+ this backend builds with: neither the
# hardware-compatibility level (AMPERE_PLUS lets an engine run on other Ampere+ GPUs) nor the
# VERSION_COMPATIBLE flag is set, so an engine runs only on the GPU, SM count and TensorRT it
# was built with. They enter the engine's key and platform record all the same, so a build
# that sets them one day gets other keys.
HARDWARE_COMPATIBILITY = "none"
VERSION_COMPATIBLE = False

# The workspace a plan without --workspace gets where TensorRT's own default is 0 bytes (before
# 8.4, NvInfer.h: "By default the workspace size is 0"): trtexec's and Polygraphy's 8.2
# default. From 8.4 the default is the device's memory, and the plan leaves it alone.
DEFAULT_WORKSPACE = 16 << 20
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


def check_dla_cores(core: Optional[int], count: int, features: Features, version: str) -> None:
    """``unsupported_precision`` when the DLA ``core`` asked for is not below the ``count``
    TensorRT ``version`` reports on this device (``builder.num_DLA_cores``)."""
    if core is None:
        return
    if core >= count:
        why = "" if features.dla else "; " + DLA_VERSIONS_NOTE.format(version)
        raise AgentError(
            "unsupported_precision",
            "--dla-core {}: TensorRT {} reports {} DLA core(s) on this device (expected a "
            "core index below that, or no --dla-core){}".format(core, version, count, why),
            {"dla_cores": count})


def check_dla_profile(core: Optional[int], profile: Dict[str, Any]) -> None:
    """``dla_dynamic_shape`` for a DLA build whose profile is not one fixed shape per input:
    DLA has no dynamic dimensions (TensorRT: min, opt and max must be equal, and the runtime
    shapes those of the build)."""
    if core is None:
        return
    dynamic = {name: triple for name, triple in profile.items()
               if not (tuple(triple[0]) == tuple(triple[1]) == tuple(triple[2]))}
    if dynamic:
        name, (lo, opt, hi) = sorted(dynamic.items())[0]
        raise AgentError(
            "dla_dynamic_shape",
            "--dla-core {}: DLA needs one fixed shape per input (min = opt = max); input {!r} "
            "has min {}, opt {}, max {}; expected e.g. --shapes {}:{}".format(
                core, name, list(lo), list(opt), list(hi), name,
                "x".join(str(int(d)) for d in opt)),
            {"inputs": sorted(dynamic)})


def builder_settings(plan: BuildPlan, version: Version,
                     quantization: str = "none") -> BuilderSettings:
    """What to ask TensorRT for ``plan`` on TensorRT ``version``; ``quantization`` is the
    model's (``quantization.quantization``): a Q/DQ model is never calibrated (TensorRT
    ignores a calibrator in explicit-precision mode) and, weakly typed, always gets the INT8
    flag (its Q/DQ layers need it, whatever the plan's precision)."""
    check_supported(version)
    features = Features(version)
    _check_dla(plan, features)
    s = BuilderSettings()
    s.strongly_typed = features.strongly_typed or _explicit_int8(plan, version)
    explicit = quantization != "none"
    calibrate = plan.needs_calibration and not explicit
    asked = set(plan.layer_precisions.values())
    if s.strongly_typed:
        # Precision lives in the graph; FP16/INT8 flags and constraints are refused here.
        s.network_flags.append("STRONGLY_TYPED")
        if calibrate:
            s.int8_source = "qdq"
        if not features.strongly_typed:
            s.notes.append("--explicit-int8: INT8 as Q/DQ from our calibration, strongly "
                           "typed (TensorRT {} deprecates calibrators)".format(
                               version_text(version)))
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
        if calibrate:
            s.set_flags.append("INT8")
            algorithm = plan.calibration.algorithm if plan.calibration else "entropy2"
            s.int8_source = "ranges" if algorithm == "percentile" else "calibrator"
        elif explicit:
            s.set_flags.append("INT8")
            s.notes.append("Q/DQ model ({}): INT8 flag without a calibrator (explicit "
                           "quantization)".format(quantization))
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
                 and PRECISION_RANK[p] < PRECISION_RANK[floor]]
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
    elif not features.memory_pool_api:
        # Left at 0, every tactic that needs scratch memory is excluded (slow engines or a
        # failed build), silently.
        s.workspace = ("max_workspace_size", DEFAULT_WORKSPACE)
        s.notes.append("TensorRT {} defaults to a 0-byte workspace: {} MiB set (trtexec's "
                       "default; --workspace to change)".format(version_text(version),
                                                                DEFAULT_WORKSPACE >> 20))
    if plan.dla_core is not None:
        s.dla_core = int(plan.dla_core)
        if plan.dla_gpu_fallback:
            s.set_flags.append("GPU_FALLBACK")
        else:
            s.notes.append("no GPU fallback: a layer DLA cannot run fails the build")
        if not features.dla:
            s.notes.append(DLA_VERSIONS_NOTE.format(version_text(version)))
    if features.engine_inspector:
        s.detailed_profiling = True
    else:
        s.notes.append("engine inspector unavailable before TensorRT 8.2: layer precisions "
                       "are not read back")
    return s


# Calibrators are deprecated from this version: --explicit-int8 (our calibration written
# into the graph as Q/DQ, the strongly typed path of >= 10.12) is offered from here on.
EXPLICIT_INT8_FROM = (10, 1, 0)


def _explicit_int8(plan: BuildPlan, version: Version) -> bool:
    """Whether ``plan.explicit_int8`` takes the strongly typed path below 10.12 (the only
    path from there on); refused before 10.1."""
    if not plan.explicit_int8:
        return False
    if version < EXPLICIT_INT8_FROM:
        raise AgentError(
            "unsupported_tensorrt",
            "--explicit-int8 needs TensorRT >= {} (calibrators deprecated, strongly typed "
            "networks), found {}; expected a build without --explicit-int8 here".format(
                version_text(EXPLICIT_INT8_FROM), version_text(version)))
    return True


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


# A build next to a serving app on a board whose GPU shares the RAM (Jetson): TensorRT's
# TACTIC_DRAM pool defaults to 75 % of that memory and WORKSPACE to all of it (NvInfer.h 8.6,
# 10.3), so an uncapped build can push the app out. builder.memory_limit's default share.
MEMORY_SHARE = 0.5


def build_memory_limit(configured: Optional[int], total_bytes: int, shared_memory: bool
                       ) -> Optional[int]:
    """The cap on a build's memory pools: ``configured`` bytes (0: none), else (None) a
    ``MEMORY_SHARE`` of RAM on a shared-memory board and none on a discrete GPU."""
    if configured is not None:
        return int(configured) or None
    if shared_memory and total_bytes > 0:
        return int(total_bytes * MEMORY_SHARE)
    return None


def cap_build_memory(trt: Any, config: "tensorrt.IBuilderConfig", limit: int,
                     settings: BuilderSettings) -> Dict[str, int]:
    """Cap the builder's memory pools at ``limit`` bytes: WORKSPACE (a smaller --workspace
    stays) and, where the version has it, TACTIC_DRAM. Returns pool name -> bytes set."""
    workspace = settings.workspace[1] if settings.workspace else limit
    pools = {"WORKSPACE": min(workspace, limit)}
    if settings.workspace and settings.workspace[0] == "max_workspace_size":
        config.max_workspace_size = pools["WORKSPACE"]  # type: ignore[attr-defined]  # < 8.4
        return pools
    if hasattr(trt.MemoryPoolType, "TACTIC_DRAM"):
        pools["TACTIC_DRAM"] = limit
    for name, size in pools.items():
        config.set_memory_pool_limit(getattr(trt.MemoryPoolType, name), size)
    return pools


def plan_floor(precision: str) -> Optional[str]:
    """The lowest precision a plan allows the layers it does not name (None: any)."""
    return _PLAN_FLOOR.get(precision)

