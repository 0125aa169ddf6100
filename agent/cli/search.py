"""``jetson-agent search``: which layers must stay in higher precision to pass the goldens.

Modes: ``minimal`` (default: a small set where dropping any member fails), ``worst-first``
(the smallest passing prefix of the layers ranked by the error they introduce), and
Polygraphy's ``bisect`` / ``linear`` (a prefix from the inputs, ``--direction forward``, or a
suffix, ``reverse``). Every candidate engine goes through the engine cache, int8 calibration
runs once. Prints the set as a ready-to-paste ``--layer-precisions`` value, the iteration log
and the per-layer sensitivity table; ``--json`` prints the whole result. Ctrl-C stops the
search and prints what it had found (exit status 130). Exit status 0 when the search
completed, 1 when ``--max-evaluations`` stopped it first.
"""

import argparse
import json
import sys
from typing import Any, Dict, List

from agent.cli import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from agent.cli.build import plan_from_args
from agent.cli.compare import (
    Setup,
    add_build_args,
    add_golden_args,
    add_tolerance_args,
    compare_options,
    load_goldens,
    progress_bar,
)
from agent.errors import AgentError
from agent.precision.comparison import sqnr_text
from agent.precision.search import DIRECTIONS, MODES


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "search", help="find the layers that must stay in higher precision (precision search)",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    add_build_args(p)
    p.add_argument("--mode", choices=MODES, default="minimal",
                   help="search strategy (default minimal)")
    p.add_argument("--direction", choices=DIRECTIONS, default="forward",
                   help="bisect/linear: mark layers from the inputs (forward) or the outputs")
    p.add_argument("--keep-precision", choices=("float32", "float16"), default="float32",
                   help="the higher precision kept layers run in (float16 only with --int8)")
    p.add_argument("--no-instrument", action="store_true",
                   help="minimal: skip the two builds with every tensor marked as an output "
                   "(no ranking; more evaluations)")
    p.add_argument("--max-evaluations", type=int, metavar="N",
                   help="evaluation budget: minimal shrinks its set with what is left after "
                   "bisect's steps and the bound by worst-first (default adaptive: about 2x "
                   "bisect's, more while the set still shrinks fast and evaluations are "
                   "cheap, at most 100; it stops once 8 evaluations in a row decided "
                   "nothing; a given N is spent as asked); other modes stop after N (the "
                   "result is then partial)")
    p.add_argument("--preflight", action="store_true",
                   help="search on the host emulation first, then verify its set with one "
                   "build on the chosen backend, searching there only if it fails")
    add_golden_args(p)
    add_tolerance_args(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.precision.searcher import preflight, run_search

    if not args.precision:
        raise AgentError("bad_argument", "a precision search needs a reduced precision: "
                         "expected --fp16, --int8 or --best, found none")
    if args.keep_precision == "float16" and args.precision != "int8":
        raise AgentError("bad_argument", "--keep-precision float16 needs --int8 (fp16 is the "
                         "reduced precision of --{})".format(args.precision))
    if args.max_evaluations is not None and args.max_evaluations < 1:
        raise AgentError("bad_argument", "--max-evaluations must be >= 1, found {}".format(
            args.max_evaluations))
    opts = compare_options(args)
    plan = plan_from_args(args)
    setup = Setup(args)
    inputs, goldens, _source = load_goldens(args, args.model, setup)
    kwargs: Dict[str, Any] = dict(
        mode=args.mode, direction=args.direction, compare_options=opts,
        progress=progress_bar(args), max_evaluations=args.max_evaluations,
        keep_precision=args.keep_precision, calibration_dir=setup.calibration_dir,
        instrument=not args.no_instrument, report=evaluation_lines(args))
    host = None
    try:
        if args.preflight:
            host = preflight(args.model, plan, inputs, goldens, setup.cache, setup.fingerprint,
                             **kwargs)
            if host.passed:
                kwargs["predicted"] = host.keep
        result = run_search(args.model, plan, inputs, goldens, setup.backend, setup.cache,
                            setup.fingerprint, **kwargs)
    finally:
        setup.finish()
    doc = result.to_dict()
    if host is not None:
        doc["preflight"] = {"backend": "onnxruntime", "evaluations": host.evaluations,
                            "keep": host.keep, "passed": host.passed,
                            "device_evaluations": result.evaluations}
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(format_result(doc))
    if result.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if result.complete else EXIT_FAILED


def evaluation_lines(args: argparse.Namespace) -> Any:
    """One stderr line per evaluation (layers kept, verdict, time) when stderr is not a
    terminal (a terminal gets the progress bar); nothing with -q."""
    if getattr(args, "quiet", False):
        return lambda line: None
    if sys.stderr.isatty():
        return lambda line: None

    def write(line: str) -> None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    return write


def _g(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "{:.3g}".format(x)
    return str(x)


def _worst(stats: Dict[str, Any], key: str, low: bool = False) -> Any:
    values = [s.get(key) for s in stats.values() if s.get(key) is not None]
    if not values:
        return None
    return min(values) if low else max(values)


def format_result(doc: Dict[str, Any], sensitivity_rows: int = 20) -> str:
    """The search result as text: summary, iteration log, sensitivity table, the answer."""
    lines: List[str] = []
    add = lines.append
    add("[I] Precision search | mode {} ({}) | {} | {} candidate layer(s) | keep in {}".format(
        doc["mode"], doc["direction"], doc["precision"], doc["candidates"],
        doc["keep_precision"]))
    add("[I] {} evaluation(s), {} build(s) ({} from the cache), {:.2f} s".format(
        doc["evaluations"], doc["builds"], doc["cache_hits"], doc["seconds"]))
    add("[I] Iterations:")
    add("      #   size  result  seconds  cached  required atol  required rtol  SQNR dB")
    for it in doc["iterations"]:
        stats = it.get("stats", {})
        add("    {:>3}  {:>5}  {:<6}  {:>7.2f}  {:<6}  {:>13}  {:>13}  {:>7}".format(
            it["index"], it["size"], "PASS" if it["passed"] else "FAIL", it["seconds"],
            "yes" if it["cache_hit"] else "no", _g(_worst(stats, "required_atol")),
            _g(_worst(stats, "required_rtol")), sqnr_text(
                _worst(stats, "sqnr_db", low=True),
                any(s.get("golden_near_zero") for s in stats.values()))))
    rows = doc.get("sensitivity") or []
    if rows:
        add("[I] Layer sensitivity (worst first; growth = log10 of the error growth from inputs "
            "to outputs):")
        add("    rank  layer{}  score    growth  out-of-range  kept  without it".format(
            " " * 26))
        for row in rows[:sensitivity_rows]:
            without = row.get("without_it")
            add("    {:>4}  {:<31.31}  {:>7}  {:>6}  {:>12}  {:<4}  {}".format(
                row["rank"], row["layer"], _g(row.get("score")), _g(row.get("growth_log10")),
                _g(row.get("out_of_range")), "yes" if row["kept"] else "",
                "" if without is None else ("passes" if without["passed"] else "fails")))
        if len(rows) > sensitivity_rows:
            add("    ... {} more (see --json)".format(len(rows) - sensitivity_rows))
    pre = doc.get("preflight")
    if pre:
        add("[I] Pre-flight on the host emulation: {} evaluation(s), predicted {} layer(s); "
            "{}".format(pre["evaluations"], len(pre["keep"]),
                        "verified here with one build" if doc.get("prediction_passed")
                        else "the prediction failed here, so this searched"))
    tag = "[I]" if doc["passed"] else "[E]"
    message = doc["message"]
    if doc["passed"] and doc["keep"]:  # the list follows, ready to paste: print it once
        message = message.split(": --layer-precisions")[0]
    add("{} {}".format(tag, message))
    if doc["passed"] and doc["keep"]:
        layers, nodes = doc.get("layers_kept", len(doc["keep"])), len(doc["keep"])
        add("[I] Keep these {} layer(s) in {}{}:".format(
            layers, doc["keep_precision"], "" if nodes == layers else
            " ({} ONNX nodes: folded or fused nodes go with their layer)".format(nodes)))
        add("    --layer-precisions {}".format(doc["layer_precisions"]))
    if doc.get("engine"):
        add("[I] Engine {} (key {})".format(doc["engine"], doc["engine_key"]))
    return "\n".join(lines)
