"""What a comparison found: per-output results, their JSON form and Polygraphy's text report
(pure, worker side: Python 3.6).

``compare`` computes these; the CLI prints ``format_report``, the search logs ``summary()`` per
evaluation and the job result carries ``to_dict()``. Kept apart from the arithmetic so the
reading side (reports, summaries, JSON) has one home.
"""

import math
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple


def _num(x: Optional[float]) -> Optional[float]:
    """JSON-safe number: non-finite values (NaN error, SQNR of identical outputs) become
    null, so consumers can compare what they read; the text report shows them."""
    if x is None or math.isnan(x) or math.isinf(x):
        return None
    return float(x)


def _g(x: Optional[float]) -> str:
    return "n/a" if x is None else "{:.5g}".format(x)


def sqnr_text(sqnr: Optional[float], near_zero: bool, unit: str = "") -> str:
    """SQNR as reports show it: "n/a (golden ~0)" where the golden is within atol of zero."""
    if sqnr is None and near_zero:
        return "n/a (golden ~0)"
    return "{}{}".format(_g(sqnr), "" if sqnr is None else unit)


class OutputResult(object):
    """One output of one iteration compared against its golden."""

    def __init__(self, iteration: int, name: str, atol: float, rtol: float, stat: str,
                 quantile: float) -> None:
        self.iteration = iteration
        self.name = name
        self.atol = atol
        self.rtol = rtol
        self.stat = stat
        self.quantile = quantile
        self.passed = False
        self.reason = ""  # why it failed before any statistic (e.g. shapes differ)
        self.dtype = ""
        self.shape: Tuple[int, ...] = ()
        self.golden_dtype = ""
        self.golden_shape: Tuple[int, ...] = ()
        self.absdiff: Dict[str, float] = {}
        self.reldiff: Dict[str, float] = {}
        self.required_atol: Optional[float] = None
        self.required_rtol: Optional[float] = None
        self.mismatches = 0  # elements outside tolerance (elemwise)
        self.elements = 0
        self.sqnr_db: Optional[float] = None
        self.golden_near_zero = False  # SQNR not applicable: the golden's RMS <= atol
        self.cosine: Optional[float] = None
        self.out_stats: Dict[str, Any] = {}
        self.golden_stats: Dict[str, Any] = {}
        self.abs_stats: Dict[str, Any] = {}
        self.rel_stats: Dict[str, Any] = {}

    def to_dict(self) -> Dict[str, Any]:
        d: Dict[str, Any] = OrderedDict()
        d["output"] = self.name
        d["iteration"] = self.iteration
        d["passed"] = self.passed
        if self.reason:
            d["reason"] = self.reason
        d["check_error_stat"] = self.stat
        d["atol"] = _num(self.atol)
        d["rtol"] = _num(self.rtol)
        if self.stat == "quantile":
            d["error_quantile"] = self.quantile
        d["required_atol"] = _num(self.required_atol)
        d["required_rtol"] = _num(self.required_rtol)
        d["absdiff"] = {k: _num(v) for k, v in self.absdiff.items()}
        d["reldiff"] = {k: _num(v) for k, v in self.reldiff.items()}
        d["mismatches"] = self.mismatches
        d["elements"] = self.elements
        d["sqnr_db"] = _num(self.sqnr_db)
        if self.golden_near_zero:
            d["golden_near_zero"] = True
        d["cosine"] = _num(self.cosine)
        d["shape"] = list(self.shape)
        d["dtype"] = self.dtype
        return d


class Comparison(object):
    """Every output of every iteration compared; ``passed`` only when all of them pass."""

    def __init__(self, results: List[OutputResult], runner: str = "jetson-agent",
                 reference: str = "golden") -> None:
        self.results = results
        self.runner = runner
        self.reference = reference

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    @property
    def iterations(self) -> int:
        return len({r.iteration for r in self.results})

    def failed_outputs(self) -> List[str]:
        # A dict keeps the order and finds a name in constant time (a list made this
        # quadratic: minutes on a model with tens of thousands of outputs).
        return list(OrderedDict.fromkeys(r.name for r in self.results if not r.passed))

    def summary(self) -> Dict[str, Dict[str, Any]]:
        """Per output, the worst over iterations: what the search logs per evaluation."""
        out: Dict[str, Dict[str, Any]] = OrderedDict()
        for r in self.results:
            s = out.setdefault(r.name, {"passed": True, "required_atol": 0.0,
                                        "required_rtol": 0.0, "sqnr_db": None,
                                        "cosine": None})
            s["passed"] = s["passed"] and r.passed
            for key in ("required_atol", "required_rtol"):
                v = getattr(r, key)
                s[key] = _worse_high(s[key], v)
            s["sqnr_db"] = _worse_low(s["sqnr_db"], r.sqnr_db)
            if r.golden_near_zero:
                s["golden_near_zero"] = True
            s["cosine"] = _worse_low(s["cosine"], r.cosine)
        return out

    def to_dict(self) -> Dict[str, Any]:
        return {
            "passed": self.passed,
            "iterations": self.iterations,
            "failed_outputs": self.failed_outputs(),
            "outputs": {name: {k: _num(v) if isinstance(v, float) else v for k, v in s.items()}
                        for name, s in self.summary().items()},
            "results": [r.to_dict() for r in self.results],
        }

    def format_report(self) -> str:
        return format_report(self)


def _worse_high(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:
        return None
    if math.isnan(a) or math.isnan(b):
        return float("nan")
    return max(a, b)


def _worse_low(a: Optional[float], b: Optional[float]) -> Optional[float]:
    if a is None or b is None:  # not applicable (a golden of about 0) says nothing
        return b if a is None else a
    if math.isnan(a) or math.isnan(b):
        return float("nan")
    return min(a, b)


# ---------------------------------------------------------------------------------------------
# Polygraphy-style text report


def _stats_line(label: str, s: Dict[str, Any]) -> str:
    return ("{} | Stats: mean={}, std-dev={}, var={}, median={}, min={} at {}, max={} at {}, "
            "avg-magnitude={}".format(label, _g(s.get("mean")), _g(s.get("std_dev")),
                                      _g(s.get("var")), _g(s.get("median")), _g(s.get("min")),
                                      tuple(s.get("argmin", ())), _g(s.get("max")),
                                      tuple(s.get("argmax", ())), _g(s.get("avg_magnitude"))))


def format_report(cmp: Comparison) -> str:
    """The comparison as ``polygraphy run`` prints it, plus SQNR and cosine similarity."""
    lines: List[str] = []
    add = lines.append
    add("[I] Accuracy Comparison | {} vs. {}".format(cmp.runner, cmp.reference))
    by_iter: Dict[int, List[OutputResult]] = OrderedDict()
    for r in cmp.results:
        by_iter.setdefault(r.iteration, []).append(r)
    many = len(by_iter) > 1
    for it, results in by_iter.items():
        pad = "    "
        if many:
            add("[I]     Iteration: {}".format(it))
            pad = "        "
        for r in results:
            add("[I] {}Comparing Output: '{}' (dtype={}, shape={}) with '{}' (dtype={}, "
                "shape={})".format(pad, r.name, r.dtype, r.shape, r.name, r.golden_dtype,
                                   r.golden_shape))
            p2 = pad + "    "
            add("[I] {}Tolerance: [abs={:.5g}, rel={:.5g}] | Checking {} error".format(
                p2, r.atol, r.rtol, r.stat))
            if r.reason:
                add("[E] {}FAILED | Output: '{}' | {}".format(p2, r.name, r.reason))
                continue
            if r.out_stats:  # computed when asked for (compare_outputs(describe=True))
                add("[I] {}{}".format(p2, _stats_line("{}: {}".format(cmp.runner, r.name),
                                                      r.out_stats)))
                add("[I] {}{}".format(p2, _stats_line("{}: {}".format(cmp.reference, r.name),
                                                      r.golden_stats)))
            add("[I] {}Error Metrics: {}".format(p2, r.name))
            p3 = p2 + "    "
            msg = "Minimum Required Tolerance: {} error | [abs={}] OR [rel={}]".format(
                r.stat, _g(r.required_atol), _g(r.required_rtol))
            if r.stat == "elemwise":
                msg += " (requirements may be lower if both abs/rel tolerances are set)"
            add("[I] {}{}".format(p3, msg))
            if r.abs_stats:
                add("[I] {}{}".format(p3, _stats_line("Absolute Difference", r.abs_stats)))
                add("[I] {}{}".format(p3, _stats_line("Relative Difference", r.rel_stats)))
            add("[I] {}SQNR: {} | Cosine Similarity: {}{}".format(
                p3, sqnr_text(r.sqnr_db, r.golden_near_zero, " dB"), _g(r.cosine),
                " | Mismatched elements: {}/{}".format(r.mismatches, r.elements)
                if r.mismatches else ""))
            if r.passed:
                add("[I] {}PASSED | Output: '{}' | Difference is within tolerance (rel={}, "
                    "abs={})".format(p2, r.name, r.rtol, r.atol))
            else:
                add("[E] {}FAILED | Output: '{}' | Difference exceeds tolerance (rel={}, "
                    "abs={})".format(p2, r.name, r.rtol, r.atol))
        failed = [r.name for r in results if not r.passed]
        if failed:
            add("[E] {}FAILED | Mismatched outputs: {}".format(pad, failed))
        else:
            add("[I] {}PASSED | All outputs matched | Outputs: {}".format(
                pad, [r.name for r in results]))
    total = len(by_iter)
    passed = sum(1 for results in by_iter.values() if all(r.passed for r in results))
    rate = 100.0 * passed / total if total else 100.0
    tag = "[I]" if passed == total else "[E]"
    add("{} Accuracy Summary | {} vs. {} | Passed: {}/{} iterations | Pass Rate: {}%".format(
        tag, cmp.runner, cmp.reference, passed, total, rate))
    add("{} {}".format(tag, "PASSED" if cmp.passed else "FAILED"))
    return "\n".join(lines)
