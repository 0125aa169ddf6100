"""Benchmark runner: each module in scripts/benchmarks/ has ``run() -> list of rows``.

A row is a dict: name, ours, baseline, unit, ratio (ours/baseline unless given), goal (text).
Everything in one row is measured in the same run, side by side.
"""

import argparse
import importlib.util
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BENCH_DIR = os.path.join(ROOT, "scripts", "benchmarks")
sys.path.insert(0, ROOT)


def load(name):
    spec = importlib.util.spec_from_file_location("bench_" + name,
                                                  os.path.join(BENCH_DIR, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fmt(value):
    if isinstance(value, float):
        return "{:.4g}".format(value)
    return "-" if value is None else str(value)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    available = sorted(f[:-3] for f in os.listdir(BENCH_DIR)
                       if f.endswith(".py") and not f.startswith("_"))
    names = args.names or available
    unknown = sorted(set(names) - set(available))
    if unknown:
        parser.error("unknown benchmark(s) {}; available: {}".format(
            ", ".join(unknown), ", ".join(available)))
    rows = []
    for name in names:
        started = time.monotonic()
        print("running {} ...".format(name), file=sys.stderr)
        for row in load(name).run():
            if row.get("ratio") is None and row.get("ours") and row.get("baseline"):
                row["ratio"] = row["ours"] / row["baseline"]
            row.setdefault("bench", name)
            rows.append(row)
        print("  {} done in {:.1f} s".format(name, time.monotonic() - started), file=sys.stderr)
    header = ("benchmark", "metric", "ours", "baseline", "unit", "ratio", "goal")
    table = [header] + [
        (r["bench"], r["name"], fmt(r.get("ours")), fmt(r.get("baseline")), r.get("unit", ""),
         fmt(r.get("ratio")), r.get("goal", "")) for r in rows]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(header))]
    print("host: {} ({} CPUs), Python {}".format(platform.platform(), os.cpu_count(),
                                               platform.python_version()))
    for i, row in enumerate(table):
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    if not rows:
        print("(no benchmarks yet)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
