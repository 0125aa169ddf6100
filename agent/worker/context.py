"""What every kind of job works with inside the worker: the job spec checked, its artifacts
staged, the plan, backend and engine cache made (``JobContext``), and the steps the kinds share
(build through the cache, with a fleet engine adopted and quick-checked; goldens read once;
bench; the common result fields). ``jobs`` composes them into deploy, search and bench.

Worker side: Python >= 3.6. Heavy modules are imported inside the functions.
"""

import os
import shutil
import time
from typing import Any, Callable, Dict, List, Optional

from agent.errors import AgentError
from agent.worker.accuracy import accuracy_report

SPEC_VERSION = 1
Emit = Callable[[Dict[str, Any]], None]
ShouldStop = Callable[[], bool]

DEFAULT_BENCH = {"iterations": 200, "warmup": 20}
MAX_LISTED = 20  # list entries kept in a job result (evaluations, layers)
# Progress lines are rate-limited per stage; stage changes and completions always go out.
PROGRESS_INTERVAL_S = 0.25


def protected_from_spec(spec: Dict[str, Any]) -> Callable[[], Dict[str, List[str]]]:
    """The engines this job's builds must not evict: the spec's ``protected_engines`` (key ->
    users, or a list of keys), which the daemon reads from its models directory
    (``agent.device.models.guard.protected_engines``) when it starts the job."""
    given = spec.get("protected_engines") or {}
    table = dict(given) if isinstance(given, dict) else {str(k): [] for k in given}

    def protected() -> Dict[str, List[str]]:
        return {str(k): [str(u) for u in (v or [])] for k, v in table.items()}
    return protected


class Progress(object):
    """``progress(stage, done, total)`` -> rate-limited progress lines."""

    def __init__(self, emit: Emit, clock: Callable[[], float] = time.monotonic,
                 should_stop: Callable[[], bool] = lambda: False) -> None:
        self.emit = emit
        self.clock = clock
        self.should_stop = should_stop
        self.stage = ""
        self.last = 0.0

    def __call__(self, stage: str, done: int = 0, total: int = 0) -> Optional[bool]:
        """False once the job is to stop: a TensorRT >= 10 build then ends at its next step
        (its progress monitor), not after the whole build."""
        now = self.clock()
        finished = bool(total) and done >= total
        if stage != self.stage or finished or now - self.last >= PROGRESS_INTERVAL_S:
            self.stage, self.last = stage, now
            self.emit({"type": "progress", "stage": stage, "done": int(done),
                       "of": int(total)})
        return False if self.should_stop() else None


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


# --- the job's set-up and shared steps -------------------------------------------------------

class JobContext(object):
    """Shared set-up: staged artifacts, backend, engine cache, plan; and the steps every kind
    of job uses (build, goldens, bench, the common result fields)."""

    def __init__(self, spec: Dict[str, Any], emit: Emit, should_stop: ShouldStop) -> None:
        from agent.engines import model_check, safe_npz
        from agent.engines.backends import quantization
        from agent.engines.backends.base import BuildPlan, get_backend
        from agent.engines.cache import EngineCache

        if spec.get("spec_version") != SPEC_VERSION:
            raise AgentError("bad_argument", "job spec version {} expected, found {!r}".format(
                SPEC_VERSION, spec.get("spec_version")))
        self.spec = spec
        self.emit = emit
        self.should_stop = should_stop
        self._goldens: Optional[Dict[str, Any]] = None
        self.progress = Progress(emit, should_stop=should_stop)
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
                                            or not self.plan.calibration.data) \
                and quantization.of_file(self.files["model"]) == "none":
            # (A Q/DQ model carries its own scales: never calibrated again.)
            raise AgentError("empty_calibration_data", "plan precision {} needs calibration data: "
                             "send a 'calibration' artifact".format(self.plan.precision))
        self.backend = get_backend(spec["backend"])
        if hasattr(self.backend, "memory_limit"):  # TensorRT: builder.memory_limit
            self.backend.memory_limit = (spec.get("limits") or {}).get("build_memory_bytes")
        self.cache = EngineCache(spec["cache_dir"], spec.get("engine_budget_bytes"),
                                 protected=protected_from_spec(spec),
                                 group=spec.get("engine_group"))
        self.share = {}  # type: Dict[str, Any]  # fleet engine sharing: built or adopted

    def build(self, use_shared: bool = True) -> Any:
        from agent.engines.build import build_engine

        self.progress("building", 0, 0)
        container = self.files.get("engine") if use_shared else None
        refused = str((self.spec.get("share") or {}).get("refused") or "")
        if container and "goldens" not in self.files:
            # Never adopted blind: without goldens nothing could gate the builder's engine.
            container, refused = None, "no goldens to gate a shared engine with: built here"
        shared = {"container": container} if use_shared else None
        record = build_engine(self.files["model"], self.plan, self.backend, self.cache,
                              self.spec["platform_fingerprint"], self.progress,
                              calibration_dir=self.spec["calibration_dir"],
                              model_label=self.spec.get("model_label"), shared=shared)
        if use_shared and refused:
            self.share = {"mode": "built", "reason": refused}
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
        from agent.platform import conditions

        build = record.result or {}
        return {
            # The engine's: "int8 (explicit)" for a Q/DQ model whatever the plan said.
            "precision": build.get("precision") or self.plan.precision,
            "quantization": (build.get("details") or {}).get("quantization", "none"),
            "fallback_reason": self.spec.get("fallback_reason"),
            "engine_key": record.key,
            "cache_hit": record.cache_hit,
            "calibrated": bool(build.get("calibrated")),
            "build_seconds": round(record.seconds, 3),
            "backend": self.backend.name,
            "emulated": self.backend.name != "tensorrt",
            "layer_precision_counts": _counts(build.get("layer_precisions") or {}),
            "precision_mismatches": (build.get("mismatches") or [])[:MAX_LISTED],
            # Power mode, clocks, temperatures: figures of two boards compared knowingly.
            "conditions": conditions.snapshot(self.spec.get("platform_root") or "/"),
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


def _counts(layers: Dict[str, str]) -> Dict[str, int]:
    out = {}  # type: Dict[str, int]
    for precision in layers.values():
        out[precision] = out.get(precision, 0) + 1
    return out


def quick_check_shared(job: JobContext, record: Any) -> str:
    """The accuracy check of an adopted engine: every golden through it, judged by the job's
    gate. "" when it passes, else why not; the caller drops the entry and builds."""
    data = job.load_goldens()
    if data is None:  # build() never adopts without goldens
        return "no goldens to gate a shared engine with"
    n = len(data["inputs"])  # the full gate: a trigger input may hide past the first few
    try:
        with job.backend.open(record.engine_path) as runner:
            outputs = [runner.infer(feed) for feed in data["inputs"][:n]]
        report = accuracy_report(outputs, data["outputs"][:n], job.spec.get("gate", {}))
    except Exception as exc:  # noqa: BLE001 - any failure means: build it here
        return "the shared engine failed its quick check: {}".format(str(exc)[:200])
    if report["passed"]:
        return ""
    return "the shared engine fails the goldens here ({} input(s))".format(n)
