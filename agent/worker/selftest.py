"""The acceptance run of a board (``jetson-agent selftest``): build the bundled examples in every
precision the board's support-matrix row allows, with the platform's real backend, calibrate
INT8, compare each engine with the example's goldens, time it, exercise the DLA where there is
one, and write one report (schema ``jetson-agent/selftest/1``: agent/data/schemas/
selftest.json, docs/platform.md) a user can attach to a bug report.

On a device (the tensorrt backend) every row is also built on the host emulation (the
onnxruntime backend) and the two verdicts are compared: a precision the emulation passes and
the device fails (or the reverse) is a problem. On a host the backend is onnxruntime itself, so
it checks the goldens, the report and its problem list, not the emulation against itself.

Engines go to a scratch cache removed at the end: every row really builds (and calibrates).
Worker side: Python >= 3.6.
"""

import importlib
import os
import platform as _std_platform
import shutil
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from agent import __version__
from agent.engines import bench as bench_mod
from agent.engines.backends.base import (
    BUILDABLE,
    Backend,
    BuildPlan,
    CalibrationSettings,
    get_backend,
)
from agent.engines.build import build_engine
from agent.engines.cache import EngineCache
from agent.errors import AgentError
from agent.fsio import atomic_write
from agent.platform import conditions
from agent.precision import golden
from agent.precision.compare import compare_outputs

SCHEMA = "jetson-agent/selftest/1"
REPORT_NAME = "selftest.json"
EXAMPLES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples")

# What each bundled example checks (examples/README.md). ``layers``: per-precision layer
# overrides (fp16_max needs Add and Sub in float32 in fp16: that is the example);
# ``tolerance``: the comparison with the goldens; ``top1``: the least share of held-out
# rows whose top class must match the true label.
EXAMPLES: Dict[str, Dict[str, Any]] = {
    "fp16_max": {
        "layers": {"fp16": {"Add": "float32", "Sub": "float32"}},
        "tolerance": {"atol": 1e-2, "rtol": 1e-2, "check_error_stat": "elemwise"},
        "calib": None,
    },
    "digits": {
        "layers": {},
        "tolerance": {"atol": 0.5, "rtol": 0.5, "check_error_stat": "mean"},
        "calib": "calib",
        "labels": "labels.npy",
        "top1": 0.95,
        "shapes": {"input": ((1, 64), (54, 64), (54, 64))},
        # DLA has no dynamic shapes: one fixed profile (the inputs' batch of 54), and the row
        # passes only when these nodes run on the DLA (GPU fallback would hide it).
        "dla": {"shapes": {"input": ((54, 64), (54, 64), (54, 64))},
                "layers": ["fc0", "relu0", "fc1", "relu1", "fc_out"]},
    },
}
CALIB_BATCH = 32
TENSORRT_BOARDS = ("jetson", "dgpu")  # PlatformInfo.kind of boards whose backend is tensorrt
FIX_FAILED = ("run `jetson-agent compare {model} --{precision} --load-inputs {inputs} "
              "--load-outputs {golden}` to see which outputs differ, and attach this report "
              "to the bug report")
FIX_MISMATCH = ("the device and the host emulation disagree on {precision}: attach this "
                "report (both verdicts are in it) to the bug report")
FIX_BUILD = "see docs/errors.md ({code}); attach this report to the bug report"
FIX_DLA = ("build with --dla-no-gpu-fallback to see why TensorRT refuses those layers on the "
           "DLA (docs/tensorrt.md, DLA), and attach this report to the bug report")


def _versions(info: Any, backend: str) -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {
        "agent": __version__, "python": _std_platform.python_version(),
        "numpy": np.__version__, "l4t": info.l4t, "jetpack": info.jetpack, "cuda": info.cuda,
        "cudnn": info.cudnn, "tensorrt": info.tensorrt}
    for name, attr in (("onnx", "__version__"), ("onnxruntime", "__version__")):
        try:
            out[name] = str(getattr(importlib.import_module(name), attr))
        except ImportError:
            out[name] = None
    if backend == "tensorrt":  # imported already by the backend
        for name, attr in (("tensorrt", "__version__"), ("pycuda", "VERSION_TEXT")):
            module = sys.modules.get(name)
            if module is not None and getattr(module, attr, None):
                out[name if name != "tensorrt" else "tensorrt_python"] = str(
                    getattr(module, attr))
    return out


class Selftest(object):
    """One acceptance run. ``run()`` returns the report (a dict) and writes it to ``out_dir``."""

    def __init__(self, info: Any, out_dir: str, backend_name: Optional[str] = None,
                 examples_dir: str = EXAMPLES_DIR, bench_iterations: int = 20,
                 say: Callable[[str], None] = lambda line: None) -> None:
        self.info = info
        self.out_dir = out_dir
        self.examples_dir = examples_dir
        self.bench_iterations = int(bench_iterations)
        self.say = say
        self.problems: List[Dict[str, str]] = [
            {"problem": p["problem"], "fix": p["fix"], "where": "platform"}
            for p in info.problems]
        self.asked = backend_name  # --backend (None: the platform's own)
        self.backend_name = backend_name or info.backend
        self.backend: Optional[Backend] = None
        self.emulation: Optional[Backend] = None
        self.results: List[Dict[str, Any]] = []
        self.scratch = ""

    # -- problems ---------------------------------------------------------------------------
    def problem(self, text: str, fix: str, where: str) -> None:
        self.problems.append({"problem": text, "fix": fix, "where": where})

    def _open_backends(self) -> None:
        try:
            self.backend = get_backend(self.backend_name)
        except AgentError as exc:
            self.problem("the {} backend is not usable here: [{}] {}".format(
                self.backend_name, exc.code, exc.message),
                "run scripts/install-jetson (TensorRT's bindings and pycuda), then `jetson-agent "
                "diag`; the rows below ran on the onnxruntime backend instead", "backend")
            self.backend_name = "onnxruntime"
            self.backend = get_backend("onnxruntime")
        if self.backend_name != "onnxruntime":
            self.emulation = get_backend("onnxruntime")

    # -- what to run ------------------------------------------------------------------------
    def precisions(self) -> List[str]:
        """The precisions this board's row allows that an engine can be built in."""
        from agent.platform import decide

        out = []
        for precision in BUILDABLE:
            d = decide(precision, self.info, "reject", backend=self.backend_name,
                       buildable=BUILDABLE)
            if d.ok:
                out.append(precision)
        return out

    def plan(self, example: str, precision: str, dla_core: Optional[int] = None
             ) -> Optional[BuildPlan]:
        spec = EXAMPLES[example]
        calibration = None
        if precision == "int8":
            if not spec.get("calib"):
                return None
            calibration = CalibrationSettings(
                os.path.join(self.examples_dir, example, str(spec["calib"])), "entropy2",
                batch_size=CALIB_BATCH)
        layers = dict(spec["layers"].get(precision, {}))
        shapes = spec["dla"]["shapes"] if dla_core is not None else spec.get("shapes")
        return BuildPlan(precision=precision, layer_precisions=layers,
                         precision_constraints="obey" if layers else "none",
                         calibration=calibration, shapes=dict(shapes or {}),
                         dla_core=dla_core)

    # -- one row ----------------------------------------------------------------------------
    def _engine(self, backend: Backend, example: str, plan: BuildPlan, label: str) -> Any:
        cache = EngineCache(os.path.join(self.scratch, label, "engines"))
        return build_engine(os.path.join(self.examples_dir, example, "model.onnx"), plan,
                            backend, cache, self.info.fingerprint(backend.name),
                            calibration_dir=os.path.join(self.scratch, label, "calibration"),
                            model_label=example)

    def _verdict(self, backend: Backend, example: str, plan: BuildPlan, label: str,
                 bench: bool) -> Dict[str, Any]:
        """Build, run the example's inputs, compare with its goldens (and labels); bench."""
        spec = EXAMPLES[example]
        folder = os.path.join(self.examples_dir, example)
        inputs = golden.load_inputs(os.path.join(folder, "inputs.json"))
        goldens = golden.load_outputs(os.path.join(folder, "golden.json"))
        out: Dict[str, Any] = {}
        started = time.monotonic()
        record = self._engine(backend, example, plan, label)
        out["build"] = {"seconds": round(time.monotonic() - started, 3),
                        "calibrated": bool(record.result.get("calibrated")),
                        "mismatches": [list(m) for m in record.result.get("mismatches") or []]}
        if plan.dla_core is not None:
            out["placement"] = _placement(spec, record.result)
        started = time.monotonic()
        with backend.open(record.engine_path) as runner:
            outputs = [runner.infer(feed) for feed in inputs]
            out["infer_seconds"] = round(time.monotonic() - started, 3)
            tol = spec["tolerance"]
            cmp = compare_outputs(outputs, goldens, atol=tol["atol"], rtol=tol["rtol"],
                                  check_error_stat=tol["check_error_stat"],
                                  runner=backend.name)
            out["compare"] = {"passed": bool(cmp.passed), "failed_outputs": cmp.failed_outputs(),
                              "tolerance": dict(tol), "summary": cmp.summary()}
            passed = bool(cmp.passed)
            if spec.get("labels"):
                labels = np.load(os.path.join(folder, str(spec["labels"])))
                name = sorted(goldens[0])[0]
                top = np.concatenate([np.argmax(o[name], axis=-1) for o in outputs])
                share = float(np.mean(top == labels[:len(top)]))
                out["top1"] = {"accuracy": round(share, 4), "min": spec["top1"],
                               "passed": share >= float(spec["top1"])}
                passed = passed and out["top1"]["passed"]
            if bench:
                result = bench_mod.benchmark(runner, inputs[0], self.bench_iterations,
                                             warmup=2)
                b = result.to_dict()
                out["bench"] = {"iterations": b["iterations"], "batch": b["batch"],
                                "median_ms": b["latency_ms"].get("median"),
                                "p99_ms": b["latency_ms"].get("p99"),
                                "inferences_per_second":
                                    b["throughput"]["inferences_per_second"]}
        out["passed"] = passed and out.get("placement", {}).get("passed", True)
        return out

    def row(self, example: str, precision: str, dla_core: Optional[int] = None
            ) -> Dict[str, Any]:
        assert self.backend is not None
        row: Dict[str, Any] = {"example": example, "precision": precision,
                               "backend": self.backend.name, "dla_core": dla_core}
        plan = self.plan(example, precision, dla_core)
        if plan is None:
            row.update(status="skipped", reason="the example has no calibration data")
            return row
        label = "{}-{}{}".format(example, precision, "" if dla_core is None else
                                 "-dla{}".format(dla_core))
        try:
            got = self._verdict(self.backend, example, plan, label, bench=True)
        except AgentError as exc:
            row.update(status="error", error={"code": exc.code, "message": exc.message[:500]})
            self.problem("{} {}{}: [{}] {}".format(example, precision, _dla(dla_core), exc.code,
                                                  exc.message[:300]),
                         FIX_BUILD.format(code=exc.code), "build")
            return row
        row.update(got)
        row["status"] = "passed" if got["passed"] else "failed"
        placement = got.get("placement") or {}
        if placement and not placement["passed"]:
            self.problem("{} {}{}: {} ran on the GPU, not the DLA".format(
                example, precision, _dla(dla_core),
                ", ".join(placement["on_gpu"]) or "the placement is unknown"),
                FIX_DLA, "dla")
        elif not got["passed"]:
            folder = os.path.join("examples", example)
            self.problem("{} {}{} does not match its goldens{}".format(
                example, precision, _dla(dla_core), _why(got)), FIX_FAILED.format(
                model=os.path.join(folder, "model.onnx"), precision=precision,
                inputs=os.path.join(folder, "inputs.json"),
                golden=os.path.join(folder, "golden.json")), "compare")
        if self.emulation is not None and dla_core is None:
            try:
                host = self._verdict(self.emulation, example, plan, label + "-host", False)
                row["emulation"] = {"passed": host["passed"],
                                    "agrees": host["passed"] == got["passed"]}
            except AgentError as exc:
                row["emulation"] = {"error": {"code": exc.code, "message": exc.message[:300]}}
            if row["emulation"].get("agrees") is False:
                self.problem("{} {}: the device {} the goldens, the host emulation {}".format(
                    example, precision, _verb(got["passed"]), _verb(host["passed"])),
                    FIX_MISMATCH.format(precision=precision), "emulation")
        return row

    # -- the run ----------------------------------------------------------------------------
    def run(self) -> Dict[str, Any]:
        started = time.monotonic()
        os.makedirs(self.out_dir, exist_ok=True)
        self.scratch = tempfile.mkdtemp(prefix="selftest-", dir=self.out_dir)
        try:
            self._open_backends()
            precisions = self.precisions()
            for example in EXAMPLES:
                for precision in precisions:
                    self.say("{} {} on {}".format(example, precision, self.backend_name))
                    self.results.append(self.row(example, precision))
            dla = self.dla(precisions)
        finally:
            shutil.rmtree(self.scratch, ignore_errors=True)
        report = self.report(precisions, dla, time.monotonic() - started)
        atomic_write(os.path.join(self.out_dir, REPORT_NAME),
                     (_json(report) + "\n").encode("utf-8"))
        return report

    def dla(self, precisions: List[str]) -> Dict[str, Any]:
        cores = int(self.info.dla_cores or 0)
        if self.backend_name != "tensorrt" or cores == 0:
            return {"cores": cores, "status": "skipped",
                    "reason": "no DLA on this board" if cores == 0 else
                    "the {} backend has no DLA".format(self.backend_name)}
        rows = []
        for precision in [p for p in precisions if p in ("fp16", "int8")]:
            self.say("digits {} on DLA core 0".format(precision))
            rows.append(self.row("digits", precision, dla_core=0))
        self.results.extend(rows)
        ok = all(r["status"] == "passed" for r in rows)
        return {"cores": cores, "status": "passed" if ok else "failed",
                "rows": len(rows)}

    def report(self, precisions: List[str], dla: Dict[str, Any], seconds: float
               ) -> Dict[str, Any]:
        info = self.info
        counts = {s: sum(1 for r in self.results if r["status"] == s)
                  for s in ("passed", "failed", "error", "skipped")}
        # A board made for TensorRT where TensorRT built nothing has not passed: the rows ran
        # on the emulation (TensorRT missing or broken, as on JetPack 4.6 without its
        # Python 3.6 bindings) or all failed to build.
        never_ran = info.kind in TENSORRT_BOARDS and self.asked in (None, "tensorrt") and not any(
            r.get("backend") == "tensorrt" and r["status"] in ("passed", "failed")
            for r in self.results)
        if never_ran:
            self.problem("TensorRT never ran on this {} board: {}".format(
                info.kind, "every row ran on the {} backend".format(self.backend_name)
                if self.backend_name != "tensorrt" else "no engine was built"),
                "run scripts/install-jetson (TensorRT's Python bindings for the worker's "
                "Python, and pycuda), check `jetson-agent diag`, and run selftest again",
                "backend")
        return _strict({
            "schema": SCHEMA,
            "agent_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "host": self.backend_name == "onnxruntime",
            "backend": self.backend_name,
            "board": {"kind": info.kind, "board": info.board, "family": info.family,
                      "module": info.module, "soc": info.soc,
                      "compute_capability": info.compute_capability,
                      "dla_cores": int(info.dla_cores or 0),
                      "matrix_row": info.matrix_row.get("id")},
            "versions": _versions(info, self.backend_name),
            "precisions": precisions,
            "results": self.results,
            "dla": dla,
            "counts": counts,
            "timings": {"total_seconds": round(seconds, 3)},
            "problems": self.problems,
            "conditions": conditions.snapshot(),  # power mode, clocks, temperatures
            "ok": counts["failed"] == 0 and counts["error"] == 0 and not never_ran,
        })


def _placement(spec: Dict[str, Any], result: Dict[str, Any]) -> Dict[str, Any]:
    """Whether the layers the example expects on the DLA are there: in TensorRT's placement
    (``can_run_on_DLA``) and, where the engine inspector shows DLA layers, in the engine."""
    placement = (result.get("details") or {}).get("dla_placement") or {}
    expected = list(spec["dla"]["layers"])
    on_dla = set(placement.get("dla") or [])
    if placement.get("engine_dla"):
        on_dla &= set(placement["engine_dla"])
    missing = [n for n in expected if n not in on_dla]
    return {"expected": expected, "on_gpu": missing, "passed": bool(placement) and not missing}


def _dla(core: Optional[int]) -> str:
    return "" if core is None else " on DLA core {}".format(core)


def _verb(passed: bool) -> str:
    return "passes" if passed else "fails"


def _why(got: Dict[str, Any]) -> str:
    bits = []
    if got.get("compare") and not got["compare"]["passed"]:
        bits.append("outputs {}".format(", ".join(got["compare"]["failed_outputs"])))
    if got.get("top1") and not got["top1"]["passed"]:
        bits.append("top-1 {:.2%} below {:.0%}".format(got["top1"]["accuracy"],
                                                       got["top1"]["min"]))
    return " ({})".format("; ".join(bits)) if bits else ""


def _strict(value: Any) -> Any:
    """Plain JSON values: NumPy scalars to Python, non-finite floats (an exact match's SQNR is
    infinite) to the strings "inf", "-inf", "nan" (strict JSON has no such numbers)."""
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    return value


def _json(value: Any) -> str:
    import json

    return json.dumps(value, indent=1, sort_keys=True, default=_plain, allow_nan=False)


def _plain(value: Any) -> Any:
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def run_selftest(info: Any, out_dir: str, backend_name: Optional[str] = None,
                 bench_iterations: int = 20, say: Callable[[str], None] = lambda line: None
                 ) -> Tuple[Dict[str, Any], str]:
    """(report, its path)."""
    test = Selftest(info, out_dir, backend_name, bench_iterations=bench_iterations, say=say)
    report = test.run()
    return report, os.path.join(out_dir, REPORT_NAME)
