"""``jetson-agent compare``: build an engine (through the cache), run it, compare it with goldens.

The first workflow of Polygraphy's "Adding Precision Constraints" example: compare a
reduced-precision engine with the fp32 reference, with Polygraphy's comparator and report.
Goldens come from ``--load-outputs`` (Polygraphy ``--save-outputs`` JSON or .npz) or are
computed in fp32 on the host; inputs from ``--load-inputs`` or generated like Polygraphy's
data loader (``--val-range``, ``--seed``, ``--iterations``). Exit status 0 only when every
output of every iteration passes, 1 when the comparison fails.

The argument groups shared with ``search`` (goldens, tolerances) live here; the build flags
and the plan come from ``agent.cli.build``.
"""

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Tuple

from agent.cli import EXIT_FAILED, EXIT_OK
from agent.cli.build import add_build_arguments, parse_shapes, plan_from_args
from agent.engines.backends.base import Backend, TensorSpec, get_backend
from agent.precision import golden
from agent.precision.compare import ERROR_STATS, compare_outputs, parse_per_output
from agent.precision.comparison import Comparison
from agent.progress import ProgressBar

# ---------------------------------------------------------------------------------------------
# shared argument groups


def add_build_args(p: argparse.ArgumentParser) -> None:
    """MODEL and the build flags ``compare`` and ``search`` act on (see ``add_build_arguments``):
    no precision flag means none was asked for, and layer precisions bind only when
    ``--precision-constraints`` says so."""
    add_build_arguments(p, model_help="ONNX model", engine_options=False,
                        precision_default=None, constraints_default="none")


def add_golden_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("inputs and goldens")
    g.add_argument("--load-inputs", metavar="FILE",
                   help="inputs: Polygraphy --save-inputs JSON or .npz (default: generated)")
    g.add_argument("--load-outputs", metavar="FILE",
                   help="golden outputs: Polygraphy --save-outputs JSON or .npz (default: "
                   "computed in fp32 on the host)")
    g.add_argument("--val-range", nargs="+", default=[], metavar="[NAME:][LO,HI]",
                   help="range of generated inputs, e.g. x:[1,2] (default [0,1])")
    g.add_argument("--seed", type=int, default=golden.DEFAULT_SEED,
                   help="seed of generated inputs (Polygraphy's default 1)")
    g.add_argument("--iterations", type=int, default=1, help="generated input iterations")


def add_tolerance_args(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("comparison (Polygraphy's semantics)")
    t.add_argument("--atol", nargs="+", default=[], metavar="[OUT:]TOL",
                   help="absolute tolerance, per output with OUT:TOL (default 1e-5)")
    t.add_argument("--rtol", nargs="+", default=[], metavar="[OUT:]TOL",
                   help="relative tolerance, per output with OUT:TOL (default 1e-5)")
    t.add_argument("--check-error-stat", nargs="+", default=[], metavar="[OUT:]STAT",
                   help="one of {} (default elemwise)".format(", ".join(ERROR_STATS)))
    t.add_argument("--error-quantile", nargs="+", default=[], metavar="[OUT:]Q",
                   help="quantile for --check-error-stat quantile (default 0.99)")
    t.add_argument("--infinities-compare-equal", action="store_true",
                   help="matching +-inf values compare equal")


def compare_options(args: argparse.Namespace) -> Dict[str, Any]:
    """Keyword arguments of compare_outputs from the tolerance arguments (validated)."""
    opts: Dict[str, Any] = {
        "atol": parse_per_output(args.atol, "--atol"),
        "rtol": parse_per_output(args.rtol, "--rtol"),
        "check_error_stat": parse_per_output(args.check_error_stat, "--check-error-stat",
                                             "stat"),
        "error_quantile": parse_per_output(args.error_quantile, "--error-quantile",
                                           "quantile"),
        "infinities_compare_equal": bool(args.infinities_compare_equal),
    }
    return {k: v for k, v in opts.items() if v not in ({}, None)}


class Setup(object):
    """Backend, caches and platform fingerprint for one command."""

    def __init__(self, args: argparse.Namespace) -> None:
        from agent import platform as plat
        from agent.cli.build import open_cache

        info = plat.detect(use_jtop=False)
        self.backend: Backend = get_backend(args.backend or info.backend)
        self.fingerprint = info.fingerprint(self.backend.name)
        # The engine cache with its budget (--cache-budget, else the config's): publishing
        # evicts, and ``finish`` leaves the cache within it whatever the command built.
        self.cache, root = open_cache(args)
        self.calibration_dir = os.path.join(root, "calibration")

    def finish(self) -> None:
        self.cache.evict()

    def host_reference(self) -> Backend:
        """fp32 goldens are computed on the host backend, whatever builds the engines."""
        if self.backend.name == "onnxruntime":
            return self.backend
        return get_backend("onnxruntime")


def load_goldens(args: argparse.Namespace, model_path: str, setup: Setup
                 ) -> Tuple[List[golden.Feed], List[golden.Feed], str]:
    from agent.engines.backends import onnx_model

    model = onnx_model.load_model(model_path)
    specs = onnx_model.input_specs(model)
    shapes = parse_shapes(getattr(args, "shapes", []) or [])
    if shapes and not args.load_inputs:
        # Generated inputs of dynamic models take the profile's OPT shape (--shapes).
        specs = [TensorSpec(s.name, s.dtype, shapes[s.name][1]) if s.name in shapes else s
                 for s in specs]
    return golden.prepare(
        model_path, specs, onnx_model.output_specs(model),
        load_inputs_path=args.load_inputs, load_outputs_path=args.load_outputs,
        val_range=golden.parse_val_range(args.val_range), seed=args.seed,
        iterations=args.iterations, reference_backend=setup.host_reference())


def progress_bar(args: argparse.Namespace) -> ProgressBar:
    return ProgressBar(stream=sys.stderr, enabled=not getattr(args, "quiet", False))


# ---------------------------------------------------------------------------------------------
# compare


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "compare", help="build, run and compare an engine with golden outputs (Polygraphy-style)",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    add_build_args(p)
    add_golden_args(p)
    add_tolerance_args(p)
    p.add_argument("--save-inputs", metavar="FILE",
                   help="write the inputs used (Polygraphy JSON, or .npz by extension)")
    p.add_argument("--save-outputs", metavar="FILE",
                   help="write the engine's outputs (Polygraphy RunResults JSON, or .npz)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from agent.engines.build import build_engine

    opts = compare_options(args)
    plan = plan_from_args(args)
    setup = Setup(args)
    inputs, goldens, source = load_goldens(args, args.model, setup)
    # --json: a program reads the result; no bar (as build and bench).
    progress = ProgressBar(enabled=False) if args.json else progress_bar(args)
    try:
        record = build_engine(args.model, plan, setup.backend, setup.cache, setup.fingerprint,
                              progress, calibration_dir=setup.calibration_dir)
        outputs = []
        with setup.cache.pin(record.key):
            with setup.backend.open(record.engine_path) as runner:
                for i, feed in enumerate(inputs):
                    progress("inferring", i, len(inputs))
                    outputs.append(runner.infer(dict(feed)))
                progress("inferring", len(inputs), len(inputs))
    finally:
        setup.finish()
    details = (record.result or {}).get("details") or {}
    emulated = bool(details.get("emulated"))
    if details.get("warning") and not args.json:
        print("warning: {}".format(details["warning"]), file=sys.stderr)
    # A Q/DQ model's engine is "int8 (explicit)", its other layers in the plan's precision.
    built = (record.result or {}).get("precision") or plan.precision
    runner_name = "jetson-agent[{} {}{}]".format(
        setup.backend.name, built if built == plan.precision else
        "{} + {}".format(built, plan.precision), ", emulated" if emulated else "")
    if args.save_inputs:
        golden.save_inputs(args.save_inputs, inputs)
    if args.save_outputs:
        golden.save_outputs(args.save_outputs, outputs, runner=runner_name)
    cmp = compare_outputs(outputs, goldens, runner=runner_name, reference=source,
                          describe=not args.json, **opts)
    print_comparison(args, cmp, record.to_dict())
    return EXIT_OK if cmp.passed else EXIT_FAILED


def print_comparison(args: argparse.Namespace, cmp: Comparison, engine: Dict[str, Any]) -> None:
    if args.json:
        doc = {"passed": cmp.passed, "engine": engine}
        doc.update(cmp.to_dict())
        print(json.dumps(doc, indent=2))
    else:
        print(cmp.format_report())
