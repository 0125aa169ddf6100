"""docs/architecture.md's generated part (import rules, import graph, module map) matches the
code: regenerate it with ``python scripts/lib/gen_architecture.py``."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_generated_part_is_current():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "lib",
                                                       "gen_architecture.py"), "--check"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, "docs/architecture.md is stale: run python " \
        "scripts/lib/gen_architecture.py\n" + out.stderr


def test_circles_and_back_arrows_are_found():
    sys.path.insert(0, os.path.join(ROOT, "scripts", "lib"))
    try:
        import gen_architecture as gen
    finally:
        sys.path.pop(0)
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert gen.circles(graph) == [["a", "b", "c"]]
    assert gen.back_arrows(graph) == [("c", "a")]
    assert gen.circles({"a": {"b"}, "b": set()}) == [] and gen.back_arrows({"a": set()}) == []
