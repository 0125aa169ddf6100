"""The host backend: ONNX Runtime's CPU provider with faithful fp16 / int8 emulation.

An "engine" here is the rewritten ONNX model (``graph.apply_precisions``: fp16 rounding with
explicit Cast pairs, int8 as Q/DQ from calibration ranges) with the build's metadata in the
model's ``metadata_props`` under ``jetson_agent.engine``. It is also a real CPU deployment
backend: ``open`` gives a runner over ``onnxruntime.InferenceSession``
(``onnxruntime_runner``). ONNX Runtime fuses Q/DQ into int8 kernels where it has them;
elsewhere (e.g. a Gemm whose output is not quantized) it runs them as written: int8-rounded
values, fp32 arithmetic.

Calibration (``onnxruntime_calibration``) runs the fp32 model with every float tensor marked as
an output over the streamed dataset and feeds ``calib.ranges.RangeCollector``; the ranges are
written as a TensorRT calibration cache (``calib.cache``, target TensorRT version configurable,
default 10.3.0 of JetPack 6) when the plan names one, and a cache that exists is read instead
of calibrating (any TensorRT version is accepted here, the algorithm must match).

Worker side: Python >= 3.6.
"""

import hashlib
import json
import logging
import os
import time
from typing import Any, Dict, List, Optional, Tuple

import onnx

from agent.engines import plugins
from agent.engines.backends import (
    emulation,
    graph,
    layer_precisions,
    onnx_model,
    quantization,
    subgraphs,
)
from agent.engines.backends.base import (
    Backend,
    BuildPlan,
    BuildResult,
    Progress,
    TensorSpec,
    no_progress,
)
from agent.engines.backends.onnxruntime_calibration import calibrate, calibration_batch_size
from agent.engines.backends.onnxruntime_runner import (
    OnnxRuntimeRunner,
    import_onnxruntime,
    open_session,
)
from agent.errors import AgentError
from agent.fsio import atomic_write
from calib.cache import DEFAULT_TRT_VERSION, check_compatible, read_cache, write_cache
from calib.dataset import CalibrationDataset

METADATA_KEY = "jetson_agent.engine"
_PRECISION_ORDER = {"int8": 0, "float16": 1, "float32": 2}

log = logging.getLogger(__name__)


class OnnxRuntimeBackend(Backend):
    """Builds emulated fp16/int8 ONNX "engines" and runs them on the CPU provider."""

    name = "onnxruntime"

    def __init__(self, threads: Optional[int] = None,
                 cache_trt_version: str = DEFAULT_TRT_VERSION) -> None:
        self.threads = threads
        self.cache_trt_version = cache_trt_version
        # The session that checked the last engine built loads (its bytes' sha256, the
        # session): ``open`` of those same bytes takes it instead of loading them again (a
        # search opens every engine right after building it; loading twice was a quarter of an
        # evaluation). One at most: the next build replaces it.
        self._checked: Optional[Tuple[bytes, Any]] = None

    def version(self) -> str:
        return str(import_onnxruntime().__version__)

    def fingerprint(self) -> Dict[str, str]:
        out = super(OnnxRuntimeBackend, self).fingerprint()
        out["rewrite"] = graph.REWRITE_VERSION
        out["emulation"] = emulation.fingerprint()
        out["onnx"] = str(onnx.__version__)
        return out

    def build(
        self,
        model_path: str,
        plan: BuildPlan,
        engine_path: str,
        progress: Progress = no_progress,
    ) -> BuildResult:
        start = time.time()
        model = onnx_model.load_model(model_path)
        plugins.refuse_on_host(model, model_path)  # TensorRT's (or a library's) code
        specs = onnx_model.input_specs(model)
        self._check_shapes(plan, specs)
        details: Dict[str, Any] = {"emulated": True, "calibration_seconds": 0.0}
        # A Q/DQ model runs as written (onnxruntime has int8 kernels for the pairs): its
        # pairs are never rounded or calibrated; the other layers take the plan's precision.
        quant = quantization.quantization(model)
        details["quantization"] = quant
        amax: Optional[Dict[str, float]] = None
        calibrated = False
        cache_path: Optional[str] = None

        # Calibration sees the model as written (every tensor TensorRT's calibrator sees);
        # the precisions apply to the model as TensorRT's builder rewrites it (emulation).
        original = model
        model, merged = emulation.prepare(onnx_model.copy_model(model))
        overrides = _merge_overrides(plan.layer_precisions, merged)
        details["emulation"] = emulation.fingerprint()
        if merged:
            details["folded_layers"] = dict(sorted(merged.items()))
        # First pass without ranges: does anything want int8 at all? A calibration cache
        # asked for (and not there yet) is made either way: TensorRT calibrates every
        # tensor, and the next build or search of this model reads that file.
        wanted, _, _ = layer_precisions.resolve_precisions(model, plan.precision, overrides)
        settings = plan.calibration
        make_cache = bool(plan.needs_calibration and settings is not None and settings.cache
                          and settings.data and not os.path.exists(settings.cache))
        if any(p == "int8" for p in wanted.values()) or make_cache:
            t0 = time.time()
            amax, calibrated, cache_path = self._ranges(original, specs, plan, progress,
                                                        details)
            details["calibration_seconds"] = round(time.time() - t0, 4)
        del original

        progress("building", 0, 1)
        t0 = time.time()
        assignment, mismatches, ignored = layer_precisions.resolve_precisions(
            model, plan.precision, overrides, amax=amax)
        # Layers that wanted int8 but whose inputs have no range (a cache made for other
        # tensor names) run in the fallback precision; a cache that covers none is refused.
        no_range = sorted(n for n, p in wanted.items() if p == "int8" and assignment[n] != "int8")
        if no_range:
            details["int8_without_ranges"] = no_range
            if amax is not None and len(no_range) == sum(1 for p in wanted.values()
                                                         if p == "int8"):
                raise AgentError(
                    "calibration_cache_mismatch",
                    "the calibration cache has no range for the inputs of any int8 layer of "
                    "this model (expected tensors such as {}, found {}); was it made for "
                    "another model?".format(
                        ", ".join(sorted(_range_inputs(model, no_range))[:3]),
                        ", ".join(sorted(amax)[:3]) or "none"))
        # Mark before rewriting so the names are the model's own tensors (the rounded values
        # that the next layers read, not the rewrite's internal ones).
        marked = onnx_model.mark_outputs(model, plan.mark_outputs) if plan.mark_outputs else model
        engine = graph.apply_precisions(marked, assignment, amax=amax, emulate=True,
                                        fused=emulation.fused_edges(marked, assignment))
        for folded, into in merged.items():  # reported under their own names too
            assignment[folded] = assignment.get(into, "float32")
        assignment.update((name, "int8") for name in quantization.int8_layers(model))
        metadata = {
            "backend": self.name,
            "backend_version": self.version(),
            "rewrite": graph.REWRITE_VERSION,
            "source_sha256": onnx_model.model_digest(model),
            "plan": plan.to_dict(),
            "layer_precisions": assignment,
        }
        _set_metadata(engine, metadata)
        data = engine.SerializeToString()
        details["rewrite_seconds"] = round(time.time() - t0, 4)
        # What will not load must not be published: the same checks as ``open``.
        self._checked = None
        session = open_session(data, self.threads, model_path, arena=not plan.mark_outputs)
        try:
            onnx_model.parse_model(data, "the engine built from {}".format(model_path))
        except AgentError as exc:
            raise AgentError("build_failed", "{} (the rewritten model does not load: a bug "
                             "of the emulation; build without the failing option)".format(
                                 exc.message))
        atomic_write(engine_path, data)
        self._checked = (hashlib.sha256(data).digest(), session)
        del session
        progress("building", 1, 1)
        if ignored:
            details["ignored_layers"] = ignored
        # Layers that wanted int8 but whose inputs have no range (e.g. a cache made for other
        # tensor names): they run in the fallback precision.
        details["counts"] = {p: sum(1 for v in assignment.values() if v == p)
                             for p in ("float32", "float16", "int8")}
        # Layers inside If / Loop / Scan bodies, counted apart (they are not top-level layers
        # a --layer-precisions can name); what they cannot run in here is said.
        inside = subgraphs.summary(marked, assignment, plan.precision)
        if inside:
            details["subgraph_counts"] = inside["counts"]
        warnings = [inside["warning"]] if "warning" in inside else []
        if plan.precision in ("int8", "best") and not details["counts"]["int8"] and \
                not plan.layer_precisions:
            warnings.insert(0, "int8 was asked for but no layer can run in int8 (int8 "
                               "kernels are Conv/ConvTranspose/Gemm/MatMul ones; none is "
                               "left to quantize)")
        if warnings:
            details["warning"] = "; ".join(warnings)
            log.warning("%s: %s", model_path, details["warning"])
        return BuildResult(
            engine_path=engine_path,
            precision=quantization.label(plan.precision, quant),
            layer_precisions=assignment,
            mismatches=mismatches,
            calibration_cache=cache_path,
            calibrated=calibrated,
            seconds=time.time() - start,
            details=details,
        )

    def _check_shapes(self, plan: BuildPlan, specs: List[TensorSpec]) -> None:
        # ONNX Runtime takes dynamic dimensions as they come: profiles only need to name inputs.
        names = set(spec.name for spec in specs)
        for name in plan.shapes:
            if name not in names:
                raise AgentError("bad_argument",
                                 "shape profile names input {!r}; the model's inputs are "
                                 "{}".format(name, ", ".join(sorted(names))))

    def _ranges(self, model: onnx.ModelProto, specs: List[TensorSpec], plan: BuildPlan,
                progress: Progress, details: Dict[str, Any]
                ) -> Tuple[Dict[str, float], bool, Optional[str]]:
        settings = plan.calibration
        if settings is None or not (settings.data or settings.cache):
            raise AgentError("bad_argument",
                             "an int8 build needs calibration data or a calibration cache, "
                             "found neither")
        if settings.cache and os.path.exists(settings.cache):
            cache = read_cache(settings.cache)
            check_compatible(cache, settings.algorithm, None)
            details["calibration_cache_version"] = cache.trt_version
            return cache.amax, False, settings.cache
        if not settings.data:
            raise AgentError("file_not_found",
                             "calibration cache {} does not exist and no calibration data was "
                             "given".format(settings.cache))
        batch = calibration_batch_size(specs, settings.batch_size)
        if batch != settings.batch_size:
            details["calibration_batch_size"] = batch
        dataset = CalibrationDataset(settings.data, specs, batch,
                                     shuffle_seed=settings.shuffle_seed,
                                     max_samples=settings.max_samples)
        details["calibration_samples"] = dataset.num_samples()
        amax = calibrate(model, dataset, settings.algorithm, progress, self.threads)
        if settings.cache:
            write_cache(settings.cache, amax, settings.algorithm, self.cache_trt_version)
        return amax, True, settings.cache

    def open(self, engine_path: str) -> OnnxRuntimeRunner:
        if not os.path.isfile(engine_path):
            raise AgentError("file_not_found", "engine {} does not exist".format(engine_path))
        with open(engine_path, "rb") as f:
            data = f.read()
        try:
            model = onnx_model.parse_model(data, engine_path)
        except AgentError as exc:
            if exc.code != "bad_model":
                raise
            raise AgentError("bad_engine", "{} (expected an onnxruntime engine: ONNX)".format(
                exc.message))
        metadata = read_metadata(model)
        if metadata and metadata.get("backend") not in (None, self.name):
            raise AgentError("bad_engine",
                             "{}: expected an engine built by onnxruntime, found one built by "
                             "{}".format(engine_path, metadata.get("backend")))
        # Instrumented engines (tensors marked as outputs) return every activation of a run:
        # without the arena that memory goes back after each run.
        marked = bool((metadata.get("plan") or {}).get("mark_outputs"))
        checked, self._checked = self._checked, None
        if checked is not None and checked[0] == hashlib.sha256(data).digest():
            session = checked[1]  # the build's own check of these bytes
        else:
            session = open_session(data, self.threads, engine_path, arena=not marked)
        del checked
        return OnnxRuntimeRunner(
            session, metadata,
            profiling=lambda prefix: open_session(_read(engine_path), self.threads, engine_path,
                                                  profile_prefix=prefix))


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _merge_overrides(overrides: Dict[str, str], merged: Dict[str, str]) -> Dict[str, str]:
    """--layer-precisions on the rewritten model: a folded layer's precision goes to the layer
    it was folded into (the higher precision wins, as for one fused TensorRT layer)."""
    out = dict(overrides)
    for folded, into in merged.items():
        if folded not in out:
            continue
        prec = out.pop(folded)
        if into not in out or _PRECISION_ORDER.get(prec, 2) > _PRECISION_ORDER.get(out[into], 2):
            out[into] = prec
    return out


def _range_inputs(model: onnx.ModelProto, layers: List[str]) -> List[str]:
    """The float inputs of ``layers`` (the tensors whose ranges they need)."""
    inits = set(i.name for i in model.graph.initializer)
    wanted = set(layers)
    return [i for n in model.graph.node if n.name in wanted for i in n.input[:2]
            if i and i not in inits]


def _set_metadata(model: onnx.ModelProto, metadata: Dict[str, Any]) -> None:
    for prop in list(model.metadata_props):
        if prop.key == METADATA_KEY:
            model.metadata_props.remove(prop)
    entry = model.metadata_props.add()
    entry.key = METADATA_KEY
    entry.value = json.dumps(metadata, sort_keys=True)


def read_metadata(model: onnx.ModelProto) -> Dict[str, Any]:
    """The build metadata of an engine ({} for a plain ONNX model)."""
    for prop in model.metadata_props:
        if prop.key == METADATA_KEY:
            try:
                value = json.loads(prop.value)
            except ValueError:
                return {}
            return value if isinstance(value, dict) else {}
    return {}


def create(threads: Optional[int] = None,
           cache_trt_version: str = DEFAULT_TRT_VERSION) -> OnnxRuntimeBackend:
    return OnnxRuntimeBackend(threads=threads, cache_trt_version=cache_trt_version)
