"""``jetson-agent bench MODEL_OR_ENGINE``: latency percentiles and throughput, trtexec-style.

An ONNX model is first built (through the engine cache) with the same flags as ``build``; an
engine from the cache (its ``meta.json`` beside it) runs on the backend that built it; a
``.engine`` / ``.plan`` / ``.trt`` file runs on tensorrt. Inputs are random (floats in [0, 1)),
with ``--batch`` for a dynamic leading dimension. The loop runs ``--warmup`` untimed
iterations, then at least ``--iterations`` and at least ``--duration`` seconds.
"""

import argparse
import json
import os
from typing import Any, Dict, Optional, Tuple

from agent.bench import benchmark, check_settings, random_feeds
from agent.commands import build as build_cmd
from agent.errors import AgentError

TENSORRT_SUFFIXES = (".engine", ".plan", ".trt")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("bench", help="measure latency and throughput of a model or engine",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("target", metavar="MODEL_OR_ENGINE",
                   help="ONNX model (built first, through the cache) or engine file")
    g = p.add_argument_group("measurement")
    g.add_argument("--iterations", type=int, default=100, metavar="N",
                   help="timed iterations, at least (default 100)")
    g.add_argument("--warmup", type=int, default=10, metavar="N",
                   help="untimed iterations first (default 10)")
    g.add_argument("--duration", type=float, metavar="S",
                   help="keep measuring for at least S seconds")
    g.add_argument("--batch", type=int, default=1, metavar="N",
                   help="value of a dynamic leading (batch) dimension (default 1)")
    g.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    build_cmd.add_build_arguments(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=run)


def _cached_engine_backend(path: str) -> Optional[str]:
    """The backend named in the cache entry's meta.json beside ``path``, if any."""
    meta_path = os.path.join(os.path.dirname(os.path.abspath(path)), "meta.json")
    if not os.path.isfile(meta_path):
        return None
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        return str(meta["fingerprints"]["backend"]["backend"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def open_target(args: argparse.Namespace) -> Tuple[Any, Dict[str, Any]]:
    """(runner, what was benchmarked) for the target: an engine, or a model built first."""
    target = args.target
    if not os.path.isfile(target):
        raise AgentError("file_not_found", "{} does not exist (expected an ONNX model or an "
                         "engine file)".format(target))
    cached = _cached_engine_backend(target)
    if cached or target.lower().endswith(TENSORRT_SUFFIXES):
        name = args.backend or cached or "tensorrt"
        backend = build_cmd.make_backend(name, args.threads)
        return backend.open(target), {"engine": os.path.abspath(target), "backend": name,
                                      "built": False}
    record, backend, decision = build_cmd.build_from_args(args, target)
    info = build_cmd.report(record, backend, decision)
    info["built"] = True
    return backend.open(record.engine_path), info


def run(args: argparse.Namespace) -> int:
    check_settings(args.iterations, args.warmup, args.duration, args.batch)
    runner, info = open_target(args)
    with runner:
        feeds = random_feeds(runner.inputs, batch=args.batch, seed=args.seed,
                             shapes={name: shapes[1] for name, shapes in
                                     build_cmd.parse_shapes(args.shapes).items()})
        result = benchmark(runner, feeds, iterations=args.iterations, warmup=args.warmup,
                           duration=args.duration)
    out = {"target": info, "benchmark": result.to_dict()}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    bits = [info.get("backend") or "?"]
    if info.get("precision"):
        bits.append(info["precision"])
    if (info.get("details") or {}).get("emulated") or (
            not info.get("built") and info.get("backend") == "onnxruntime"):
        bits.append("emulated")  # host numerics standing in for a device's
    if info.get("built"):
        bits.append("cache hit" if info.get("cache_hit") else "built")
    print("engine: {} ({})".format(info.get("engine"), ", ".join(bits)))
    for line in result.summary():
        print(line)
    return 0
