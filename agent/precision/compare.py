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

Beyond Polygraphy: SQNR (dB) and cosine similarity per output and the minimum tolerances that
would have passed. This module parses the tolerances and decides pass/fail; the statistics are
``metrics``, the results and their report ``comparison``. Worker side: Python 3.6.
"""

import math
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from agent.errors import AgentError
from agent.precision.comparison import Comparison, OutputResult
from agent.precision.metrics import cosine_similarity, error_stats, sqnr_db, summary

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
    known = set(names)
    for key, v in items:
        if key and key not in known:
            raise AgentError("bad_argument", "{} names output {!r}, which the goldens do not "
                             "hold; expected one of {}".format(what, key, ", ".join(names)))
        if v is not None:
            check(v, what)


# ---------------------------------------------------------------------------------------------
# the comparison


def _cast_up(a: np.ndarray) -> np.ndarray:
    """Polygraphy compares float16 in float32; integers are widened so differences cannot wrap."""
    if a.dtype == np.float16:
        return a.astype(np.float32)
    if np.issubdtype(a.dtype, np.integer):
        return a.astype(np.float64)
    return a


def compare_arrays(out: np.ndarray, golden: np.ndarray, atol: float = DEFAULT_ATOL,
                   rtol: float = DEFAULT_RTOL, check_error_stat: str = DEFAULT_STAT,
                   error_quantile: float = DEFAULT_QUANTILE,
                   infinities_compare_equal: bool = False, name: str = "output",
                   iteration: int = 0, describe: bool = False) -> OutputResult:
    """Compare one output with its golden (check_outputs_match in Polygraphy).

    ``describe`` adds the four summaries only Polygraphy's text report prints (output, golden,
    both differences): each is nine reductions, the cost that dominated a gate or a search
    evaluation over thousands of small outputs. The pass/fail figures are the same either way."""
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

    res.absdiff.update(error_stats(absdiff, error_quantile))
    res.reldiff.update(error_stats(reldiff, error_quantile))
    if describe:
        res.abs_stats = summary(absdiff)
        res.rel_stats = summary(reldiff)

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
    if out.dtype != np.bool_:
        # A golden within the absolute tolerance of zero has no signal: its SQNR (-4.7 dB on
        # a passing row) would only measure noise against noise.
        res.sqnr_db = sqnr_db(out, golden, atol if math.isfinite(atol) else 0.0)
        res.golden_near_zero = res.sqnr_db is None
    res.cosine = cosine_similarity(out, golden) if out.dtype != np.bool_ else None
    if describe:
        res.out_stats = summary(out)
        res.golden_stats = summary(golden)
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
    describe: bool = False,
) -> Comparison:
    """Compare outputs (one dict per iteration, or one dict) with the goldens.

    Every golden output must be among ``outputs`` (extra outputs, e.g. marked tensors, are
    ignored); the iteration counts must match. Tolerances are validated first (bad_argument).
    ``describe``: the summaries ``format_report`` prints (see ``compare_arrays``)."""
    outs = _as_iterations(outputs)
    golds = _as_iterations(golden)
    if not golds:
        raise AgentError("golden_mismatch", "the goldens hold no iteration")
    if len(outs) != len(golds):
        raise AgentError("golden_mismatch", "expected {} iteration(s) of outputs to match the "
                         "goldens, found {}".format(len(golds), len(outs)))
    # Every output name once, in order (a dict: models with tens of thousands of outputs).
    names = list(dict.fromkeys(n for g in golds for n in g))
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
                name=name, iteration=it, describe=describe))
    return Comparison(results, runner=runner, reference=reference)
