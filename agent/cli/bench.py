"""``jetson-agent bench MODEL_OR_ENGINE``: latency percentiles and throughput, trtexec-style.

An ONNX model is first built (through the engine cache) with the same flags as ``build``; an
engine from the cache (its ``meta.json`` beside it) runs on the backend that built it; a
``.engine`` / ``.plan`` / ``.trt`` file runs on tensorrt. Inputs are random (floats in [0, 1)),
``--batch`` sets a dynamic leading dimension. As in trtexec, a warm-up of ``--warm-up``
seconds (default 0.2) comes first, then at least ``--iterations`` (default 10) and at least
``--duration`` seconds (default 3). On tensorrt the GPU compute, enqueue, H2D and D2H times
are reported apart; unstable timings (high coefficient of variation) are warned about.
``--profile FILE`` writes per-layer times in trtexec's ``--exportProfile`` JSON.
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Tuple

from agent import platform as plat
from agent.cli import build as build_cmd
from agent.engines.bench import (
    DEFAULT_DURATION_S,
    DEFAULT_ITERATIONS,
    DEFAULT_WARMUP_S,
    benchmark,
    check_settings,
    phase_split,
    random_feeds,
)
from agent.platform import conditions

TENSORRT_SUFFIXES = (".engine", ".plan", ".trt")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="measure latency and throughput of a model or engine",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("target", metavar="MODEL_OR_ENGINE",
                   help="ONNX model (built first, through the cache) or engine file")
    g = p.add_argument_group("measurement")
    g.add_argument("--iterations", type=int, default=DEFAULT_ITERATIONS, metavar="N",
                   help="timed iterations, at least (default {}, trtexec's)".format(
                       DEFAULT_ITERATIONS))
    g.add_argument("--warm-up", type=float, default=DEFAULT_WARMUP_S, metavar="S",
                   dest="warm_up",
                   help="untimed warm-up, in seconds (default {:g}: trtexec's --warmUp=200 "
                        "ms)".format(DEFAULT_WARMUP_S))
    g.add_argument("--duration", type=float, default=DEFAULT_DURATION_S, metavar="S",
                   help="keep measuring for at least S seconds (default {:g}, trtexec's; 0: "
                        "only --iterations)".format(DEFAULT_DURATION_S))
    g.add_argument("--batch", type=int, default=1, metavar="N",
                   help="value of a dynamic leading (batch) dimension (default 1; an input "
                        "with a fixed one is an error)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    g.add_argument("--profile", metavar="FILE",
                   help="also write per-layer times of --iterations runs to FILE in trtexec's "
                        "--exportProfile JSON (TensorRT's IProfiler; ONNX Runtime's profiler "
                        "on a host, marked emulated)")
    build_cmd.add_build_arguments(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=run)


def _cached_engine_meta(path: str) -> Dict[str, Any]:
    """Backend and precision named in the cache entry's meta.json beside ``path``, if any."""
    meta_path = os.path.join(os.path.dirname(os.path.abspath(path)), "meta.json")
    if not os.path.isfile(meta_path):
        return {}
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        out = {"backend": str(meta["fingerprints"]["backend"]["backend"])}
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    result = meta.get("result") or {}
    plan = meta.get("plan") or {}
    precision = result.get("precision") or plan.get("precision")
    if precision:
        out["precision"] = str(precision)
    return out


def batch_shapes(model: str, batch: int, given: List[str]) -> List[str]:
    """``--shapes`` entries for inputs whose only dynamic dimension is the leading one and that
    ``given`` leaves out: min = opt = max = ``batch`` (as trtexec's ``--shapes``), so a
    TensorRT engine is built for the batch that is measured."""
    from agent.engines.backends import onnx_model

    named = {item.rpartition(":")[0] for item in given}
    out = []
    for spec in onnx_model.input_specs(onnx_model.load_model(model)):
        dims = list(spec.shape)
        if spec.name in named or not dims or dims[0] is not None or None in dims[1:]:
            continue
        out.append("{}:{}".format(spec.name, "x".join(str(d) for d in [batch] + dims[1:])))
    return out


def open_target(args: argparse.Namespace) -> Tuple[Any, Dict[str, Any]]:
    """(runner, what was benchmarked) for the target: an engine, or a model built first."""
    target = args.target
    build_cmd.require_file(target, "MODEL_OR_ENGINE", "an ONNX model or an engine file")
    cached = _cached_engine_meta(target)
    if cached or target.lower().endswith(TENSORRT_SUFFIXES):
        name = args.backend or cached.get("backend") or "tensorrt"
        backend = build_cmd.make_backend(name, args.threads)
        info = {"engine": os.path.abspath(target), "backend": name, "built": False}
        if cached.get("precision"):
            info["precision"] = cached["precision"]
        return backend.open(target), info
    if (args.backend or build_cmd.default_backend(plat.detect())) == "tensorrt":
        args.shapes = list(args.shapes) + batch_shapes(target, args.batch, args.shapes)
    record, backend, decision = build_cmd.build_from_args(args, target)
    info = build_cmd.report(record, backend, decision)
    info["built"] = True
    return backend.open(record.engine_path), info


def _emulated(info: Dict[str, Any]) -> bool:
    """Reduced precision on onnxruntime is an emulation: numerics, not a Jetson's speed."""
    decision = info.get("decision") or {}
    if decision.get("emulated"):
        return True
    return info.get("backend") == "onnxruntime" and info.get("precision") in (
        "fp16", "int8", "best", "fp8", "int4")


def write_profile(path: str, runner: Any, feeds: Dict[str, Any], runs: int,
                  info: Dict[str, Any]) -> str:
    """Per-layer times in trtexec's ``--exportProfile`` shape, written atomically. Host
    times (onnxruntime) are marked ``emulated``: the layers of the rewritten graph on this
    CPU, not a Jetson's."""
    from agent.engines.layer_view import export_profile
    from agent.fsio import atomic_write

    times = runner.layer_times(feeds, runs)
    doc = export_profile(times, runs, {"backend": info.get("backend"),
                                       "emulated": info.get("backend") != "tensorrt"})
    atomic_write(path, (json.dumps(doc, indent=2) + "\n").encode("utf-8"))
    return os.path.abspath(path)


def run(args: argparse.Namespace) -> int:
    check_settings(args.iterations, 0, args.duration, args.batch, args.warm_up)
    runner, info = open_target(args)
    with runner:
        feeds = random_feeds(runner.inputs, batch=args.batch, seed=args.seed,
                             shapes={name: shapes[1] for name, shapes in
                                     build_cmd.parse_shapes(args.shapes).items()})
        result = benchmark(runner, feeds, iterations=args.iterations, warmup=0,
                           duration=args.duration, warmup_seconds=args.warm_up)
        rows = phase_split(runner, feeds, result.iterations)
        if rows:
            result.add_phases(rows)
        if args.profile:
            info["profile"] = write_profile(args.profile, runner, feeds, args.iterations, info)
    info["emulated"] = _emulated(info)
    info["conditions"] = conditions.snapshot()  # as measured: power mode, clocks, temperatures
    out = {"target": info, "benchmark": result.to_dict()}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    bits = [info.get("backend") or "?"]
    if info.get("precision"):
        bits.append(info["precision"])
    if info["emulated"]:
        bits.append("emulated: numerics, not a Jetson's speed")
    if info.get("built"):
        bits.append("cache hit" if info.get("cache_hit") else "built")
    print("engine: {} ({})".format(info.get("engine"), ", ".join(bits)))
    if conditions.describe(info["conditions"]):
        print("conditions: {}".format(conditions.describe(info["conditions"])))
    for line in result.summary():
        print(line)
    if info.get("profile"):
        print("profile: {} (per-layer times, trtexec's --exportProfile JSON{})".format(
            info["profile"], "; emulated" if info.get("backend") != "tensorrt" else ""))
    for warning in result.warnings():
        print("warning: " + warning, file=sys.stderr)
    return 0
