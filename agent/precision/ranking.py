"""Layer ranking for precision searches: how much error each layer introduces.

From the tensors of two instrumented runs of the same inputs (every float tensor marked as an
output; one run with every candidate kept in higher precision, one as the plan asks), each
layer gets a score from its input and output tensors, worst first (``rank_errors``): values
past the fp16 range, inf/NaN it introduced, and the growth of the normalized error from its
inputs to its outputs. ``merge_stats`` keeps one small tuple per tensor, the worst over the
input iterations; the reference run keeps a fixed sample of each tensor, so ranking never holds
more than one run's tensors.
``agent.precision.strategies`` order their tests by this ranking. ``instrumented_ranking`` runs
the two instrumented engines it is given (backends and plans come in as arguments: importing this
module pulls in no backend), and rankings are cached as JSON keyed by ``ranking_key``.

Worker side: Python 3.6.
"""

import hashlib
import json
import logging
import math
import os
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from agent.fsio import atomic_write
from agent.heap import trim_heap

log = logging.getLogger(__name__)
Feed = Dict[str, np.ndarray]
# Instrumented runs read this many input iterations (one at a time).
INSTRUMENT_ITERATIONS = 4
# Bump when the ranking's statistics change: cached rankings are keyed by it.
RANKING_VERSION = "3"

FP16_MAX = 65504.0
# Relative error every layer of a precision introduces just by rounding (half an fp16 ulp,
# about half an int8 step of a well-used range): growth is measured above this floor, so a
# layer that merely rounds exact inputs does not look like one that loses accuracy.
ERROR_FLOOR = {"fp16": 2.0 ** -11, "int8": 2.0 ** -8, "best": 2.0 ** -8, "fp32": 1e-7}
Stats = Tuple[float, float, float, float]


class LayerScore(object):
    """How much error one layer introduces, from the reference and reduced-precision values of
    its input and output tensors."""

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.index = index  # topological position
        self.in_error = 0.0  # worst normalized error of the float inputs
        self.out_error = 0.0  # worst normalized error of the outputs
        self.median_growth = 0.0  # log10 growth of the median-normalized error
        self.growth = 0.0  # log10 growth of the quantile-normalized error
        self.nonfinite = 0.0  # fraction of outputs that became inf/NaN here (not before)
        self.out_of_range = 0.0  # fraction of reference values beyond the low precision's range
        self.score = 0.0

    def to_dict(self) -> Dict[str, Any]:
        return OrderedDict([
            ("layer", self.name), ("score", _r(self.score)), ("growth_log10", _r(self.growth)),
            ("median_growth_log10", _r(self.median_growth)), ("in_error", _r(self.in_error)),
            ("out_error", _r(self.out_error)), ("nonfinite_introduced", _r(self.nonfinite)),
            ("out_of_range", _r(self.out_of_range)),
        ])


def _r(x: float) -> Optional[float]:
    """JSON-safe, short: null when not finite."""
    if math.isnan(x) or math.isinf(x):
        return None
    return float("{:.6g}".format(x))


def _flat(values: Union[np.ndarray, Sequence[np.ndarray]]) -> np.ndarray:
    if isinstance(values, np.ndarray):
        return values.astype(np.float64, copy=False).ravel()
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in values])


def tensor_error(reference: np.ndarray, reduced: np.ndarray,
                 quantile: float = 0.99) -> Tuple[float, float, float]:
    """(quantile-normalized error, median-normalized error, non-finite fraction) of a tensor.

    Normalized: the q-quantile of |reduced - reference| over the q-quantile of |reference|, so
    scaling a tensor does not count as error. Elements that are non-finite only in the reduced
    run are counted apart (their difference is not a number)."""
    r = _flat(reference)
    a = _flat(reduced)
    if r.size == 0 or r.shape != a.shape:
        return 0.0, 0.0, 0.0
    finite_ref = np.isfinite(r)
    bad = finite_ref & ~np.isfinite(a)
    nonfinite = float(np.count_nonzero(bad)) / r.size
    ok = finite_ref & np.isfinite(a)
    if not np.any(ok):
        return 0.0, 0.0, nonfinite
    d = np.abs(a[ok] - r[ok])
    mag = np.abs(r[ok])
    qerr = float(np.quantile(d, quantile)) / (float(np.quantile(mag, quantile)) + 1e-30)
    merr = float(np.median(d)) / (float(np.median(mag)) + 1e-30)
    return qerr, merr, nonfinite


def _growth(out_err: float, in_err: float, floor: float) -> float:
    return math.log10((out_err + floor) / (in_err + floor))


def merge_stats(into: Dict[str, Tuple[float, float, float, float]], name: str,
                stats: Tuple[float, float, float, float]) -> None:
    """Keep the worst of each statistic over the iterations seen (bounded memory)."""
    old = into.get(name)
    into[name] = stats if old is None else (max(old[0], stats[0]), max(old[1], stats[1]),
                                            max(old[2], stats[2]), max(old[3], stats[3]))


def rank_layers(
    layers: Sequence[Tuple[str, Sequence[str], Sequence[str]]],
    reference: Dict[str, Any],
    reduced: Dict[str, Any],
    precision: str = "fp16",
    quantile: float = 0.99,
) -> List[LayerScore]:
    """Rank layers worst first by the error each introduces (``rank_errors``), from the
    tensors of the full-precision (``reference``) and reduced-precision runs: tensor name ->
    values (an array, or one array per iteration)."""
    stats: Dict[str, Tuple[float, float, float, float]] = {}
    for name in reference:
        if name in reduced:
            q, m, nf = tensor_error(reference[name], reduced[name], quantile)
            oor = _out_of_range([reference[name]]) if precision in ("fp16", "best") else 0.0
            stats[name] = (q, m, nf, oor)
    return rank_errors(layers, stats, precision)


def rank_errors(
    layers: Sequence[Tuple[str, Sequence[str], Sequence[str]]],
    stats: Dict[str, Tuple[float, float, float, float]],
    precision: str = "fp16",
) -> List[LayerScore]:
    """Rank layers worst first by the error each introduces.

    ``layers``: (name, input tensors, output tensors) in topological order; ``stats``: tensor
    name -> ``tensor_stats`` (tensors missing are exact: graph inputs, weights). A layer's
    score, highest first:

    1. for fp16, the fraction of its reference input/output values beyond the fp16 range (such
       a layer cannot run in fp16 whatever its neighbours do);
    2. the fraction of its outputs that became inf/NaN here while its inputs were finite;
    3. the growth (log10 ratio) of the normalized quantile error from its inputs to its
       outputs, plus a tenth of the median growth (median/quantile, not only the max), both
       measured above the error plain rounding to ``precision`` introduces (ERROR_FLOOR).

    Ties keep topological order."""
    scores: List[LayerScore] = []
    floor = ERROR_FLOOR.get(precision, ERROR_FLOOR["fp16"])
    exact = (0.0, 0.0, 0.0, 0.0)
    for index, (name, inputs, outputs) in enumerate(layers):
        s = LayerScore(name, index)
        ins = [stats.get(t, exact) for t in inputs if t]
        outs = [stats.get(t, exact) for t in outputs if t]
        in_q = max([e[0] for e in ins] or [0.0])
        in_m = max([e[1] for e in ins] or [0.0])
        in_nf = max([e[2] for e in ins] or [0.0])
        out_q = max([e[0] for e in outs] or [0.0])
        out_m = max([e[1] for e in outs] or [0.0])
        out_nf = max([e[2] for e in outs] or [0.0])
        s.in_error, s.out_error = in_q, out_q
        s.growth = _growth(out_q, in_q, floor)
        s.median_growth = _growth(out_m, in_m, floor)
        s.nonfinite = max(0.0, out_nf - in_nf)
        if precision in ("fp16", "best"):
            s.out_of_range = max([e[3] for e in ins + outs] or [0.0])
        s.score = (100.0 * (s.out_of_range > 0) + s.out_of_range + 10.0 * s.nonfinite
                   + s.growth + 0.1 * s.median_growth)
        scores.append(s)
    return sorted(scores, key=lambda x: (-x.score, x.index))


# A layer scoring above this introduces clearly more error than it receives (ten times, or
# inf/NaN, or values past the fp16 range): ``minimal`` tries those first.
SUSPECT_SCORE = 1.0


def count_suspects(scores: Sequence[LayerScore], threshold: float = SUSPECT_SCORE) -> int:
    return sum(1 for s in scores if s.score > threshold)


def _out_of_range(values: List[Any]) -> float:
    worst = 0.0
    for v in values:
        f = _flat(v)
        if f.size:
            with np.errstate(invalid="ignore"):
                worst = max(worst, float(np.count_nonzero(np.abs(f) > FP16_MAX)) / f.size)
    return worst


# ---------------------------------------------------------------------------------------------
# the instrumented runs and the ranking cache


def _layer_io(model: Any, groups: Dict[str, List[str]]
              ) -> List[Tuple[str, List[str], List[str]]]:
    """(group, tensors it reads from outside, tensors its nodes write) per candidate group:
    a folded or fused group is one layer, scored from its own inputs to its outputs (a tensor
    inside it, folded away in the instrumented engine, has no statistics)."""
    by_name = {n.name: n for n in model.graph.node}
    out = []
    for name, members in groups.items():
        nodes = [by_name[m] for m in members]
        written = set(o for n in nodes for o in n.output if o)
        out.append((name, [i for n in nodes for i in n.input if i and i not in written],
                    [o for n in nodes for o in n.output if o]))
    return out


def instrumented_ranking(model: Any, groups: Dict[str, List[str]], plan: Any,
                         inputs: Sequence[Feed],
                         build: Callable[[Any], Any], backend: Any, keep_precision: str
                         ) -> List[LayerScore]:
    """Rank candidate groups (name -> nodes) by the error each introduces, from two
    instrumented engines (every tensor an output), run one after the other on the first
    INSTRUMENT_ITERATIONS inputs; only a sample of each reference tensor and the worst
    statistics are kept. ``build`` turns a BuildPlan into an engine record (the searcher's,
    through the engine cache)."""
    from agent.engines.backends.base import BuildPlan

    io = _layer_io(model, groups)
    layers = [node for members in groups.values() for node in members]
    tensors = set(t for _, ins, outs in io for t in list(ins) + list(outs))
    ref_plan = plan.with_layers(layers, keep_precision)
    ref_plan.mark_outputs = ["*"]
    low_plan = BuildPlan.from_dict(plan.to_dict())
    low_plan.mark_outputs = ["*"]
    feeds = list(inputs[:INSTRUMENT_ITERATIONS])
    trim_heap()  # what the check's evaluation freed: the instrumented builds go on top
    # The engines are built and run one after the other, never side by side: the reference
    # run keeps a fixed sample of each tensor (SAMPLE elements) and its exact counts, then the
    # reduced run is compared with them. Memory: one engine and one run's activations.
    refs: List[Dict[str, Tuple[np.ndarray, float, int]]] = []
    with backend.open(build(ref_plan).engine_path) as runner:
        for feed in feeds:
            out = runner.infer(dict(feed))
            refs.append({name: _reference_sample(out.pop(name), plan.precision)
                         for name in tensors if name in out})
            del out
    trim_heap()  # the reference run's activations, before the next build
    stats: Dict[str, Tuple[float, float, float, float]] = {}
    with backend.open(build(low_plan).engine_path) as runner:
        for feed, ref in zip(feeds, refs):
            out = runner.infer(dict(feed))
            for name in list(ref):
                sample, oor, ref_nonfinite = ref.pop(name)
                if name in out:
                    merge_stats(stats, name, _sampled_stats(sample, oor, ref_nonfinite,
                                                            out.pop(name)))
            del out
    trim_heap()
    return rank_errors(io, stats, precision=plan.precision)


# Instrumented ranking compares this many evenly spaced elements of each tensor: enough for
# its 99th-percentile and median errors (about 40 samples above the 99th percentile), and
# 16 KiB per tensor and iteration kept (a transformer's 500 tensors x 4 iterations: 32 MiB);
# the counts of non-finite and out-of-range values stay exact.
SAMPLE = 4096


def _sample(values: np.ndarray) -> np.ndarray:
    flat = np.asarray(values).ravel()
    if flat.size <= SAMPLE:
        return flat.astype(np.float32, copy=True)
    return flat[np.linspace(0, flat.size - 1, SAMPLE).astype(np.int64)].astype(np.float32)


def _nonfinite(values: np.ndarray) -> int:
    a = np.asarray(values)
    if not np.issubdtype(a.dtype, np.floating):
        return 0
    return int(a.size - np.count_nonzero(np.isfinite(a)))


def _reference_sample(values: np.ndarray, precision: str) -> Tuple[np.ndarray, float, int]:
    """(sample, fraction past the fp16 range, non-finite count) of a reference tensor."""
    oor = _out_of_range([values]) if precision in ("fp16", "best") else 0.0
    return _sample(values), oor, _nonfinite(values)


def _sampled_stats(sample: np.ndarray, oor: float, ref_nonfinite: int, reduced: np.ndarray
                   ) -> Tuple[float, float, float, float]:
    """What ``rank_errors`` needs of one tensor in one iteration (quantile error, median
    error, fraction of non-finite values the reduced run added, fraction of reference values
    past the fp16 range): the errors on the samples, the counts over the whole tensor."""
    size = np.asarray(reduced).size
    if size == 0:
        return 0.0, 0.0, 0.0, oor
    q, m, _ = tensor_error(sample, _sample(reduced))
    added = max(0, _nonfinite(reduced) - ref_nonfinite)
    return q, m, float(added) / size, oor


def ranking_key(model: Any, plan: Any, inputs: Sequence[Feed], keep_precision: str,
                fingerprint: Dict[str, str], backend: Any) -> str:
    """What a ranking depends on: the model, the plan, the inputs, the backend."""
    from agent.engines.backends import onnx_model
    h = hashlib.sha256()
    h.update(onnx_model.model_digest(model).encode())
    doc = {"plan": plan.to_dict(), "keep": keep_precision, "platform": fingerprint,
           "backend": backend.fingerprint(), "iterations": INSTRUMENT_ITERATIONS,
           "version": RANKING_VERSION}
    h.update(json.dumps(doc, sort_keys=True, default=str).encode())
    for feed in inputs[:INSTRUMENT_ITERATIONS]:
        for name in sorted(feed):
            value = np.ascontiguousarray(feed[name])
            h.update("{}:{}:{}".format(name, value.dtype, value.shape).encode())
            h.update(value.tobytes())
    return h.hexdigest()


def load_ranking(path: Optional[str], layers: List[str]
                  ) -> Optional[List[LayerScore]]:
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            rows = json.loads(f.read().decode("utf-8"))
        scores = []
        for row in rows:
            s = LayerScore(str(row["layer"]), int(row["index"]))
            for attr in ("score", "growth", "median_growth", "in_error", "out_error",
                         "nonfinite", "out_of_range"):
                value = row.get(attr)
                setattr(s, attr, float("nan") if value is None else float(value))
            scores.append(s)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring unreadable ranking cache %s: %s", path, exc)
        return None
    if sorted(s.name for s in scores) != sorted(layers):
        return None
    return scores


def save_ranking(path: Optional[str], scores: List[LayerScore]) -> None:
    if not path:
        return
    rows = [{"layer": s.name, "index": s.index, "score": _r(s.score),
             "growth": _r(s.growth), "median_growth": _r(s.median_growth),
             "in_error": _r(s.in_error), "out_error": _r(s.out_error),
             "nonfinite": _r(s.nonfinite),
             "out_of_range": _r(s.out_of_range)} for s in scores]
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, json.dumps(rows).encode("utf-8"))
    except OSError as exc:  # a cache that cannot be written only costs a rerun
        log.warning("could not write the ranking cache %s: %s", path, exc)
