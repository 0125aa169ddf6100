"""``jetson-agent build MODEL``: build an engine through the engine cache.

Checks the requested precision against this platform's support matrix first (rejecting it or
falling back per ``--fallback``), then builds, or returns the cached engine when model, plan,
calibration data, backend and platform are unchanged. INT8 calibrates from ``--calib`` once and
keeps the ranges in a calibration cache, so later builds of the same model and data (other
``--layer-precisions``) skip calibration.
"""

import argparse
import importlib.util
import json
import logging
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from agent import fsio
from agent import platform as plat
from agent.cli import STATE_DIR_HELP
from agent.cli.models_location import add_models_dir_arg, models_dir
from agent.device import config, config_schema
from agent.device.models import guard as models_guard
from agent.device.state_lock import check_state_dir
from agent.engines import plugins
from agent.engines.backends.base import (
    BACKENDS,
    CALIB_ALGORITHMS,
    CONSTRAINTS,
    Backend,
    BuildPlan,
    CalibrationSettings,
    Shape,
    get_backend,
    parse_layer_precisions,
)
from agent.engines.build import EngineRecord, build_engine
from agent.engines.cache import EngineCache
from agent.errors import AgentError
from agent.platform import conditions
from agent.progress import ProgressBar

log = logging.getLogger("agent.build")
# One default for build, bench, compare and search: Polygraphy's (--precision-constraints none).
DEFAULT_CONSTRAINTS = "none"
GENERIC_NAMES = ("model.onnx", "model.plan", "engine", "model")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("build", help="build an engine (through the engine cache)",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    add_build_arguments(p, model_help="ONNX model file")
    p.add_argument("--save-engine", metavar="FILE",
                   help="also write the engine to FILE (atomically; trtexec's --saveEngine), "
                   "with its meta.json as FILE.json beside it")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=run)


def add_build_arguments(p: argparse.ArgumentParser, model_help: Optional[str] = None,
                        engine_options: bool = True, precision_default: Optional[str] = "fp32",
                        constraints_default: str = DEFAULT_CONSTRAINTS) -> None:
    """The flags that make a BuildPlan: the one definition behind ``build``, ``bench``,
    ``compare`` and ``search``.

    ``model_help`` adds the positional MODEL. ``engine_options`` adds what only ``build`` and
    ``bench`` act on (calibration sampling, workspace, DLA, fallback, threads).
    ``precision_default`` is what no precision flag means (``search`` wants None to ask for
    one). ``--precision-constraints`` defaults to ``none`` for every command (Polygraphy's
    default), so the same flags build the same engine everywhere.
    """
    if model_help is not None:
        p.add_argument("model", metavar="MODEL", help=model_help)
    prec = p.add_mutually_exclusive_group()
    prec.add_argument("--fp16", dest="precision", action="store_const", const="fp16",
                      help="allow fp16 kernels")
    prec.add_argument("--int8", dest="precision", action="store_const", const="int8",
                      help="allow int8 kernels (needs --calib or --calibration-cache, unless "
                           "the model is quantized already: Q/DQ)")
    prec.add_argument("--best", dest="precision", action="store_const", const="best",
                      help="the fastest precision the platform runs (int8 + fp16 where both)")
    p.set_defaults(precision=precision_default)
    g = p.add_argument_group("calibration (int8)")
    g.add_argument("--calib", metavar="PATH",
                   help="calibration data: a directory of .npy/.npz shards, an .npz, or a "
                        "Polygraphy inputs JSON")
    g.add_argument("--calibration-cache", metavar="FILE",
                   help="TensorRT-format calibration cache: read when it exists (calibration "
                        "is skipped), else written after calibrating (default: one per model, "
                        "data and settings under <state-dir>/calibration)")
    g.add_argument("--calib-algo", choices=CALIB_ALGORITHMS, default="entropy2",
                   help="calibration algorithm (default entropy2)")
    g.add_argument("--calib-batch-size", type=int, default=8, metavar="N",
                   help="calibration batch size (default 8)")
    g.add_argument("--explicit-int8", action="store_true",
                   help="tensorrt >= 10.1: write our calibration into the graph as Q/DQ and "
                        "build strongly typed instead of using a calibrator (deprecated from "
                        "10.1, gone in 11; the only way from 10.12)")
    if engine_options:
        g.add_argument("--calib-shuffle-seed", type=int, metavar="SEED",
                       help="shuffle calibration shards and samples with this seed")
        g.add_argument("--calib-max-samples", type=int, metavar="N",
                       help="calibrate on at most N samples")
    g = p.add_argument_group("layers and shapes" if engine_options else "layers")
    g.add_argument("--layer-precisions", nargs="+", default=[], metavar="NAME:PRECISION",
                   help="per-layer precisions in Polygraphy's syntax, e.g. Add:float32 "
                        "Sub:float32 (names are ONNX node names)")
    g.add_argument("--precision-constraints", choices=CONSTRAINTS, default=constraints_default,
                   help="how --layer-precisions bind: obey (fail if impossible), prefer, or "
                        "none: TensorRT may override them (default: none, as in Polygraphy; "
                        "the same for build, bench, compare and search)")
    g.add_argument("--shapes", nargs="+", default=[], metavar="NAME:MIN[,OPT,MAX]",
                   help="shape profile for dynamic inputs, e.g. input:1x64,8x64,32x64 "
                        "(one shape means min = opt = max; generated inputs take OPT)")
    if engine_options:
        g.add_argument("--workspace", type=float, metavar="MIB",
                       help="builder workspace limit in MiB (tensorrt)")
        g.add_argument("--dla-core", type=int, metavar="N",
                       help="build for DLA core N (tensorrt; needs fixed --shapes)")
        g.add_argument("--dla-no-gpu-fallback", action="store_true",
                       help="with --dla-core: fail the build when a layer cannot run on the "
                            "DLA instead of moving it to the GPU (trtexec's default)")
        g.add_argument("--plugin", action="append", default=[], metavar="LIB.so",
                       help="a TensorRT plugin library the model needs (repeatable); it must "
                            "lie in the models directory, and is pinned by its SHA-256")
    g = p.add_argument_group("where and how")
    # compare and search take the detected platform's backend without an import check.
    g.add_argument("--backend", choices=BACKENDS,
                   help="default: tensorrt on a {}, else onnxruntime".format(
                       "GPU platform where it is importable" if engine_options
                       else "Jetson or GPU platform"))
    if engine_options:
        g.add_argument("--fallback", choices=plat.FALLBACK_POLICIES, default="allow",
                       help="when the platform lacks the precision: fall back (allow, default) "
                            "or fail (reject)")
        g.add_argument("--threads", type=int, metavar="N",
                       help="intra-op threads of the onnxruntime backend (default: its own)")
    g.add_argument("--state-dir", metavar="DIR", help=STATE_DIR_HELP)
    g.add_argument("--cache-budget", metavar="SIZE",
                   help="engine cache size budget, e.g. 2GiB (default: the config's "
                        "cache.engine_budget_bytes); the engines of the models directory's "
                        "versions count outside it and are never evicted")
    add_models_dir_arg(g)


def parse_shapes(items: List[str]) -> Dict[str, Tuple[Shape, Shape, Shape]]:
    """``NAME:1x64,8x64,32x64`` (min, opt, max) or ``NAME:8x64`` (all three)."""
    out: Dict[str, Tuple[Shape, Shape, Shape]] = {}
    for item in items:
        name, sep, text = item.rpartition(":")
        parts = text.split(",")
        try:
            shapes = [tuple(int(d) for d in part.lower().split("x")) for part in parts]
        except ValueError:
            shapes = []
        if not sep or not name or len(shapes) not in (1, 3) or any(
                d < 0 for s in shapes for d in s):
            raise AgentError("bad_argument", "--shapes expects NAME:MIN,OPT,MAX or NAME:SHAPE "
                             "with shapes like 1x3x224x224, found {!r}".format(item))
        if len(shapes) == 1:
            shapes = shapes * 3
        out[name] = (shapes[0], shapes[1], shapes[2])
    return out


def plan_from_args(args: argparse.Namespace, precision: Optional[str] = None) -> BuildPlan:
    """The BuildPlan of ``add_build_arguments``' flags (checked), for every command that has
    them; flags a command does not offer (``engine_options=False``) take their defaults."""
    layers = parse_layer_precisions(args.layer_precisions)
    constraints = args.precision_constraints or DEFAULT_CONSTRAINTS
    if layers and constraints == "none":
        log.warning("--layer-precisions with --precision-constraints none (the default, as in "
                    "Polygraphy): TensorRT may override them; add --precision-constraints obey "
                    "to enforce them")
    precision = precision or args.precision or "fp32"
    calibration = None
    if args.calib or args.calibration_cache:
        calibration = CalibrationSettings(
            data=os.path.abspath(args.calib) if args.calib else None,
            algorithm=args.calib_algo,
            batch_size=args.calib_batch_size,
            cache=os.path.abspath(args.calibration_cache) if args.calibration_cache else None,
            shuffle_seed=getattr(args, "calib_shuffle_seed", None),
            max_samples=getattr(args, "calib_max_samples", None),
        )
    plan = BuildPlan(
        precision=precision,
        layer_precisions=layers,
        precision_constraints=constraints,
        calibration=calibration,
        shapes=parse_shapes(getattr(args, "shapes", [])),
        workspace_bytes=int(args.workspace * (1 << 20)) if getattr(args, "workspace", None)
        else None,
        dla_core=getattr(args, "dla_core", None),
        dla_gpu_fallback=not getattr(args, "dla_no_gpu_fallback", False),
        explicit_int8=bool(getattr(args, "explicit_int8", False)),
    )
    if plan.needs_calibration and not _explicitly_quantized(calibration, args):
        if calibration is None:
            raise AgentError("bad_argument", "an {} build needs --calib PATH (calibration data) "
                             "or --calibration-cache FILE, found neither".format(precision))
        if calibration.data and not os.path.exists(calibration.data):
            raise AgentError("file_not_found", "--calib {} does not exist (expected a directory "
                             "of .npy/.npz shards, an .npz or a Polygraphy inputs JSON)".format(
                                 args.calib))
        if not calibration.data and not os.path.isfile(calibration.cache or ""):
            raise AgentError("file_not_found", "--calibration-cache {} does not exist and no "
                             "--calib data was given to make it".format(args.calibration_cache))
    return plan


def _explicitly_quantized(calibration: Optional[CalibrationSettings],
                          args: argparse.Namespace) -> bool:
    """A Q/DQ model carries its own INT8 scales: an int8 build of it needs no --calib (and
    never calibrates). Only read when calibration is missing."""
    model = getattr(args, "model", None)
    if calibration is not None or not model or not os.path.isfile(model):
        return False
    from agent.engines.backends import quantization

    return quantization.of_file(model) != "none"


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def default_backend(info: plat.PlatformInfo) -> str:
    if info.kind in ("jetson", "dgpu") and _importable("tensorrt"):
        return "tensorrt"
    return "onnxruntime"


def make_backend(name: str, threads: Optional[int] = None) -> Backend:
    if name == "onnxruntime" and threads:
        from agent.engines.backends import onnxruntime as ort_backend
        return ort_backend.create(threads=threads)
    backend = get_backend(name)
    if hasattr(backend, "memory_limit"):  # TensorRT: the daemon's default cap, here too
        from agent.engines.backends.tensorrt_plan import build_memory_limit
        from agent.platform.detection import memory_for_builds

        backend.memory_limit = build_memory_limit(None, *memory_for_builds())
    return backend


def open_cache(args: argparse.Namespace) -> Tuple[EngineCache, str]:
    """The engine cache and the state directory named by the flags, the environment and the
    config's defaults."""
    state = check_state_dir(fsio.state_dir(getattr(args, "state_dir", None)))
    budget_text = getattr(args, "cache_budget", None)
    if budget_text is not None:
        try:
            budget = config_schema.parse_size(budget_text, "--cache-budget")
        except AgentError as exc:
            raise AgentError("bad_argument", exc.message)
    else:
        budget = config.CacheConfig().engine_budget_bytes
    protected = models_guard.protection(models_dir(args, state))
    return EngineCache(os.path.join(state, "engines"), budget_bytes=budget,
                       protected=protected), state


def progress_for(args: argparse.Namespace) -> ProgressBar:
    """A bar on a terminal, plain lines otherwise, nothing with --json (stderr either way)."""
    return ProgressBar(sys.stderr, enabled=not getattr(args, "json", False))


def require_file(path: str, what: str, expected: str) -> None:
    """``file_not_found`` saying whether ``path`` is missing or a directory."""
    if not os.path.isfile(path):
        raise AgentError("file_not_found", "{} {} {} (expected {})".format(
            what, path, "is a directory" if os.path.isdir(path) else "does not exist",
            expected))


def model_label(path: str) -> str:
    """What ``cache ls`` shows: the file name, with its directory when the name alone says
    little (examples/digits/model.onnx -> digits/model.onnx)."""
    path = os.path.abspath(path)
    parent = os.path.basename(os.path.dirname(path))
    name = os.path.basename(path)
    return "{}/{}".format(parent, name) if parent and name in GENERIC_NAMES else name


def build_from_args(args: argparse.Namespace, model: str
                    ) -> Tuple[EngineRecord, Backend, plat.Decision]:
    """Platform decision, plan, backend, then ``build_engine``."""
    require_file(model, "model", "an ONNX file")
    info = plat.detect()
    backend_name = args.backend or default_backend(info)
    decision = plat.decide(args.precision, info, fallback=args.fallback, backend=backend_name)
    decision.raise_if_rejected()
    plan = plan_from_args(args, decision.plan_precision)
    backend = make_backend(backend_name, args.threads)
    cache, state = open_cache(args)
    if getattr(args, "plugin", None):  # loaded only from the models directory, pinned
        plan.plugins = plugins.check_libraries(args.plugin, models_dir(args, state))
    record = build_engine(os.path.abspath(model), plan, backend, cache,
                          info.fingerprint(backend_name), progress=progress_for(args),
                          calibration_dir=os.path.join(state, "calibration"),
                          model_label=model_label(model))
    return record, backend, decision


def report(record: EngineRecord, backend: Backend, decision: plat.Decision) -> Dict[str, Any]:
    result = record.result
    out: Dict[str, Any] = {
        "engine": record.engine_path,
        "cache_hit": record.cache_hit,
        "precision": result.get("precision"),
        "seconds": round(record.seconds, 4),
        "key": record.key,
        "backend": backend.name,
        "calibrated": bool(result.get("calibrated")),
        "calibration_cache": result.get("calibration_cache"),
        "layer_precisions": result.get("layer_precisions", {}),
        "mismatches": result.get("mismatches", []),
        "build_seconds": result.get("seconds"),
        "decision": decision.to_dict(),
        "details": result.get("details", {}),
        "conditions": conditions.snapshot(),  # power mode, clocks, temperatures
    }
    if record.budget_report:
        out["cache_budget"] = record.budget_report
    return out


def budget_note(budget: Dict[str, Any]) -> Optional[str]:
    """The line that says the engines in use alone exceed the cache budget (None if not)."""
    if not budget.get("protected_over_budget"):
        return None
    users = [u for p in budget["protected"] for u in p["users"]]
    return ("note: the engines in use ({}: {}) alone take {} bytes, more than the cache budget "
            "of {} bytes; they are kept (they count outside the budget)".format(
                len(budget["protected"]), ", ".join(users[:6]) + (", ..." if len(users) > 6
                                                                  else ""),
                budget["protected_bytes"], budget["budget_bytes"]))


def print_human(out: Dict[str, Any]) -> None:
    decision = out["decision"]
    if decision["status"] == "fell_back":
        print("note: {}".format(decision["reason"]), file=sys.stderr)
    print("engine:      {}".format(out["engine"]))
    if out["cache_hit"]:
        print("cache:       hit ({}), {:.3f} s".format(out["key"][:16], out["seconds"]))
    else:
        print("cache:       miss ({}): built in {:.3f} s".format(out["key"][:16], out["seconds"]))
    print("precision:   {}{}".format(out["precision"],
                                     " (emulated)" if decision.get("emulated") else ""))
    if out["calibration_cache"]:
        how = "calibrated now" if out["calibrated"] else "read, no calibration"
        print("calibration: {} ({})".format(out["calibration_cache"], how))
    counts = out["details"].get("counts")
    if counts:
        # A Q/DQ model's int8 layers are the ones its pairs cover (never calibrated here).
        quant = out["details"].get("quantization", "none")
        print("layers:      {}".format(", ".join(
            "{} {}".format(n, p if p != "int8" or quant == "none" else p + " (explicit)")
            for p, n in sorted(counts.items()) if n)))
    inside = out["details"].get("subgraph_counts")
    if inside:
        print("subgraphs:   {} (layers inside If/Loop/Scan bodies)".format(", ".join(
            "{} {}".format(n, p) for p, n in sorted(inside.items()) if n)))
    if out["details"].get("warning"):  # a cache hit says it again
        print("warning:     {}".format(out["details"]["warning"]), file=sys.stderr)
    for layer, asked, got in out["mismatches"]:
        print("mismatch:    {} asked {}, runs {}".format(layer, asked, got))
    if conditions.describe(out["conditions"]):
        print("conditions:  {}".format(conditions.describe(out["conditions"])))


def save_engine(path: str, model: str, record: EngineRecord, backend: Backend,
                shapes: Optional[Dict[str, Any]] = None, dla_core: Optional[int] = None) -> str:
    """The engine copied to ``path`` atomically (temporary file, fsync, rename) and its
    meta.json (``agent.device.models.meta``) written to ``path + ".json"``, the same way."""
    import re
    import shutil
    import tempfile

    from agent.device.models import meta as model_meta
    from agent.fsio import atomic_write, fsync_dir, sha256_file

    path = os.path.abspath(path)
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise AgentError("file_not_found", "--save-engine: expected an existing directory for "
                         "{}, found none".format(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as dst, open(record.engine_path, "rb") as src:
            shutil.copyfileobj(src, dst, 1 << 20)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, path)
        fsync_dir(directory)
    except OSError as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise AgentError("disk_full" if exc.errno == 28 else "file_not_found",
                         "--save-engine: cannot write {}: {}".format(path, exc.strerror or exc))
    io: Dict[str, Any] = {}
    try:
        with backend.open(path) as runner:
            io = {"inputs": [t.to_dict() for t in runner.inputs],
                  "outputs": [t.to_dict() for t in runner.outputs]}
    except AgentError:
        pass
    info = plat.detect()
    sha = sha256_file(model)
    label = re.sub(r"[^a-z0-9_.-]+", "-", os.path.splitext(model_label(model))[0].lower())
    built = record.result or {}
    result = dict(built, engine_key=record.key, io=io, backend=backend.name,
                  layers_kept=built.get("layer_precisions") or {},
                  quantization=(built.get("details") or {}).get("quantization"))
    meta = model_meta.build(label.strip("-.")[:64] or "model", sha[:12], sha, result,
                            info.to_dict(), info.fingerprint(backend.name), None, time.time(),
                            "committed", sha256_file(path), os.path.getsize(path),
                            dla_core=dla_core, shapes=shapes,
                            plugins=((record.result or {}).get("details") or {}).get("plugins"))
    atomic_write(path + ".json", (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode())
    return path


def run(args: argparse.Namespace) -> int:
    record, backend, decision = build_from_args(args, args.model)
    out = report(record, backend, decision)
    note = budget_note(out.get("cache_budget") or {})
    if note:
        print(note, file=sys.stderr)
    if args.save_engine:
        out["saved_engine"] = save_engine(args.save_engine, args.model, record, backend,
                                          parse_shapes(getattr(args, "shapes", None) or []),
                                          getattr(args, "dla_core", None))
        out["saved_meta"] = out["saved_engine"] + ".json"
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print_human(out)
        if args.save_engine:
            print("saved:       {} (+ .json)".format(out["saved_engine"]))
    return 0
