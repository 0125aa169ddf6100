"""What every backend offers: ``build(model, plan) -> engine`` and ``open(engine) -> runner``.

A ``BuildPlan`` says how to build (precision, per-layer overrides in Polygraphy's syntax,
constraints, calibration, shapes); a backend turns a model file plus a plan into an engine file,
and a ``Runner`` runs an engine. Worker side: Python >= 3.6 (no dataclasses, no Protocol).
"""

import abc
import importlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import numpy as np

from agent.errors import AgentError

PRECISIONS = ("fp32", "fp16", "int8", "best")
# The platform precisions (agent.platform's names) an engine can be built in: a decision for a
# job passes them, so a fallback list's bf16 / fp8 / fp4 / tf32 is never chosen.
BUILDABLE = ("fp32", "fp16", "int8")
# Polygraphy's names for per-layer precisions (``--layer-precisions Add:float16``).
LAYER_PRECISIONS = ("float32", "float16", "int8")
# Short names people type from --fp16/--int8 habits (and trtexec's --layerPrecisions fp16).
LAYER_PRECISION_ALIASES = {"fp32": "float32", "fp16": "float16", "half": "float16"}
CONSTRAINTS = ("obey", "prefer", "none")
CALIB_ALGORITHMS = ("entropy2", "minmax", "percentile", "legacy")
BACKENDS = ("onnxruntime", "tensorrt")

# progress(stage, done, total): stage is e.g. "calibrating" or "building"; total may be 0
# when unknown.
# progress(stage, done, total); returning False asks the work to stop where it can (a
# TensorRT >= 10 build, through its progress monitor); None or True carry on.
Progress = Callable[[str, int, int], Optional[bool]]

Shape = Tuple[int, ...]


def no_progress(stage: str, done: int, total: int) -> None:
    pass


def _choice(what: str, value: Any, allowed: Iterable[str]) -> str:
    allowed = tuple(allowed)
    if value not in allowed:
        raise AgentError(
            "bad_argument",
            "{} must be one of {}, found {!r}".format(what, ", ".join(allowed), value),
        )
    return value


def parse_layer_precisions(items: Iterable[str]) -> Dict[str, str]:
    """Polygraphy's ``--layer-precisions`` syntax: ``NAME:PRECISION`` items (names may contain
    ':' so split on the last one). Accepts one string with spaces too."""
    out: Dict[str, str] = {}
    for item in items:
        for token in item.split():
            name, sep, precision = token.rpartition(":")
            if not sep or not name:
                raise AgentError(
                    "bad_argument",
                    "--layer-precisions expects NAME:PRECISION items, found {!r}".format(token),
                )
            precision = LAYER_PRECISION_ALIASES.get(precision.lower(), precision)
            out[name] = _choice("layer precision of {!r}".format(name), precision,
                                LAYER_PRECISIONS)
    return out


def format_layer_precisions(layers: Dict[str, str]) -> str:
    """The ready-to-paste ``--layer-precisions`` value for a mapping."""
    return " ".join("{}:{}".format(name, prec) for name, prec in sorted(layers.items()))


class CalibrationSettings(object):
    """How to calibrate INT8: dataset path (a directory of .npy/.npz shards, one .npz, or a
    Polygraphy inputs JSON), algorithm, batch size, and a TensorRT-format calibration cache
    that is read when it exists (calibration is then skipped) and written after calibrating."""

    def __init__(
        self,
        data: Optional[str] = None,
        algorithm: str = "entropy2",
        batch_size: int = 8,
        cache: Optional[str] = None,
        shuffle_seed: Optional[int] = None,
        max_samples: Optional[int] = None,
    ) -> None:
        self.data = data
        self.algorithm = _choice("calibration algorithm", algorithm, CALIB_ALGORITHMS)
        if int(batch_size) < 1:
            raise AgentError("bad_argument",
                             "calibration batch size must be >= 1, found {}".format(batch_size))
        self.batch_size = int(batch_size)
        self.cache = cache
        self.shuffle_seed = shuffle_seed
        self.max_samples = max_samples

    def to_dict(self) -> Dict[str, Any]:
        return {
            "data": self.data,
            "algorithm": self.algorithm,
            "batch_size": self.batch_size,
            "cache": self.cache,
            "shuffle_seed": self.shuffle_seed,
            "max_samples": self.max_samples,
        }

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "CalibrationSettings":
        return cls(**d)


class BuildPlan(object):
    """Everything that decides what a build produces (and so enters the engine-cache key).

    ``layer_precisions`` maps ONNX node names to "float32"/"float16"/"int8";
    ``shapes`` maps input names to (min, opt, max) shapes for dynamic dimensions;
    ``mark_outputs`` lists extra tensors to expose as outputs ("*" = every float tensor), used by
    the precision search's instrumented runs.
    """

    def __init__(
        self,
        precision: str = "fp32",
        layer_precisions: Optional[Dict[str, str]] = None,
        precision_constraints: str = "none",
        calibration: Optional[CalibrationSettings] = None,
        shapes: Optional[Dict[str, Tuple[Shape, Shape, Shape]]] = None,
        workspace_bytes: Optional[int] = None,
        dla_core: Optional[int] = None,
        mark_outputs: Optional[List[str]] = None,
        plugins: Optional[List[Dict[str, str]]] = None,
        dla_gpu_fallback: bool = True,
        explicit_int8: bool = False,
    ) -> None:
        self.precision = _choice("precision", precision, PRECISIONS)
        self.layer_precisions = dict(layer_precisions or {})
        for name, prec in self.layer_precisions.items():
            _choice("layer precision of {!r}".format(name), prec, LAYER_PRECISIONS)
        self.precision_constraints = _choice(
            "precision constraints", precision_constraints, CONSTRAINTS)
        self.calibration = calibration
        self.shapes = dict(shapes or {})
        self.workspace_bytes = workspace_bytes
        self.dla_core = dla_core
        self.mark_outputs = list(mark_outputs or [])
        # TensorRT plugin libraries to load before parsing: {path, sha256} (agent.engines.plugins)
        self.plugins = [dict(p) for p in plugins or []]
        # --dla-no-gpu-fallback: a layer DLA cannot run fails the build instead of moving.
        self.dla_gpu_fallback = bool(dla_gpu_fallback)
        # INT8 from our calibration written into the graph as Q/DQ (TensorRT >= 10.1; the
        # only way from 10.12): tensorrt_plan.EXPLICIT_INT8_FROM.
        self.explicit_int8 = bool(explicit_int8)

    @property
    def needs_calibration(self) -> bool:
        return self.precision in ("int8", "best") or "int8" in self.layer_precisions.values()

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "precision": self.precision,
            "layer_precisions": dict(sorted(self.layer_precisions.items())),
            "precision_constraints": self.precision_constraints,
            "calibration": self.calibration.to_dict() if self.calibration else None,
            "shapes": {k: [list(s) for s in v] for k, v in sorted(self.shapes.items())},
            "workspace_bytes": self.workspace_bytes,
            "dla_core": self.dla_core,
            "mark_outputs": list(self.mark_outputs),
        }
        # Only when set, so the engine-cache keys of plans without them stay as they were.
        if self.plugins:
            out["plugins"] = [dict(p) for p in self.plugins]
        if not self.dla_gpu_fallback:
            out["dla_gpu_fallback"] = False
        if self.explicit_int8:
            out["explicit_int8"] = True
        return out

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "BuildPlan":
        calib = d.get("calibration")
        shapes = {
            k: (tuple(v[0]), tuple(v[1]), tuple(v[2]))
            for k, v in (d.get("shapes") or {}).items()
        }
        return cls(
            precision=d.get("precision", "fp32"),
            layer_precisions=d.get("layer_precisions"),
            precision_constraints=d.get("precision_constraints", "none"),
            calibration=CalibrationSettings.from_dict(calib) if calib else None,
            shapes=shapes,
            workspace_bytes=d.get("workspace_bytes"),
            dla_core=d.get("dla_core"),
            mark_outputs=d.get("mark_outputs"),
            plugins=d.get("plugins"),
            dla_gpu_fallback=d.get("dla_gpu_fallback", True),
            explicit_int8=bool(d.get("explicit_int8", False)),
        )

    def with_layers(self, layers: Iterable[str], precision: str = "float32") -> "BuildPlan":
        """A copy with ``layers`` pinned to ``precision`` (what a precision search tries)."""
        plan = BuildPlan.from_dict(self.to_dict())
        for name in layers:
            plan.layer_precisions[name] = precision
        return plan


class TensorSpec(object):
    """Name, numpy dtype and shape of an engine input or output (None or -1 = dynamic)."""

    def __init__(self, name: str, dtype: Any, shape: Tuple[Any, ...]) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape)

    def to_dict(self) -> Dict[str, Any]:
        return {"name": self.name, "dtype": str(self.dtype), "shape": list(self.shape)}

    def __repr__(self) -> str:
        return "TensorSpec({!r}, {}, {})".format(self.name, self.dtype, self.shape)


class BuildResult(object):
    """What a build produced.

    ``layer_precisions`` is what the engine really runs per layer (ONNX node name -> precision),
    read back from the engine where the backend can; ``mismatches`` lists (layer, asked, got) for
    layers that did not get the precision asked for. ``calibrated`` is True when calibration ran
    (False when a calibration cache made it unnecessary).
    """

    def __init__(
        self,
        engine_path: str,
        precision: str,
        layer_precisions: Optional[Dict[str, str]] = None,
        mismatches: Optional[List[Tuple[str, str, str]]] = None,
        calibration_cache: Optional[str] = None,
        calibrated: bool = False,
        seconds: float = 0.0,
        details: Optional[Dict[str, Any]] = None,
    ) -> None:
        self.engine_path = engine_path
        self.precision = precision
        self.layer_precisions = dict(layer_precisions or {})
        self.mismatches = list(mismatches or [])
        self.calibration_cache = calibration_cache
        self.calibrated = calibrated
        self.seconds = seconds
        self.details = dict(details or {})

    def to_dict(self) -> Dict[str, Any]:
        return {
            "engine": self.engine_path,
            "precision": self.precision,
            "layer_precisions": self.layer_precisions,
            "mismatches": [list(m) for m in self.mismatches],
            "calibration_cache": self.calibration_cache,
            "calibrated": self.calibrated,
            "seconds": round(self.seconds, 4),
            "details": self.details,
        }


class Runner(abc.ABC):
    """Runs one engine. Use as a context manager so device memory is returned. A runner sets
    ``_inputs`` and ``_outputs`` when it opens its engine."""

    _inputs: List[TensorSpec]
    _outputs: List[TensorSpec]

    @property
    def inputs(self) -> List[TensorSpec]:
        """The engine's inputs."""
        return list(self._inputs)

    @property
    def outputs(self) -> List[TensorSpec]:
        """The engine's outputs (including any marked by the plan)."""
        return list(self._outputs)

    @abc.abstractmethod
    def infer(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Run once; returns every output by name, as host numpy arrays."""

    def bind(self, feeds: Dict[str, np.ndarray]) -> Callable[[], Any]:
        """Validate ``feeds`` once and return a call that runs one inference on them: what a
        benchmark loop times (trtexec likewise binds its buffers once). Backends override it to
        drop per-call checks."""
        self.infer(feeds)
        return lambda: self.infer(feeds)

    def layer_times(self, feeds: Dict[str, np.ndarray], runs: int) -> Dict[str, List[float]]:
        """Per-layer times of ``runs`` inferences on ``feeds``: layer -> its time in each run
        (ms), in execution order (``bench --profile``). Backends that can profile override it."""
        raise AgentError("profile_unavailable",
                         "expected a backend with a per-layer profiler (tensorrt, onnxruntime), "
                         "found {} without one".format(type(self).__name__))

    def close(self) -> None:
        pass

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Backend(abc.ABC):
    """A way to build and run engines."""

    name = "base"

    @abc.abstractmethod
    def version(self) -> str:
        """The backend library's version (enters cache keys)."""

    def fingerprint(self) -> Dict[str, str]:
        """What an engine built here depends on besides model and plan (library versions,
        device); enters the engine-cache key."""
        return {"backend": self.name, "version": self.version()}

    @abc.abstractmethod
    def build(
        self,
        model_path: str,
        plan: BuildPlan,
        engine_path: str,
        progress: Progress = no_progress,
    ) -> BuildResult:
        """Build ``model_path`` per ``plan`` and write the engine to ``engine_path``
        (atomically). Raises AgentError with a stable code on bad input."""

    @abc.abstractmethod
    def open(self, engine_path: str) -> Runner:
        """Load an engine written by ``build``."""


def get_backend(name: str) -> Backend:
    """Import a backend lazily (heavy imports stay out of the idle daemon and ``diag``)."""
    _choice("backend", name, BACKENDS)
    try:
        module = importlib.import_module("agent.engines.backends." + name)
    except ImportError as exc:
        raise AgentError(
            "backend_unavailable",
            "backend {!r} needs a module that cannot be imported here: {}".format(name, exc),
        )
    return module.create()  # type: ignore[no-any-return]
