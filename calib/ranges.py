"""Activation ranges (amax per tensor) for each calibration algorithm: pure numpy, streaming.

``RangeCollector.update(name, batch)`` is called once per tensor per calibration batch; memory
is one histogram of ``num_bins`` counts per tensor, whatever the number of samples.

- ``minmax``: amax = max |x| over every batch (TensorRT's MinMaxCalibration).
- ``entropy2`` (and ``entropy``): TensorRT's KL-divergence threshold search on the |x|
  histogram: for each candidate threshold bin i >= 128, P = the first i bins with the outliers
  folded into the last one, Q = those i bins quantized to 128 levels and expanded back; amax is
  the right edge of the candidate with the smallest KL(P || Q) (the last one on ties). Bin 0
  takes the count of bin 1 so the zeros a ReLU produces do not dominate (as NVIDIA's
  pytorch-quantization does), and empty bins get a little mass before the divergence (as MXNet
  and ONNX Runtime do), so a candidate whose last bin is empty but collects the clipped
  outliers is not ruled out by an infinite divergence.
- ``percentile``: amax = the given percentile (default 99.99) of |x|, read off the histogram.
- ``legacy``: a simplification of TensorRT's legacy calibrator (which fits a regression to
  the histogram tail): amax = max(quantile of |x|, regression_cutoff * max |x|) with
  quantile 0.9999 and cutoff 0.5 by default.

Histogram range growth: the first batch fixes the range [0, max |x|]; when a later batch holds
a larger value, the range doubles as often as needed and the old counts are merged into the
wider bins exactly (2^k old bins -> 1 new bin), so the bin count never grows.

Worker side: Python >= 3.6.
"""

import math
from typing import Dict, List, Optional

import numpy as np

from agent.errors import AgentError

ALGORITHMS = ("entropy2", "entropy", "minmax", "percentile", "legacy")
QUANT_LEVELS = 128  # int8: 127 positive levels plus zero
SMOOTHING_EPS = 1e-4  # counts moved into empty bins before the divergence (as MXNet / ORT)
SERIES_TERMS = 14  # terms of the (h - t) log(h - t) series in entropy_threshold


class AbsHistogram(object):
    """A histogram of |x| over [0, top] with a fixed number of bins, grown by exact merging."""

    def __init__(self, num_bins: int) -> None:
        self.num_bins = int(num_bins)
        self.counts = np.zeros(self.num_bins, dtype=np.int64)
        self.top = 0.0  # right edge of the last bin; 0 while every value seen was 0
        self.zeros = 0  # values seen while top == 0
        self.max = 0.0

    def add(self, absx: np.ndarray) -> None:
        if absx.size == 0:
            return
        batch_max = float(absx.max())
        self.max = max(self.max, batch_max)
        if batch_max == 0.0:
            if self.top == 0.0:
                self.zeros += int(absx.size)
            else:
                self.counts[0] += int(absx.size)
            return
        if self.top == 0.0:
            self.top = batch_max
            self.counts[0] += self.zeros
            self.zeros = 0
        elif batch_max > self.top:
            factor = 2 ** int(math.ceil(math.log2(batch_max / self.top)))
            while self.top * factor < batch_max:  # guard against rounding in log2
                factor *= 2
            merged = np.bincount(np.arange(self.num_bins) // factor, weights=self.counts,
                                 minlength=self.num_bins)
            self.counts = np.rint(merged[:self.num_bins]).astype(np.int64)
            self.top *= factor
        index = (absx * (self.num_bins / self.top)).astype(np.int64)
        np.minimum(index, self.num_bins - 1, out=index)
        self.counts += np.bincount(index.ravel(), minlength=self.num_bins)

    @property
    def bin_width(self) -> float:
        return self.top / self.num_bins

    def total(self) -> int:
        return int(self.counts.sum()) + self.zeros

    def quantile(self, q: float) -> float:
        """The value below which a fraction ``q`` of |x| lies (right edge of its bin)."""
        if self.top == 0.0:
            return 0.0
        cum = np.cumsum(self.counts)
        index = int(np.searchsorted(cum, q * cum[-1], side="left"))
        return min(index + 1, self.num_bins) * self.bin_width


def _smooth(counts: np.ndarray, eps: float = SMOOTHING_EPS) -> np.ndarray:
    """Move ``eps`` of mass into every empty bin, taken evenly from the others."""
    zeros = counts == 0
    n_zeros = int(zeros.sum())
    if n_zeros == 0 or n_zeros == counts.size:
        return counts
    take = eps * n_zeros / (counts.size - n_zeros)
    return np.where(zeros, eps, counts - take)


def entropy_threshold(counts: np.ndarray, start_bin: int = QUANT_LEVELS) -> int:
    """The number of bins to keep (the threshold bin index) that minimizes KL(P || Q).

    Every candidate at once, from prefix sums: P's and Q's smoothed bins split into the
    empty bins (a closed form), the last bin (which takes the outliers), and the nonzero bins
    before it, whose sum of (h - t) log(h - t) (t: the smoothing taken from each bin) is the
    series h log h - t (log h + 1) + sum_k t^k / (k (k-1) h^(k-1)) (t/h <= 0.21 here, so
    SERIES_TERMS terms leave ~1e-12 of relative error). The same threshold as
    ``entropy_threshold_reference`` (ties within 1e-9 count as ties, the last one wins), in
    about a tenth of the time: the ~900 tensors of a real network took minutes."""
    hist = counts.astype(np.float64)
    n = len(hist)
    if n <= start_bin:
        return n
    hist[0] = hist[1]
    eps = SMOOTHING_EPS
    T = float(hist.sum())
    suffix = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])
    nz = hist > 0
    h = np.where(nz, hist, 1.0)

    def pre(x):
        return np.concatenate([[0.0], np.cumsum(np.where(nz, x, 0.0))])
    C1 = pre(hist)
    Cn = pre(np.ones(n))
    Chl = pre(h * np.log(h))
    Clog1 = pre(np.log(h) + 1.0)
    Ck = [pre(h ** (1 - k)) for k in range(2, SERIES_TERMS + 1)]
    i = np.arange(start_bin, n + 1)            # candidates
    m = i - 1                                  # bins before the last one
    Z = m - Cn[m]                              # zero bins among them
    h_last = hist[i - 1]
    p_last = h_last + suffix[i]
    n0p = Z + (p_last == 0)
    n0q = Z + (h_last == 0)
    tp = np.where((n0p > 0) & (n0p < i), eps * n0p / np.maximum(i - n0p, 1), 0.0)
    tq = np.where((n0q > 0) & (n0q < i), eps * n0q / np.maximum(i - n0q, 1), 0.0)
    Sq = C1[i]
    # sum over nonzero bins j < i-1 of (h - tp) log(h - tp), by its series in tp / h
    A = Chl[m] - tp * Clog1[m]
    for k in range(2, SERIES_TERMS + 1):
        A = A + tp ** k / (k * (k - 1)) * Ck[k - 2][m]
    Pn = C1[m] - tp * Cn[m]
    # groups: bins j with j*128//i == g span [ceil(g*i/128), ceil((g+1)*i/128))
    g = np.arange(QUANT_LEVELS + 1)[None, :]
    edges = (g * i[:, None] + QUANT_LEVELS - 1) // QUANT_LEVELS
    gsum = np.diff(C1[edges], axis=1)
    gcnt = np.diff(Cn[edges], axis=1)
    qg = gsum / np.maximum(gcnt, 1)
    # P's nonzero bins before the last one: the last bin only ever sits in the last group.
    pc = gcnt.copy()
    pc[:, -1] -= nz[i - 1]
    Pg = gsum - tp[:, None] * pc
    Pg[:, -1] -= hist[i - 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        logq = np.where(pc > 0, np.log(np.where(pc > 0, qg - tq[:, None], 1.0)), 0.0)
        main = (A + (np.log(Sq) - np.log(T)) * Pn - (logq * Pg).sum(axis=1)) / T
        zeros = Z * (eps / T) * np.log(Sq / T)
        pl = np.where(p_last > 0, p_last - tp, eps)
        ql = np.where(h_last > 0, qg[:, -1] - tq, eps)
        last = (pl / T) * np.log((pl / T) / (ql / Sq))
        kl = main + zeros + last
    kl = np.where(Sq > 0, kl, np.inf)
    kl = np.where(np.isnan(kl), np.inf, kl)
    best = float(np.min(kl))
    if not np.isfinite(best):
        return n
    tol = 1e-12 + 1e-9 * abs(best)  # rounding of the closed form, not a real difference
    return int(i[np.nonzero(kl <= best + tol)[0][-1]])


def entropy_threshold_reference(counts: np.ndarray, start_bin: int = QUANT_LEVELS) -> int:
    """``entropy_threshold`` one candidate at a time, as written in the algorithm (O(bins^2)
    numpy calls: the tests hold the fast form to it)."""
    hist = counts.astype(np.float64)
    n = len(hist)
    if n <= start_bin:
        return n
    hist[0] = hist[1]
    suffix = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])  # suffix[i] = sum(hist[i:])
    best_i, best_kl = n, np.inf
    for i in range(start_bin, n + 1):
        p = hist[:i].copy()
        p[i - 1] += suffix[i]
        group = (np.arange(i) * QUANT_LEVELS) // i
        nonzero = hist[:i] != 0
        sums = np.bincount(group, weights=hist[:i], minlength=QUANT_LEVELS)
        used = np.bincount(group, weights=nonzero, minlength=QUANT_LEVELS)
        q = np.where(nonzero, sums[group] / np.maximum(used[group], 1), 0.0)
        if not q.any():
            continue
        p, q = _smooth(p), _smooth(q)
        p /= p.sum()
        q /= q.sum()
        mask = p > 0
        kl = float(np.sum(p[mask] * np.log(p[mask] / q[mask])))
        if kl <= best_kl:
            best_i, best_kl = i, kl
    return best_i


class RangeCollector(object):
    """Collects amax per tensor over a stream of batches for one algorithm."""

    def __init__(self, algorithm: str, num_bins: int = 2048, percentile: float = 99.99,
                 quantile: float = 0.9999, regression_cutoff: float = 0.5) -> None:
        if algorithm not in ALGORITHMS:
            raise AgentError("bad_argument",
                             "calibration algorithm must be one of {}, found {!r}".format(
                                 ", ".join(ALGORITHMS), algorithm))
        if num_bins < 2 * QUANT_LEVELS:
            raise AgentError("bad_argument",
                             "num_bins must be >= {}, found {}".format(2 * QUANT_LEVELS,
                                                                       num_bins))
        if not 0 < percentile <= 100:
            raise AgentError("bad_argument",
                             "percentile must be in (0, 100], found {}".format(percentile))
        self.algorithm = algorithm
        self.num_bins = int(num_bins)
        self.percentile = float(percentile)
        self.quantile = float(quantile)
        self.regression_cutoff = float(regression_cutoff)
        self._max: Dict[str, float] = {}
        self._hist: Dict[str, AbsHistogram] = {}
        self._order: List[str] = []

    def update(self, name: str, array: np.ndarray) -> None:
        """Add one batch of tensor ``name``; non-finite values are ignored."""
        absx = np.abs(np.asarray(array, dtype=np.float32)).ravel()
        if absx.size and not np.all(np.isfinite(absx)):
            absx = absx[np.isfinite(absx)]
        if name not in self._max:
            self._order.append(name)
            self._max[name] = 0.0
        if absx.size:
            self._max[name] = max(self._max[name], float(absx.max()))
        if self.algorithm != "minmax":
            hist = self._hist.get(name)
            if hist is None:
                hist = self._hist[name] = AbsHistogram(self.num_bins)
            hist.add(absx)

    def names(self) -> List[str]:
        return list(self._order)

    def amax_of(self, name: str) -> float:
        if self.algorithm == "minmax":
            return self._max[name]
        hist = self._hist[name]
        if hist.top == 0.0:
            return 0.0
        if self.algorithm in ("entropy2", "entropy"):
            return min(entropy_threshold(hist.counts) * hist.bin_width, hist.max)
        if self.algorithm == "percentile":
            return min(hist.quantile(self.percentile / 100.0), hist.max)
        # legacy (simplified): never clip below regression_cutoff * max
        return min(max(hist.quantile(self.quantile), self.regression_cutoff * hist.max),
                   hist.max)

    def amax(self, names: Optional[List[str]] = None) -> Dict[str, float]:
        """Tensor name -> amax (0.0 for a tensor that was always 0)."""
        return {name: float(self.amax_of(name)) for name in (names or self._order)}
