"""Accuracy metrics of an output against its golden (pure numpy, worker side: Python 3.6).

Polygraphy's error statistics (its ``compute_*`` helpers: max/min/mean/median/quantile, and the
summary it prints per buffer) and the metrics beyond Polygraphy: SQNR (dB), cosine similarity,
top-1 agreement. Numbers only: ``compare`` decides pass/fail from them, and the worker's
classifier check uses ``top1_agreement`` without a comparison.
"""

import math
from typing import Any, Dict, Optional, Tuple

import numpy as np

from agent.errors import AgentError


def error_stats(buf: np.ndarray, q: float) -> Dict[str, float]:
    """Polygraphy's compute_* helpers on a difference buffer: max, mean, median and the ``q``
    quantile (numpy's linear one), 0 when empty, NaN when any element is. One partition at
    the few ranks they need instead of four reductions: a gate or a search over thousands of
    small outputs paid numpy's per-call cost four times an output, and a full sort would cost
    more than that on a large one. With infinities it is exact where numpy's interpolation
    gives inf * 0 = NaN."""
    if buf.size == 0:
        return {"max": 0.0, "mean": 0.0, "median": 0.0, "quantile": 0.0}
    flat = buf.ravel().astype(np.float64)
    with np.errstate(all="ignore"):
        mean = float(np.mean(flat))
    last = flat.size - 1
    ranks = sorted(set([last] + [r for p in (0.5, q) for r in _ranks(p, last)]))
    ordered = np.partition(flat, ranks)  # NaNs go last, as in a sort
    if math.isnan(ordered[last]):  # every statistic is NaN, as numpy's are
        nan = float("nan")
        return {"max": nan, "mean": nan, "median": nan, "quantile": nan}
    return {"max": float(ordered[last]), "mean": mean,
            "median": _linear_quantile(ordered, 0.5), "quantile": _linear_quantile(ordered, q)}


def _ranks(q: float, last: int) -> Tuple[int, int]:
    lo = int(math.floor(q * last))
    return lo, min(lo + 1, last)


def _linear_quantile(ordered: np.ndarray, q: float) -> float:
    """numpy's default ("linear") quantile, from a buffer ordered at ``_ranks(q)``."""
    index = q * (ordered.size - 1)
    lo, hi = _ranks(q, ordered.size - 1)
    a, b = float(ordered[lo]), float(ordered[hi])
    if a == b or index == lo:  # also keeps inf out of inf - inf and inf * 0
        return a
    return a + (b - a) * (index - lo)


def summary(buf: np.ndarray) -> Dict[str, Any]:
    """mean/std-dev/var/median/min/max/avg-magnitude, as Polygraphy prints them."""
    if buf.size == 0:
        return {"mean": 0.0, "std_dev": 0.0, "var": 0.0, "median": 0.0, "min": 0.0, "max": 0.0,
                "argmin": [], "argmax": [], "avg_magnitude": 0.0}
    x = buf.astype(np.float64) if buf.dtype == np.bool_ else buf
    with np.errstate(all="ignore"):
        var = np.var(x)  # np.std is its square root, in the same dtype: computed once
        return {
            "mean": float(np.mean(x)),
            "std_dev": float(np.sqrt(var)),
            "var": float(var),
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


def sqnr_db(out: np.ndarray, golden: np.ndarray, zero_rms: float = SQNR_MIN_RMS
            ) -> Optional[float]:
    """Signal-to-quantization-noise ratio in dB: 10 log10(sum golden^2 / sum (out-golden)^2).
    +inf when identical; NaN when either side holds non-finite values; None (not applicable)
    when the golden is about zero: its RMS at most ``zero_rms`` (the comparison passes the
    absolute tolerance: a golden within it of zero has no signal to measure noise against)
    or SQNR_MIN_RMS."""
    g = np.asarray(golden, dtype=np.float64)
    o = np.asarray(out, dtype=np.float64)
    with np.errstate(all="ignore"):
        noise = float(np.sum((o - g) ** 2))
        signal = float(np.sum(g ** 2))
    if math.isnan(noise) or math.isinf(noise) or math.isinf(signal) or math.isnan(signal):
        return float("nan")
    if noise == 0.0:
        return float("inf")
    if signal <= g.size * max(zero_rms, SQNR_MIN_RMS) ** 2:
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
