"""Compare outputs against golden outputs with Polygraphy's semantics (pure numpy).

What users of ``polygraphy run --atol --rtol --check-error-stat`` expect, exactly:

- absdiff = |out - golden| (float16 is cast up to float32 first; bools compare with xor);
  reldiff = absdiff / |golden|, where golden zeros get a tiny epsilon (2.22e-16) added.
- ``elemwise`` (default): fail if any element has absdiff > atol AND reldiff > rtol (NaN counts
  as exceeding). ``max``/``mean``/``median``/``quantile``: pass if stat(absdiff) <= atol OR
  stat(reldiff) <= rtol (a NaN statistic fails).
- Per-output values: ``--atol 1e-5 out0:1e-3`` (the bare value is the default for the rest).
  Defaults: atol = rtol = 1e-5, error quantile 0.99.
- ``--infinities-compare-equal``: matching +-inf values have an absdiff of 0 (else NaN, a fail).

Beyond Polygraphy: SQNR (dB) and cosine similarity per output, the minimum tolerances that would
have passed, and top-1 agreement for classifiers. Worker side: Python 3.6.
"""

import math
from collections import OrderedDict
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from agent.errors import AgentError

ERROR_STATS = ("elemwise", "max", "mean", "median", "quantile")
DEFAULT_ATOL = 1e-5
DEFAULT_RTOL = 1e-5
DEFAULT_QUANTILE = 0.99
DEFAULT_STAT = "elemwise"
# Polygraphy adds this to golden zeros so the relative difference stays finite.
EPSILON = 2.220446049250313e-16

Arrays = Dict[str, np.ndarray]
# A tolerance (or statistic, quantile): one value for every output, or per output name with ""
# as the default for the outputs not named.
PerOutput = Union[Any, Dict[str, Any]]


# ---------------------------------------------------------------------------------------------
# argument parsing (Polygraphy's "--atol 1e-5 out0:1e-3" syntax)


def _split_item(item: str) -> Tuple[str, str]:
    """``name:value`` -> (name, value); a bare value -> ("", value). Names may contain ':', so
    split on the last one."""
    name, sep, value = item.rpartition(":")
    return (name, value) if sep else ("", item)


def parse_per_output(items: Optional[Iterable[str]], what: str,
                     kind: str = "float") -> Dict[str, Any]:
    """Parse ``--atol``-style values into {output name or "": value} (``kind`` float or stat).

    Raises AgentError("bad_argument") for values that cannot be tolerances."""
    out: Dict[str, Any] = {}
    for item in items or []:
        for token in str(item).split():
            name, raw = _split_item(token)
            if kind == "stat":
                out[name] = check_stat(raw, what)
            elif kind == "quantile":
                out[name] = check_quantile(_to_float(raw, what), what)
            else:
                out[name] = check_tolerance(_to_float(raw, what), what)
    return out


def _to_float(raw: str, what: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise AgentError("bad_argument",
                         "{} expects a number or NAME:NUMBER, found {!r}".format(what, raw))


def check_tolerance(value: Any, what: str = "tolerance") -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise AgentError("bad_argument", "{} must be a number >= 0, found {!r}".format(what, value))
    if math.isnan(value) or value < 0:
        raise AgentError("bad_argument", "{} must be a number >= 0, found {}".format(what, value))
    return value


def check_stat(value: Any, what: str = "--check-error-stat") -> str:
    if value not in ERROR_STATS:
        raise AgentError("bad_argument", "{} must be one of {}, found {!r}".format(
            what, ", ".join(ERROR_STATS), value))
    return str(value)


def check_quantile(value: Any, what: str = "--error-quantile") -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise AgentError("bad_argument", "{} must be in [0, 1], found {!r}".format(what, value))
    if not 0.0 <= value <= 1.0:  # also rejects NaN
        raise AgentError("bad_argument", "{} must be in [0, 1], found {}".format(what, value))
    return value


def _per_output(value: PerOutput, name: str, default: Any) -> Any:
    """Polygraphy's value_or_from_dict: a dict is looked up by name, then "", then default."""
    if isinstance(value, dict):
        if name in value:
            return value[name]
        return value.get("", default)
    return default if value is None else value


def _validate_per_output(value: PerOutput, what: str, names: Sequence[str], check: Any) -> None:
    items = value.items() if isinstance(value, dict) else [("", value)]
    for key, v in items:
        if key and key not in names:
            raise AgentError("bad_argument", "{} names output {!r}, which the goldens do not "
                             "hold; expected one of {}".format(what, key, ", ".join(names)))
        if v is not None:
            check(v, what)


# ---------------------------------------------------------------------------------------------
# statistics


def _cast_up(a: np.ndarray) -> np.ndarray:
    """Polygraphy compares float16 in float32; integers are widened so differences cannot wrap."""
    if a.dtype == np.float16:
        return a.astype(np.float32)
    if np.issubdtype(a.dtype, np.integer):
        return a.astype(np.float64)
    return a


def _stat(buf: np.ndarray, which: str, q: float = DEFAULT_QUANTILE) -> float:
    """Polygraphy's compute_* helpers: 0 for empty buffers, NaN propagates."""
    if buf.size == 0:
        return 0.0
    if buf.dtype == np.bool_:
        buf = buf.astype(np.float64)
    with np.errstate(all="ignore"):
        return _stat_of(buf, which, q)


def _stat_of(buf: np.ndarray, which: str, q: float) -> float:
    if which == "max":
        return float(np.amax(buf))
    if which == "min":
        return float(np.amin(buf))
    if which == "mean":
        return float(np.mean(buf))
    if which == "median":
        return float(np.median(buf))
    if which == "quantile":
        return float(np.quantile(buf, q))
    raise ValueError(which)


def _summary(buf: np.ndarray) -> Dict[str, Any]:
    """mean/std-dev/var/median/min/max/avg-magnitude, as Polygraphy prints them."""
    if buf.size == 0:
        return {"mean": 0.0, "std_dev": 0.0, "var": 0.0, "median": 0.0, "min": 0.0, "max": 0.0,
                "argmin": [], "argmax": [], "avg_magnitude": 0.0}
    x = buf.astype(np.float64) if buf.dtype == np.bool_ else buf
    with np.errstate(all="ignore"):
        return {
            "mean": float(np.mean(x)),
            "std_dev": float(np.std(x)),
            "var": float(np.var(x)),
            "median": float(np.median(x)),
            "min": float(np.amin(x)),
            "argmin": [int(i) for i in np.unravel_index(int(np.argmin(x)), x.shape)],
            "max": float(np.amax(x)),
            "argmax": [int(i) for i in np.unravel_index(int(np.argmax(x)), x.shape)],
            "avg_magnitude": float(np.mean(np.abs(x))),
        }


# Below this RMS a golden is zero at float32 resolution (2^-23 of unit-scale values): its
# "signal" is rounding noise and an SQNR of it (-160 dB on a passing row) means nothing.
SQNR_MIN_RMS = 1e-7


def sqnr_db(out: np.ndarray, golden: np.ndarray) -> Optional[float]:
    """Signal-to-quantization-noise ratio in dB: 10 log10(sum golden^2 / sum (out-golden)^2).
    +inf when identical; NaN when either side holds non-finite values; None (not applicable)
    when the golden is about zero (RMS below SQNR_MIN_RMS)."""
    g = np.asarray(golden, dtype=np.float64)
    o = np.asarray(out, dtype=np.float64)
    with np.errstate(all="ignore"):
        noise = float(np.sum((o - g) ** 2))
        signal = float(np.sum(g ** 2))
    if math.isnan(noise) or math.isinf(noise) or math.isinf(signal) or math.isnan(signal):
        return float("nan")
    if noise == 0.0:
        return float("inf")
    if signal <= g.size * SQNR_MIN_RMS ** 2:
        return None
    return 10.0 * math.log10(signal / noise)


def cosine_similarity(out: np.ndarray, golden: np.ndarray) -> float:
    """Cosine of the angle between the flattened arrays (1.0 when both are all zeros)."""
    g = np.asarray(golden, dtype=np.float64).ravel()
    o = np.asarray(out, dtype=np.float64).ravel()
    with np.errstate(all="ignore"):
        ng, no = float(np.linalg.norm(g)), float(np.linalg.norm(o))
        if ng == 0.0 and no == 0.0:
            return 1.0
        if ng == 0.0 or no == 0.0:
            return 0.0
        return float(np.dot(g, o) / (ng * no))


def top1_agreement(out: np.ndarray, golden: np.ndarray, axis: int = -1) -> float:
    """Fraction of rows whose argmax (the predicted class) agrees with the golden's."""
    o = np.asarray(out)
    g = np.asarray(golden)
    if o.shape != g.shape:
        raise AgentError("golden_mismatch", "top-1 agreement needs equal shapes, found {} vs "
                         "golden {}".format(o.shape, g.shape))
    if o.size == 0:
        return 1.0
    return float(np.mean(np.argmax(o, axis=axis) == np.argmax(g, axis=axis)))


def _num(x: Optional[float]) -> Optional[float]:
    """JSON-safe number: non-finite values (NaN error, SQNR of identical outputs) become
    null, so consumers can compare what they read; the text report shows them."""
    if x is None or math.isnan(x) or math.isinf(x):
        return None
    return float(x)


def _g(x: Optional[float]) -> str:
    return "n/a" if x is None else "{:.5g}".format(x)


# ---------------------------------------------------------------------------------------------
# results


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
        seen: List[str] = []
        for r in self.results:
            if not r.passed and r.name not in seen:
                seen.append(r.name)
        return seen

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
# the comparison


def compare_arrays(out: np.ndarray, golden: np.ndarray, atol: float = DEFAULT_ATOL,
                   rtol: float = DEFAULT_RTOL, check_error_stat: str = DEFAULT_STAT,
                   error_quantile: float = DEFAULT_QUANTILE,
                   infinities_compare_equal: bool = False, name: str = "output",
                   iteration: int = 0) -> OutputResult:
    """Compare one output with its golden (check_outputs_match in Polygraphy)."""
    res = OutputResult(iteration, name, atol, rtol, check_error_stat, error_quantile)
    out = np.asarray(out)
    golden = np.asarray(golden)
    res.dtype, res.shape = str(out.dtype), tuple(out.shape)
    res.golden_dtype, res.golden_shape = str(golden.dtype), tuple(golden.shape)
    res.elements = int(golden.size)
    if out.shape != golden.shape:
        res.reason = "will not compare outputs of different shapes: {} vs golden {}".format(
            out.shape, golden.shape)
        res.mismatches = res.elements
        return res

    if out.dtype == np.bool_ and golden.dtype == np.bool_:
        absdiff = np.logical_xor(out, golden)
        g = golden.astype(np.float64)
    else:
        o, g = _cast_up(out), _cast_up(golden)
        with np.errstate(all="ignore"):
            absdiff = np.abs(o - g)
        if infinities_compare_equal:
            absdiff = np.where(np.isinf(o) & (o == g), 0, absdiff)
    g_eps = np.array(g, copy=True)
    if np.issubdtype(g_eps.dtype, np.floating):
        g_eps[g_eps == 0] += EPSILON
    with np.errstate(all="ignore"):
        reldiff = np.divide(absdiff, np.abs(g_eps))

    q = error_quantile
    for which in ("max", "mean", "median"):
        res.absdiff[which] = _stat(absdiff, which)
        res.reldiff[which] = _stat(reldiff, which)
    res.absdiff["quantile"] = _stat(absdiff, "quantile", q)
    res.reldiff["quantile"] = _stat(reldiff, "quantile", q)

    def stat_failed(diff: float, tol: float) -> bool:
        return math.isnan(diff) or diff > tol

    if check_error_stat == "elemwise":
        with np.errstate(invalid="ignore"):
            bad = ((np.greater(absdiff, atol) | np.isnan(absdiff))
                   & (np.greater(reldiff, rtol) | np.isnan(reldiff)))
        res.mismatches = int(np.count_nonzero(bad))
        failed = res.mismatches > 0
        key = "max"
    else:
        key = check_error_stat
        failed = stat_failed(res.absdiff[key], atol) and stat_failed(res.reldiff[key], rtol)
        with np.errstate(invalid="ignore"):
            res.mismatches = int(np.count_nonzero(
                (np.greater(absdiff, atol) | np.isnan(absdiff))
                & (np.greater(reldiff, rtol) | np.isnan(reldiff))))
    res.passed = not failed
    res.required_atol = res.absdiff[key]
    res.required_rtol = res.reldiff[key]
    res.sqnr_db = sqnr_db(out, golden) if out.dtype != np.bool_ else None
    res.cosine = cosine_similarity(out, golden) if out.dtype != np.bool_ else None
    res.out_stats = _summary(out)
    res.golden_stats = _summary(golden)
    res.abs_stats = _summary(absdiff)
    res.rel_stats = _summary(reldiff)
    return res


def _as_iterations(x: Union[Arrays, Sequence[Arrays]]) -> List[Arrays]:
    if isinstance(x, dict):
        return [x]
    return list(x)


def compare_outputs(
    outputs: Union[Arrays, Sequence[Arrays]],
    golden: Union[Arrays, Sequence[Arrays]],
    atol: PerOutput = None,
    rtol: PerOutput = None,
    check_error_stat: PerOutput = None,
    error_quantile: PerOutput = None,
    infinities_compare_equal: bool = False,
    runner: str = "jetson-agent",
    reference: str = "golden",
) -> Comparison:
    """Compare outputs (one dict per iteration, or one dict) with the goldens.

    Every golden output must be among ``outputs`` (extra outputs, e.g. marked tensors, are
    ignored); the iteration counts must match. Tolerances are validated first (bad_argument)."""
    outs = _as_iterations(outputs)
    golds = _as_iterations(golden)
    if not golds:
        raise AgentError("golden_mismatch", "the goldens hold no iteration")
    if len(outs) != len(golds):
        raise AgentError("golden_mismatch", "expected {} iteration(s) of outputs to match the "
                         "goldens, found {}".format(len(golds), len(outs)))
    names: List[str] = []
    for g in golds:
        for n in g:
            if n not in names:
                names.append(n)
    _validate_per_output(atol, "--atol", names, check_tolerance)
    _validate_per_output(rtol, "--rtol", names, check_tolerance)
    _validate_per_output(check_error_stat, "--check-error-stat", names, check_stat)
    _validate_per_output(error_quantile, "--error-quantile", names, check_quantile)

    results: List[OutputResult] = []
    for it, (o, g) in enumerate(zip(outs, golds)):
        missing = [n for n in g if n not in o]
        if missing:
            raise AgentError("golden_mismatch", "the goldens hold output(s) {} that the model "
                             "does not produce; it produces {}".format(missing, sorted(o)))
        for name, gold in g.items():
            results.append(compare_arrays(
                o[name], gold,
                atol=float(_per_output(atol, name, DEFAULT_ATOL)),
                rtol=float(_per_output(rtol, name, DEFAULT_RTOL)),
                check_error_stat=str(_per_output(check_error_stat, name, DEFAULT_STAT)),
                error_quantile=float(_per_output(error_quantile, name, DEFAULT_QUANTILE)),
                infinities_compare_equal=infinities_compare_equal,
                name=name, iteration=it))
    return Comparison(results, runner=runner, reference=reference)


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
            add("[I] {}{}".format(p3, _stats_line("Absolute Difference", r.abs_stats)))
            add("[I] {}{}".format(p3, _stats_line("Relative Difference", r.rel_stats)))
            add("[I] {}SQNR: {} dB | Cosine Similarity: {}{}".format(
                p3, _g(r.sqnr_db), _g(r.cosine),
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
