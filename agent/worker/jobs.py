"""What a job does once its artifacts are on disk: deploy, search, bench (runs in the worker).

The daemon writes a *job spec* (``make_spec``): the job document's parameters plus the local
facts it decided (artifact paths in the store, the precision after the platform check, the
backend, cache directories, the platform fingerprint). ``run_job(spec, emit, should_stop)``
executes it, reporting progress through ``emit`` and returning the result dict that goes into
the job status.

- deploy: build (calibrating INT8 per plan) through the engine cache, gate accuracy against the
  goldens (Polygraphy comparator, plus top-1 agreement and label accuracy for classifiers),
  benchmark, and return the engine key for the daemon to activate (the journal is the daemon's).
- search: the precision search (which layers must stay in higher precision); a stop request
  returns the partial result.
- bench: build (or reuse) the engine and measure latency/throughput.

Worker side: Python >= 3.6. Heavy modules are imported inside the functions.
"""

import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional

from agent.errors import AgentError

SPEC_VERSION = 1
Emit = Callable[[Dict[str, Any]], None]
ShouldStop = Callable[[], bool]

DEFAULT_BENCH = {"iterations": 200, "warmup": 20}
MAX_LISTED = 20  # list entries kept in a job result (evaluations, layers)
SEARCH_SUMMARY_KEYS = ("mode", "direction", "precision", "keep_precision", "candidates", "keep",
                       "layer_precisions", "passed", "complete", "interrupted", "exhausted",
                       "evaluations", "builds", "cache_hits", "seconds", "engine_key", "message",
                       "comparison", "suspects", "prediction_passed")
# Progress lines are rate-limited per stage; stage changes and completions always go out.
PROGRESS_INTERVAL_S = 0.25


def make_spec(
    job_id: str,
    kind: str,
    plan: Dict[str, Any],
    artifacts: Dict[str, str],
    backend: str,
    work_dir: str,
    cache_dir: str,
    calibration_dir: str,
    platform_fingerprint: Dict[str, str],
    engine_budget_bytes: Optional[int] = None,
    gate: Optional[Dict[str, Any]] = None,
    bench: Optional[Dict[str, Any]] = None,
    search: Optional[Dict[str, Any]] = None,
    fallback_reason: Optional[str] = None,
    limits: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """The worker's instructions (JSON-serialisable). ``plan`` has ``precision`` already set to
    what the platform check decided; ``artifacts`` maps roles to files in the store;
    ``limits`` the caps on what artifacts may inflate to (``agent.engines.safe_npz.configure``) and
    the worker's memory limit (named in an ``out_of_memory`` error)."""
    return {
        "spec_version": SPEC_VERSION,
        "job_id": job_id,
        "kind": kind,
        "plan": plan,
        "artifacts": dict(artifacts),
        "backend": backend,
        "work_dir": work_dir,
        "cache_dir": cache_dir,
        "calibration_dir": calibration_dir,
        "platform_fingerprint": dict(platform_fingerprint),
        "engine_budget_bytes": engine_budget_bytes,
        "gate": dict(gate or {}),
        "bench": dict(bench or {}),
        "search": dict(search or {}),
        "fallback_reason": fallback_reason,
        "limits": dict(limits or {}),
    }


class Progress(object):
    """``progress(stage, done, total)`` -> rate-limited progress lines."""

    def __init__(self, emit: Emit, clock: Callable[[], float] = time.monotonic) -> None:
        self.emit = emit
        self.clock = clock
        self.stage = ""
        self.last = 0.0

    def __call__(self, stage: str, done: int = 0, total: int = 0) -> None:
        now = self.clock()
        finished = bool(total) and done >= total
        if stage == self.stage and not finished and now - self.last < PROGRESS_INTERVAL_S:
            return
        self.stage, self.last = stage, now
        self.emit({"type": "progress", "stage": stage, "done": int(done), "of": int(total)})


# --- artifacts: give store files (named by hash) the extension their readers expect ----------

def sniff_extension(path: str) -> str:
    with open(path, "rb") as f:
        head = f.read(16)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return ".npz"
    if head.startswith(b"\x93NUMPY"):
        return ".npy"
    stripped = head.lstrip()
    if stripped.startswith(b"[") or stripped.startswith(b"{"):
        return ".json"
    return ".onnx"


def stage_artifacts(artifacts: Dict[str, str], work_dir: str) -> Dict[str, str]:
    """Hard-link (or copy) each artifact into ``work_dir`` as ``<role><ext>``; the names are
    fixed per role so digests that include file names stay the same from job to job."""
    os.makedirs(work_dir, exist_ok=True)
    staged = {}
    for role, src in sorted(artifacts.items()):
        if not os.path.isfile(src):
            raise AgentError("file_not_found", "artifact {!r} is missing from the store: "
                             "expected a file at {}".format(role, src))
        dst = os.path.join(work_dir, role + (".onnx" if role == "model"
                                             else sniff_extension(src)))
        if os.path.lexists(dst):
            os.unlink(dst)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
        staged[role] = dst
    return staged


# --- accuracy -----------------------------------------------------------------------------

def _concat_outputs(iterations: List[Dict[str, Any]], name: str) -> Any:
    import numpy as np

    return np.concatenate([np.asarray(it[name]).reshape(-1, np.shape(it[name])[-1])
                           for it in iterations], axis=0)


def _is_classifier_output(array: Any) -> bool:
    return getattr(array, "ndim", 0) >= 2 and array.shape[-1] > 1


def accuracy_report(
    outputs: List[Dict[str, Any]],
    goldens: List[Dict[str, Any]],
    gate: Dict[str, Any],
    labels: Optional[Any] = None,
) -> Dict[str, Any]:
    """Compare ``outputs`` with ``goldens`` under the job's gate; the summary the job status
    carries (worst values over outputs and iterations) plus the comparator's full report."""
    from agent.precision.compare import compare_outputs
    from agent.precision.metrics import top1_agreement

    cmp = compare_outputs(outputs, goldens, atol=gate.get("atol"), rtol=gate.get("rtol"),
                          check_error_stat=gate.get("check_error_stat"),
                          error_quantile=gate.get("error_quantile"))
    results = cmp.to_dict()["results"]

    def worst(key: str, sub: str) -> Optional[float]:
        values = [r[key].get(sub) for r in results if r.get(key) and r[key].get(sub)
                  is not None]
        return max(values) if values else None

    def lowest(key: str) -> Optional[float]:
        values = [r.get(key) for r in results if r.get(key) is not None]
        return min(values) if values else None

    report: Dict[str, Any] = {
        "passed": cmp.passed,
        "comparator_passed": cmp.passed,
        "failed_outputs": cmp.failed_outputs(),
        "max_abs_error": worst("absdiff", "max"),
        "max_rel_error": worst("reldiff", "max"),
        "mean_abs_error": worst("absdiff", "mean"),
        "sqnr_db": lowest("sqnr_db"),
        "cosine": lowest("cosine"),
        "top1_agreement": None,
        "iterations": cmp.iterations,
        "outputs": cmp.to_dict()["outputs"],
    }
    first = goldens[0]
    classifier = [n for n in first if _is_classifier_output(first[n])]
    if classifier:
        name = classifier[0]
        out = _concat_outputs(outputs, name)
        gold = _concat_outputs(goldens, name)
        report["top1_output"] = name
        report["top1_agreement"] = top1_agreement(out, gold)
        if labels is not None:
            import numpy as np

            truth = np.asarray(labels).reshape(-1)
            if truth.shape[0] != out.shape[0]:
                raise AgentError("golden_mismatch", "labels hold {} entries; the goldens hold {} "
                                 "rows of {!r}".format(truth.shape[0], out.shape[0], name))
            report["label_accuracy"] = float(np.mean(np.argmax(out, axis=-1) == truth))
            report["golden_label_accuracy"] = float(np.mean(np.argmax(gold, axis=-1) == truth))
    min_top1 = gate.get("min_top1")
    if min_top1 is not None:
        if report["top1_agreement"] is None:
            raise AgentError("bad_argument", "gate.min_top1 needs a classifier output "
                             "([..., classes]); the goldens hold {}".format(
                                 {n: list(v.shape) for n, v in first.items()}))
        report["min_top1"] = float(min_top1)
        report["passed"] = report["passed"] and report["top1_agreement"] >= float(min_top1)
    return report


def _gate_failure(report: Dict[str, Any]) -> AgentError:
    why = []
    if not report["comparator_passed"]:
        why.append("output(s) {} outside atol/rtol (max abs error {}, max rel error {})".format(
            report["failed_outputs"], report["max_abs_error"], report["max_rel_error"]))
    if report.get("min_top1") is not None and report["top1_agreement"] < report["min_top1"]:
        why.append("top-1 agreement {:.4f} below the required {:.4f}".format(
            report["top1_agreement"], report["min_top1"]))
    return AgentError("accuracy_gate_failed", "the engine fails the accuracy gate: " +
                      "; ".join(why), {"accuracy": report})


# --- the jobs -----------------------------------------------------------------------------

class _Job(object):
    """Shared set-up: staged artifacts, backend, engine cache, plan."""

    def __init__(self, spec: Dict[str, Any], emit: Emit, should_stop: ShouldStop) -> None:
        from agent.engines import model_check, safe_npz
        from agent.engines.backends.base import BuildPlan, get_backend
        from agent.engines.cache import EngineCache

        if spec.get("spec_version") != SPEC_VERSION:
            raise AgentError("bad_argument", "job spec version {} expected, found {!r}".format(
                SPEC_VERSION, spec.get("spec_version")))
        self.spec = spec
        self.emit = emit
        self.should_stop = should_stop
        self._goldens: Optional[Dict[str, Any]] = None
        self.progress = Progress(emit)
        safe_npz.configure(**(spec.get("limits") or {}))
        self.files = stage_artifacts(spec["artifacts"], spec["work_dir"])
        # External tensors of the model may only come from this job's own artifacts.
        model_check.confine_to(self.files.values())
        if "model" not in self.files:
            raise AgentError("bad_message", "a {} job needs a 'model' artifact".format(
                spec["kind"]))
        plan = dict(spec["plan"])
        calib = dict(plan.get("calibration") or {})
        if "calibration" in self.files:
            calib["data"] = self.files["calibration"]
            calib.pop("cache", None)
            plan["calibration"] = calib
        elif calib:
            plan["calibration"] = calib
        self.plan = BuildPlan.from_dict(plan)
        if self.plan.needs_calibration and (self.plan.calibration is None
                                            or not self.plan.calibration.data):
            raise AgentError("empty_calibration_data", "plan precision {} needs calibration data: "
                             "send a 'calibration' artifact".format(self.plan.precision))
        self.backend = get_backend(spec["backend"])
        self.cache = EngineCache(spec["cache_dir"], spec.get("engine_budget_bytes"))
        self.share = {}  # type: Dict[str, Any]  # fleet engine sharing: built or adopted

    def build(self, use_shared: bool = True) -> Any:
        from agent.engines.build import build_engine

        self.progress("building", 0, 0)
        shared = {"container": self.files.get("engine")} if use_shared else None
        record = build_engine(self.files["model"], self.plan, self.backend, self.cache,
                              self.spec["platform_fingerprint"], self.progress,
                              calibration_dir=self.spec["calibration_dir"],
                              model_name=self.spec.get("model_name"), shared=shared)
        if shared is not None and shared.get("container"):
            # An engine of the fleet was sent: adopted (and checked), else built here.
            self.share = {"mode": "adopted" if shared.get("adopted") else "built",
                          "reason": shared.get("reason") or ""}
            if shared.get("adopted"):
                why = quick_check_shared(self, record)
                if why:
                    self.cache.purge(key=record.key)
                    record = self.build(use_shared=False)
                    self.share = {"mode": "built", "reason": why}
        return record

    def load_goldens(self) -> Optional[Dict[str, Any]]:
        """inputs + goldens (+ labels) when the job has them; read once per job (the
        deploy's gate and a shared engine's quick check both use them)."""
        if "goldens" not in self.files:
            return None
        if self._goldens is None:
            self._goldens = self._read_goldens()
        return self._goldens

    def _read_goldens(self) -> Dict[str, Any]:
        from agent.precision import golden

        if "inputs" not in self.files:
            raise AgentError("golden_mismatch", "goldens need the inputs they were made from: "
                             "send an 'inputs' artifact with the 'goldens'")
        inputs = golden.load_inputs(self.files["inputs"])
        outputs = golden.load_outputs(self.files["goldens"])
        if len(inputs) != len(outputs):
            raise AgentError("golden_mismatch", "expected one golden iteration per input "
                             "feed ({}), found {}".format(len(inputs), len(outputs)))
        labels = None
        if "labels" in self.files:
            labels = load_labels(self.files["labels"])
        return {"inputs": inputs, "outputs": outputs, "labels": labels}

    def bench(self, runner: Any, feeds: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        from agent.engines.bench import benchmark, random_feeds

        opts = dict(DEFAULT_BENCH)
        opts.update({k: v for k, v in self.spec.get("bench", {}).items() if v is not None})
        if feeds is None:
            feeds = self.random_feeds(runner.inputs, int(opts.get("batch", 1)),
                                      int(opts.get("seed", 0)), random_feeds)
        self.progress("benchmarking", 0, int(opts["iterations"]))
        result = benchmark(runner, feeds, iterations=int(opts["iterations"]),
                           warmup=int(opts["warmup"]))
        self.progress("benchmarking", int(opts["iterations"]), int(opts["iterations"]))
        d = result.to_dict()
        latency = dict(d["latency_ms"])
        latency.setdefault("p50", latency.get("median"))
        return {
            "throughput_qps": d["throughput"]["inferences_per_second"],
            "throughput_samples_per_s": d["throughput"]["samples_per_second"],
            "latency_ms": latency,
            "bench": d,
        }

    def random_feeds(self, specs: List[Any], batch: int, seed: int, make: Any) -> Any:
        """Random inputs shaped by the plan's profile (its opt shapes) where the job gave one,
        else by the model with ``batch`` for a dynamic leading dimension; sizes are checked
        before anything is allocated."""
        from agent.precision.golden import check_tensor_size

        shapes = {name: list(opt) for name, (_lo, opt, _hi) in self.plan.shapes.items()}
        for spec in specs:
            if spec.name in shapes:
                check_tensor_size(spec.name, shapes[spec.name], spec.dtype, "bad_argument")
            else:
                dims = [d if isinstance(d, int) and d >= 0 else (batch if i == 0 else 1)
                        for i, d in enumerate(spec.shape)]
                static = all(isinstance(d, int) and d >= 0 for d in spec.shape)
                check_tensor_size(spec.name, dims, spec.dtype,
                                  "bad_model" if static else "bad_argument")
        return make(specs, batch=batch, seed=seed, shapes=shapes or None)

    def common(self, record: Any) -> Dict[str, Any]:
        build = record.result or {}
        return {
            "precision": self.plan.precision,
            "fallback_reason": self.spec.get("fallback_reason"),
            "engine_key": record.key,
            "cache_hit": record.cache_hit,
            "calibrated": bool(build.get("calibrated")),
            "build_seconds": round(record.seconds, 3),
            "backend": self.backend.name,
            "emulated": self.backend.name != "tensorrt",
            "layer_precision_counts": _counts(build.get("layer_precisions") or {}),
            "precision_mismatches": (build.get("mismatches") or [])[:MAX_LISTED],
        }


def load_labels(path: str) -> Any:
    """The true class per golden row: a .npy, or the first array of an .npz, of integers
    (no pickles; sizes checked before reading)."""
    from agent.engines import safe_npz

    arrays = safe_npz.read_arrays(path, "bad_golden_file", "labels")
    if not arrays or arrays[0].dtype.kind not in "iub":
        raise AgentError("bad_golden_file", "labels: expected an integer array (.npy or .npz), "
                         "found {}".format(arrays[0].dtype if arrays else "no array"))
    return arrays[0]


def out_of_memory(exc: BaseException) -> AgentError:
    """The error of a worker that hit its memory ceiling (RLIMIT_DATA set by the daemon)."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    named = ("its limit of {:,} bytes (limits.worker_memory_bytes)".format(limit)
             if limit != resource.RLIM_INFINITY else "the memory of this device")
    return AgentError("out_of_memory", "the worker ran out of memory: the job needs more than "
                      "{} ({}: {})".format(named, type(exc).__name__, str(exc)[:200]),
                      {"limit_bytes": None if limit == resource.RLIM_INFINITY else limit})


def is_memory_failure(exc: BaseException) -> bool:
    """A native library's allocation failure (onnxruntime, TensorRT) seen as an exception."""
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or any(
        marker in text for marker in ("bad_alloc", "bad allocation", "failed to allocate",
                                      "out of memory", "cannot allocate memory"))


def _counts(layers: Dict[str, str]) -> Dict[str, int]:
    out = {}  # type: Dict[str, int]
    for precision in layers.values():
        out[precision] = out.get(precision, 0) + 1
    return out


def quick_check_shared(job: "_Job", record: Any) -> str:
    """The quick accuracy check of an adopted engine: the job's first goldens through it,
    judged by the job's gate. "" when it passes (or the job has no goldens: the deploy has
    nothing to gate against either), else why not; the caller drops the entry and builds."""
    from agent.engines.share import QUICK_CHECK_INPUTS

    data = job.load_goldens()
    if data is None:
        return ""
    n = min(QUICK_CHECK_INPUTS, len(data["inputs"]))
    try:
        with job.backend.open(record.engine_path) as runner:
            outputs = [runner.infer(feed) for feed in data["inputs"][:n]]
        report = accuracy_report(outputs, data["outputs"][:n], job.spec.get("gate", {}))
    except Exception as exc:  # noqa: BLE001 - any failure means: build it here
        return "the shared engine failed its quick check: {}".format(str(exc)[:200])
    if report["passed"]:
        return ""
    return "the shared engine fails the goldens here (quick check of {} input(s))".format(n)


def run_deploy(job: _Job) -> Dict[str, Any]:
    job.progress("checking", 0, 0)
    data = job.load_goldens()
    record = job.build()
    if job.should_stop():
        raise AgentError("cancelled", "stopped after building the engine")
    result = job.common(record)
    with job.cache.pin(record.key):
        with job.backend.open(record.engine_path) as runner:
            feeds = None
            if data is not None:
                job.progress("verifying", 0, len(data["inputs"]))
                outputs = []
                for i, feed in enumerate(data["inputs"]):
                    outputs.append(runner.infer(feed))
                    job.progress("verifying", i + 1, len(data["inputs"]))
                report = accuracy_report(outputs, data["outputs"], job.spec.get("gate", {}),
                                         data["labels"])
                result["accuracy"] = report
                if not report["passed"]:
                    raise _gate_failure(report)
                feeds = data["inputs"][0]
            else:
                result["accuracy"] = None  # nothing to gate against: said so in the result
            if job.should_stop():
                raise AgentError("cancelled", "stopped after verifying the engine")
            result.update(job.bench(runner, feeds))
    result["activate"] = True
    result["engine"] = record.engine_path
    _share_result(job, record, result)
    # What the controller's results table shows: layers pinned away from the plan's precision.
    result["layers_kept"] = dict(job.plan.layer_precisions)
    return result


def run_bench(job: _Job) -> Dict[str, Any]:
    data = job.load_goldens()
    feeds = None
    if data is None and "inputs" in job.files:
        from agent.precision import golden

        feeds = golden.load_inputs(job.files["inputs"])[0]
    elif data is not None:
        feeds = data["inputs"][0]
    record = job.build()
    result = job.common(record)
    with job.cache.pin(record.key):
        with job.backend.open(record.engine_path) as runner:
            result.update(job.bench(runner, feeds))
    return result


def run_search(job: _Job) -> Dict[str, Any]:
    from agent.precision.searcher import run_search as search

    data = job.load_goldens()
    if data is None:
        raise AgentError("golden_mismatch", "a search job needs 'inputs' and 'goldens' "
                         "artifacts to judge each candidate")
    opts = job.spec.get("search", {})
    gate = job.spec.get("gate", {})
    compare_options = {k: gate[k] for k in ("atol", "rtol", "check_error_stat",
                                            "error_quantile") if gate.get(k) is not None}
    max_evaluations = opts.get("max_iterations")
    job.progress("searching", 0, 0)
    found = search(job.files["model"], job.plan, data["inputs"], data["outputs"], job.backend,
                   job.cache, job.spec["platform_fingerprint"],
                   mode=opts.get("mode", "minimal"), direction=opts.get("direction", "forward"),
                   compare_options=compare_options, progress=job.progress,
                   should_stop=job.should_stop,
                   max_evaluations=int(max_evaluations) if max_evaluations else None,
                   calibration_dir=job.spec["calibration_dir"],
                   predicted=opts.get("predicted"))
    full = found.to_dict()
    # The job status stays small (controllers cap it at 64 KiB): a summary of the search,
    # the last evaluations, and the layers kept in higher precision.
    result = {k: full.get(k) for k in SEARCH_SUMMARY_KEYS if k in full}
    result["iterations"] = [{k: it.get(k) for k in ("index", "size", "passed", "seconds",
                                                    "cache_hit")}
                            for it in (full.get("iterations") or [])[-MAX_LISTED:]]
    result["sensitivity"] = (full.get("sensitivity") or [])[:MAX_LISTED]
    result["layers_kept"] = {name: full.get("keep_precision", "float32")
                             for name in (full.get("keep") or [])}
    result["fallback_reason"] = job.spec.get("fallback_reason")
    result["backend"] = job.backend.name
    result["emulated"] = job.backend.name != "tensorrt"
    result["partial"] = bool(job.should_stop()) or bool(full.get("partial"))
    return result


RUNNERS = {"deploy": run_deploy, "search": run_search, "bench": run_bench}


def run_job(spec: Dict[str, Any], emit: Emit, should_stop: ShouldStop) -> Dict[str, Any]:
    kind = spec.get("kind")
    if kind not in RUNNERS:
        raise AgentError("unknown_job_kind", "the worker runs {} jobs, found {!r}".format(
            ", ".join(sorted(RUNNERS)), kind))
    job = _Job(spec, emit, should_stop)
    return RUNNERS[kind](job)


def _share_result(job: _Job, record: Any, result: Dict[str, Any]) -> None:
    """``result["share"]``: whether this device built its engine or adopted the fleet's (and
    why it fell back); a device its job document asks to offer its engine uploads it now."""
    share = dict(job.share)
    offer_url = (job.spec.get("share") or {}).get("offer")
    if offer_url and share.get("mode") != "adopted":
        entry = job.cache.get(record.key, touch=False)
        info = dict(entry.meta) if entry is not None else {}
        share.update(engine_share_offer(offer_url, record, info, job))
    if share:
        share.setdefault("mode", "cached" if record.cache_hit else "built")
        result["share"] = share


def engine_share_offer(url: str, record: Any, info: Dict[str, Any], job: _Job
                       ) -> Dict[str, Any]:
    from agent.engines import share as engine_share

    calib = ((info.get("plan") or {}).get("calibration") or {}).get("cache")
    return engine_share.offer(url, record.key, record.engine_path, info,
                              str(job.spec.get("device") or ""), job.spec["work_dir"],
                              calibration_cache=calib if isinstance(calib, str) else None)

