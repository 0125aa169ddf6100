"""``jetson-agent selftest``: the acceptance run of a board, the first thing to run on a new one.

Builds the bundled examples in every precision the board's support-matrix row allows with the
platform's backend (TensorRT on a Jetson, onnxruntime on a host), calibrates INT8, compares with
the goldens (and, on a device, with the host emulation's verdicts), benchmarks each engine,
exercises the DLA where there is one, and writes one report (``selftest.json``, schema
``jetson-agent/selftest/1``, docs/platform.md) to attach to a bug report. Exit status 0 when
every row passed, 1 when one failed, 2 when the run could not start. The work is in
``agent.worker.selftest``.
"""

import argparse
import json
import os
import sys
from typing import Any

from agent import platform as plat
from agent.cli import EXIT_FAILED, EXIT_OK


def add_parser(sub: Any) -> None:
    p = sub.add_parser("selftest", help="acceptance run: build, check and time the bundled "
                       "examples in every precision this board allows",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", default="selftest-report", metavar="DIR",
                   help="where selftest.json is written (default ./selftest-report)")
    p.add_argument("--backend", choices=("tensorrt", "onnxruntime"),
                   help="backend (default: the platform's)")
    p.add_argument("--bench-iterations", type=int, default=20, metavar="N",
                   help="timed inferences per engine (default 20)")
    p.add_argument("--no-jtop", action="store_true", help="do not ask the jtop service")
    p.set_defaults(func=run)


def _line(row: dict) -> str:
    bits = ["{:<9} {:<5}{}".format(row["example"], row["precision"],
                                   "" if row.get("dla_core") is None else " (DLA)"),
            row["status"]]
    if row.get("build"):
        bits.append("build {:.2f} s".format(row["build"]["seconds"]))
    if row.get("top1"):
        bits.append("top-1 {:.2%}".format(row["top1"]["accuracy"]))
    if row.get("bench"):
        bits.append("median {:.3f} ms".format(row["bench"]["median_ms"] or 0.0))
    if row.get("emulation", {}).get("agrees") is not None:
        bits.append("emulation {}".format("agrees" if row["emulation"]["agrees"]
                                          else "DISAGREES"))
    return "  ".join(bits)


def run(args: argparse.Namespace) -> int:
    from agent.errors import AgentError
    from agent.worker.selftest import run_selftest

    if args.bench_iterations < 1:
        raise AgentError("bad_argument", "--bench-iterations must be >= 1, found {}".format(
            args.bench_iterations))
    info = plat.detect(use_jtop=not args.no_jtop)
    say = (lambda line: None) if args.json else (lambda line: print("..", line, flush=True))
    report, path = run_selftest(info, os.path.abspath(args.out), args.backend,
                                args.bench_iterations, say)
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True, default=str)
        print()
    else:
        v = report["versions"]
        print("board: {} ({}), backend {}".format(report["board"]["board"],
                                                  report["board"]["matrix_row"],
                                                  report["backend"]))
        print("versions: " + ", ".join("{} {}".format(k, v[k]) for k in sorted(v) if v[k]))
        for row in report["results"]:
            print("  " + _line(row))
        print("DLA: {}".format(report["dla"]["status"]))
        for p in report["problems"]:
            print("problem [{}]: {}\n  fix: {}".format(p["where"], p["problem"], p["fix"]))
        print("report: {} ({} s)".format(path, report["timings"]["total_seconds"]))
    return EXIT_OK if report["ok"] else EXIT_FAILED
