"""Shared by the real-model benchmarks: ``minimal`` against ``bisect`` on one model and plan,
and the two rows that check the bound (no more layers than bisect, in at most 2x bisect's
evaluations + 4 unless the adaptive budget went on while the set still shrank fast); each
plan built with faithful and with naive emulation. Not a benchmark itself (the leading
underscore keeps it out of the list)."""

import os
import sys
import time


def minimal_vs_bisect(label, path, plan, feeds, goldens, backend, work, compare_options):
    """(results by mode, rows): each mode searched with its own engine cache."""
    from agent.engines.cache import EngineCache
    from agent.precision.searcher import run_search

    found = {}
    for mode in ("minimal", "bisect"):
        cache = EngineCache(os.path.join(work, "engines-{}-{}".format(label, mode)))
        t = time.monotonic()
        found[mode] = run_search(path, plan, feeds, goldens, backend, cache, {"kind": "host"},
                                 mode=mode, compare_options=compare_options,
                                 calibration_dir=os.path.join(work, "cal"))
        found[mode].wall = time.monotonic() - t
        print("  {} {}: {} evaluations, {} kept, {:.0f} s".format(
            label, mode, found[mode].evaluations, found[mode].layers_kept, found[mode].wall),
            file=sys.stderr)
    m, b = found["minimal"], found["bisect"]
    bound = 2 * b.evaluations + 4
    ok = m.evaluations <= bound or (m.budget_extended and m.layers_kept < b.layers_kept)
    rows = [{"name": "{}: evaluations, minimal vs bisect ({} candidates)".format(
                label, m.candidates), "ours": m.evaluations, "baseline": b.evaluations,
             "goal": "<= 2x bisect + 4 = {} (or more while still shrinking fast): {}".format(
                 bound, "met" if ok else "MISSED")},
            {"name": "{}: layers kept, minimal vs bisect".format(label),
             "ours": m.layers_kept, "baseline": b.layers_kept,
             "goal": "<= bisect: {}".format("met" if m.layers_kept <= b.layers_kept
                                             else "MISSED")}]
    return found, rows


def emulation_engines(path, plans, work):
    """(plan name, naive, engine path) for each of ``plans`` built with the faithful emulation
    and with the naive one (``JETSON_AGENT_NAIVE_EMULATION=1``, still set while the caller
    measures that engine)."""
    from agent.engines.backends.onnxruntime import create

    try:
        for name, plan in plans.items():
            for naive in (False, True):
                os.environ.pop("JETSON_AGENT_NAIVE_EMULATION", None)
                if naive:
                    os.environ["JETSON_AGENT_NAIVE_EMULATION"] = "1"
                engine = os.path.join(work, "{}-{}.onnx".format(name, naive))
                create(threads=2).build(path, plan, engine)
                yield name, naive, engine
    finally:
        os.environ.pop("JETSON_AGENT_NAIVE_EMULATION", None)
