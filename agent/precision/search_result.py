"""What a precision search found, and how it is told (worker side: Python 3.6).

``SearchResult`` is what ``searcher.run_search`` returns (also when it was stopped midway);
the helpers here turn comparisons into the per-evaluation stats, the sensitivity table and the
one-line message. Pure: no backend, no build, so a report can be read and tested without one.
"""

from collections import OrderedDict
from typing import Any, Dict, List, Optional

from agent.precision.comparison import Comparison
from agent.precision.ranking import LayerScore


class SearchResult(object):
    """What a search found (or had found when it was stopped)."""

    def __init__(self) -> None:
        self.model = ""
        self.mode = ""
        self.direction = ""
        self.precision = ""
        self.keep_precision = "float32"
        self.candidates = 0  # layers TensorRT can set: folded/fused nodes count once
        self.candidate_nodes = 0  # the ONNX nodes of those layers
        self.keep: List[str] = []  # ONNX nodes, every node of each kept layer
        self.layers_kept = 0  # layers (groups) kept: what the search minimizes
        self.groups: Dict[str, List[str]] = OrderedDict()  # kept layers of several nodes
        self.passed = False
        self.complete = False
        self.interrupted = False
        self.exhausted = False
        self.one_minimal = False  # every removal from the answer built, and each failed
        self.untested_removals: List[str] = []  # members whose removal was never built
        self.out_of_reach: List[Dict[str, Any]] = []  # nodes with subgraphs, not searchable
        self.budget: Optional[int] = None
        self.budget_cap: Optional[int] = None  # the default's: the most past ``budget``
        self.budget_extended = False  # shrinking went past ``budget`` (cheap, shrinking fast)
        self.ranking_cached = False
        self.predicted: Optional[List[str]] = None  # pre-flight: the set verified first
        self.prediction_passed: Optional[bool] = None
        self.evaluations = 0
        self.builds = 0
        self.cache_hits = 0
        self.iterations: List[Dict[str, Any]] = []
        self.sensitivity: List[Dict[str, Any]] = []
        self.ranking: List[str] = []
        self.suspects = 0
        self.engine_key: Optional[str] = None
        self.engine_path: Optional[str] = None
        self.comparison: Optional[Comparison] = None
        self.seconds = 0.0
        self.message = ""

    @property
    def layer_precisions(self) -> str:
        """Ready to paste after ``--layer-precisions``, in graph order."""
        return " ".join("{}:{}".format(name, self.keep_precision) for name in self.keep)

    def to_dict(self) -> Dict[str, Any]:
        return OrderedDict([
            ("model", self.model),
            ("mode", self.mode),
            ("direction", self.direction),
            ("precision", self.precision),
            ("keep_precision", self.keep_precision),
            ("candidates", self.candidates),
            ("candidate_nodes", self.candidate_nodes),
            ("layers_kept", self.layers_kept),
            ("keep", list(self.keep)),
            ("groups", OrderedDict((k, list(v)) for k, v in self.groups.items())),
            ("layer_precisions", self.layer_precisions),
            ("passed", self.passed),
            ("complete", self.complete),
            ("interrupted", self.interrupted),
            ("exhausted", self.exhausted),
            ("partial", not self.complete),
            ("one_minimal", self.one_minimal),
            ("untested_removals", list(self.untested_removals)),
            ("out_of_reach", list(self.out_of_reach)),
            ("budget", self.budget),
            ("budget_cap", self.budget_cap),
            ("budget_extended", self.budget_extended),
            ("ranking_cached", self.ranking_cached),
            ("predicted", self.predicted),
            ("prediction_passed", self.prediction_passed),
            ("evaluations", self.evaluations),
            ("builds", self.builds),
            ("cache_hits", self.cache_hits),
            ("seconds", round(self.seconds, 3)),
            ("engine_key", self.engine_key),
            ("engine", self.engine_path),
            ("message", self.message),
            ("comparison", self.comparison.to_dict()["outputs"] if self.comparison else None),
            ("suspects", self.suspects),
            ("iterations", self.iterations),
            ("sensitivity", self.sensitivity),
        ])


def output_stats(cmp: Comparison) -> Dict[str, Any]:
    """Per output: pass, the minimum tolerances that would have passed, SQNR, cosine."""
    out: Dict[str, Any] = OrderedDict()
    for name, s in cmp.to_dict()["outputs"].items():
        out[name] = OrderedDict((k, s.get(k)) for k in (
            "passed", "required_atol", "required_rtol", "sqnr_db", "cosine"))
        if s.get("golden_near_zero") and s.get("sqnr_db") is None:
            out[name]["golden_near_zero"] = True
    return out


def describe_needs(cmp: Comparison) -> str:
    parts = []
    for name, s in cmp.summary().items():
        parts.append("{} needs atol {} or rtol {}".format(
            name, _fmt(s.get("required_atol")), _fmt(s.get("required_rtol"))))
    return "; ".join(parts)


def _fmt(x: Any) -> str:
    return "n/a" if x is None else "{:.4g}".format(x)


def sensitivity_table(scores: List[LayerScore], layers: List[str], keep: List[str],
                 comparisons: Dict[frozenset, Comparison], mode: str) -> List[Dict[str, Any]]:
    """One row per candidate, worst first: the error it introduced in the instrumented run,
    whether it is kept, and for kept layers what dropping it alone did (when that was built)."""
    kept = set(keep)
    rows: List[Dict[str, Any]] = []
    order = [s.name for s in scores] if scores else list(layers)
    by_name = {s.name: s for s in scores}
    for rank, name in enumerate(order, 1):
        row: Dict[str, Any] = OrderedDict([("layer", name), ("rank", rank),
                                           ("kept", name in kept)])
        if name in by_name:
            row.update((k, v) for k, v in by_name[name].to_dict().items() if k != "layer")
        if name in kept:
            without = comparisons.get(frozenset(kept - {name}))
            if without is not None:
                row["without_it"] = OrderedDict([("passed", without.passed),
                                                 ("stats", output_stats(without))])
        rows.append(row)
    if not scores:
        # Without a ranking only the kept layers carry information.
        rows = [r for r in rows if r["kept"]]
    return rows


def result_message(result: SearchResult) -> str:
    how = "stopped" if result.interrupted else (
        "stopped after {} evaluations (limit)".format(result.evaluations)
        if result.exhausted else "done")
    if not result.passed:
        return "{}: no passing set found yet after {} evaluations".format(
            how, result.evaluations)
    reach = ""
    if result.out_of_reach:
        reach = "; nested subgraphs searched as one layer each: {}".format(", ".join(
            "{} {!r} ({} nodes)".format(r["op"], r["node"], r["nodes_inside"])
            for r in result.out_of_reach[:5]))
    if not result.keep:
        return "{}: the model passes with no layer kept in higher precision ({} " \
               "evaluation(s)){}".format(how, result.evaluations, reach)
    if result.prediction_passed:
        how = "done: the predicted set passed"
    nodes = "" if len(result.keep) == result.layers_kept else " ({} ONNX nodes: folded or " \
        "fused nodes count once)".format(len(result.keep))
    text = "{}: keep {} of {} layer(s){} in {} ({} evaluations): --layer-precisions {}".format(
        how, result.layers_kept, result.candidates, nodes, result.keep_precision,
        result.evaluations, result.layer_precisions)
    if result.complete and not result.one_minimal and result.untested_removals:
        text += " (not shown 1-minimal: the removal of {} of them was never built{})".format(
            len(result.untested_removals),
            "; no more layers than bisect and worst-first keep, raise --max-evaluations "
            "for a smaller set" if result.mode == "minimal" else "")
    return text + reach
