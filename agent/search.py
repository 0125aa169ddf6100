"""Precision-search strategies: which layers must stay in higher precision (pure, no backend).

A strategy proposes a set of layers to keep in higher precision, is told whether the build with
that set passed the comparison against the goldens, and proposes the next set until it stops.
``Search`` wraps a strategy with the steps every mode shares:

- sanity first: nothing kept must fail (if it passes, the answer is the empty set after one
  evaluation) and everything kept must pass (else ``reference_mismatch``: the problem is not
  precision);
- memoization by set: a set already evaluated is never built again;
- a partial answer at any moment (the smallest passing set seen), so a driver can stop midway.

Modes:

- ``bisect`` / ``linear``: Polygraphy's ``debug precision`` markers (forward = a prefix of the
  layers from the inputs, reverse = a suffix), same steps, same answers;
- ``worst-first``: layers ranked by the error each introduces (``rank_layers``, from one
  instrumented run); the smallest passing prefix of that ranking, found by doubling then
  bisection;
- ``minimal`` (default): the smallest passing prefix of the clearly suspicious layers of that
  ranking, then repeated binary search (group testing, least suspicious half first) for each
  needed layer, then a check that dropping any single member fails (1-minimal, verified by
  builds). About k * (log2(N) + 1) + 3 builds for k needed layers among N without a useful
  ranking, far fewer with one.

Worker side: Python 3.6.
"""

import math
from collections import OrderedDict
from typing import (
    Any,
    Dict,
    FrozenSet,
    Generator,
    Iterable,
    List,
    Optional,
    Sequence,
    Set,
    Tuple,
    Union,
)

import numpy as np

from agent.errors import AgentError

MODES = ("minimal", "bisect", "linear", "worst-first")
DIRECTIONS = ("forward", "reverse")
FP16_MAX = 65504.0
# Relative error every layer of a precision introduces just by rounding (half an fp16 ulp,
# about half an int8 step of a well-used range): growth is measured above this floor, so a
# layer that merely rounds exact inputs does not look like one that loses accuracy.
ERROR_FLOOR = {"fp16": 2.0 ** -11, "int8": 2.0 ** -8, "best": 2.0 ** -8, "fp32": 1e-7}

# A strategy yields candidate sets and is sent back whether each passed; its return value is
# the answer (a list of layer names).
Strategy = Generator[FrozenSet[str], bool, List[str]]


def check_mode(mode: str, direction: str = "forward") -> None:
    if mode not in MODES:
        raise AgentError("bad_argument", "--mode must be one of {}, found {!r}".format(
            ", ".join(MODES), mode))
    if direction not in DIRECTIONS:
        raise AgentError("bad_argument", "--direction must be one of {}, found {!r}".format(
            ", ".join(DIRECTIONS), direction))


# ---------------------------------------------------------------------------------------------
# ranking from one instrumented run


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


def rank_layers(
    layers: Sequence[Tuple[str, Sequence[str], Sequence[str]]],
    reference: Dict[str, Any],
    reduced: Dict[str, Any],
    precision: str = "fp16",
    quantile: float = 0.99,
) -> List[LayerScore]:
    """Rank layers worst first by the error each introduces.

    ``layers``: (name, input tensors, output tensors) in topological order; ``reference`` and
    ``reduced``: tensor name -> values (an array, or one array per iteration) from the
    full-precision and the reduced-precision instrumented runs. A layer's score, highest first:

    1. for fp16, the fraction of its reference input/output values beyond the fp16 range (such
       a layer cannot run in fp16 whatever its neighbours do);
    2. the fraction of its outputs that became inf/NaN here while its inputs were finite;
    3. the growth (log10 ratio) of the normalized quantile error from its inputs to its
       outputs, plus a tenth of the median growth (median/quantile, not only the max), both
       measured above the error plain rounding to ``precision`` introduces (ERROR_FLOOR).

    Ties keep topological order."""
    scores: List[LayerScore] = []
    errors: Dict[str, Tuple[float, float, float]] = {}
    floor = ERROR_FLOOR.get(precision, ERROR_FLOOR["fp16"])

    def err(name: str) -> Tuple[float, float, float]:
        if name not in errors:
            if name in reference and name in reduced:
                errors[name] = tensor_error(reference[name], reduced[name], quantile)
            else:  # graph inputs and weights: exact as far as this layer's inputs go
                errors[name] = (0.0, 0.0, 0.0)
        return errors[name]

    for index, (name, inputs, outputs) in enumerate(layers):
        s = LayerScore(name, index)
        ins = [err(t) for t in inputs if t]
        outs = [err(t) for t in outputs if t]
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
            s.out_of_range = _out_of_range([reference[t] for t in list(inputs) + list(outputs)
                                            if t and t in reference])
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
# strategies (generators: yield a candidate set, receive pass/fail, return the answer)


class _ReferenceFailed(Exception):
    pass


def _sanity(layers: Sequence[str]) -> Generator[FrozenSet[str], bool, bool]:
    """True when nothing needs to be kept; raises _ReferenceFailed when keeping all fails."""
    if (yield frozenset()):
        return True
    if not (yield frozenset(layers)):
        raise _ReferenceFailed()
    return False


def _bisect(layers: Sequence[str], direction: str) -> Strategy:
    """Polygraphy's BisectMarker: good starts past the end, bad at 0 (nothing marked)."""
    if (yield from _sanity(layers)):
        return []
    n = len(layers)

    def select(count: int) -> List[str]:
        return list(layers[:count]) if direction == "forward" else list(layers[n - count:])

    good, bad, num = n + 1, 0, n
    while True:
        passed = yield frozenset(select(num))
        if passed:
            good = num
            new = int(math.floor((good + bad) / 2.0))
        else:
            bad = num
            new = int(math.ceil((good + bad) / 2.0))
        if new == num or abs(good - bad) <= 1 or new > n:
            break
        num = new
    return select(min(good, n))


def _linear(layers: Sequence[str], direction: str) -> Strategy:
    """Polygraphy's LinearMarker: 0, 1, 2, ... layers marked until one passes."""
    if (yield from _sanity(layers)):
        return []
    n = len(layers)
    for num in range(0, n + 1):
        sel = list(layers[:num]) if direction == "forward" else list(layers[n - num:])
        if (yield frozenset(sel)):
            return sel
    return list(layers)  # unreachable: all layers passed the sanity step


def _smallest_prefix(order: Sequence[str]) -> Generator[FrozenSet[str], bool, int]:
    """Smallest passing prefix of ``order`` (the empty prefix fails, the full one passes):
    sizes 1, 2, 4, ... until one passes, then bisection between the last fail and it."""
    n = len(order)
    bad, size = 0, 1
    while size < n:
        if (yield frozenset(order[:size])):
            break
        bad, size = size, size * 2
    good = min(size, n)
    while good - bad > 1:
        mid = (good + bad) // 2
        if (yield frozenset(order[:mid])):
            good = mid
        else:
            bad = mid
    return good


def _worst_first(ranking: Sequence[str]) -> Strategy:
    if (yield from _sanity(ranking)):
        return []
    m = yield from _smallest_prefix(ranking)
    return list(ranking[:m])


def _minimal(ranking: Sequence[str], suspects: int) -> Strategy:
    """A small set where dropping any single member fails, verified by builds.

    1. If the ranking marks ``suspects`` layers as clearly introducing error, find the smallest
       passing prefix of them by doubling (1, 2, 4, ... suspects); the layers after the last
       failing prefix are then known to hold a needed one.
    2. Generalized binary splitting (Hwang's adaptive group testing) over the kept layers not
       yet confirmed, expecting as many needed layers as suspects kept: build without the
       2^a least suspicious ones (a passing build drops them for good), and inside a group
       that holds a needed layer, binary search for it, least suspicious half first. Once no
       more are expected, one build with only the confirmed layers tells whether any is left.
       About log2(N) + 1 builds per needed layer without a useful ranking; a pool that is
       dense in needed layers is left to step 3.
    3. Build without each member in turn, least suspicious first; a member whose removal
       passes (accuracy is not always monotonic in the kept set) is dropped and the check
       restarts, so every member of the answer was shown needed by a build of the answer
       without it.
    """
    if (yield from _sanity(ranking)):
        return []
    n = len(ranking)
    rank = {name: i for i, name in enumerate(ranking)}

    def by_rank(names: Iterable[str]) -> List[str]:
        return sorted(names, key=lambda x: rank[x])

    keep: Set[str] = set(ranking)
    confirmed: Set[str] = set()
    positive: Optional[List[str]] = None  # layers known to hold a needed one
    if 0 < suspects < n:
        bad, size = 0, 1
        while True:
            size = min(size, suspects)
            if (yield frozenset(ranking[:size])):
                keep = set(ranking[:size])
                positive = list(ranking[bad:size])
                break
            bad = size
            if size >= suspects:
                positive = list(ranking[bad:])
                break
            size *= 2
    # Expected number of needed layers still to find: the suspects still kept (at least 1).
    expected = len(keep & set(ranking[:suspects]))

    while True:
        pool = by_rank(keep - confirmed)
        d = max(1, expected)
        if not pool or (expected > 0 and len(pool) <= max(2, 2 * d - 2)):
            break  # dense or small: step 3 tests the members one by one, which is cheaper
        if positive is not None:
            group = [x for x in positive if x in keep and x not in confirmed]
            positive = None
            if not group:
                continue
        else:
            # Generalized binary splitting (Hwang): test the 2^a least suspicious layers, a
            # sized so that the group holds a needed layer with probability about one half.
            # When no more needed layers are expected, the whole rest is tested at once.
            size = 2 ** int(math.floor(math.log2(max(1.0, (len(pool) - d + 1) / float(d)))))
            group = pool[-size:] if expected > 0 else pool
            if (yield frozenset(keep - set(group))):
                keep.difference_update(group)
                continue
        while len(group) > 1:
            half = (len(group) + 1) // 2
            top, low = group[:half], group[half:]
            if (yield frozenset(keep - set(low))):
                keep.difference_update(low)
                group = top
            else:
                group = low
        confirmed.add(group[0])
        expected -= 1

    while True:
        for name in reversed(by_rank(keep)):  # least suspicious first: drops come early
            if (yield frozenset(keep - {name})):
                keep.discard(name)
                break
        else:
            break
    return by_rank(keep)


# ---------------------------------------------------------------------------------------------
# the driver-facing wrapper


class Evaluation(object):
    """One build-and-compare the driver ran for the search."""

    def __init__(self, index: int, keep: FrozenSet[str], passed: bool,
                 info: Optional[Dict[str, Any]] = None) -> None:
        self.index = index
        self.keep = keep
        self.passed = passed
        self.info = dict(info or {})


class Search(object):
    """A search in progress: ``propose()`` the next set, ``observe(passed)`` its result.

    >>> s = Search(["a", "b", "c"], mode="bisect")
    >>> while not s.done:
    ...     keep = s.propose()
    ...     s.observe(set(keep) >= {"b"})
    >>> s.keep
    ['a', 'b']
    """

    def __init__(
        self,
        layers: Sequence[str],
        mode: str = "minimal",
        direction: str = "forward",
        ranking: Optional[Sequence[str]] = None,
        suspects: int = 0,
        max_evaluations: Optional[int] = None,
    ) -> None:
        check_mode(mode, direction)
        if len(set(layers)) != len(layers):
            raise AgentError("bad_argument", "layer names must be unique")
        self.layers = list(layers)
        self.mode = mode
        self.direction = direction
        self._index = {name: i for i, name in enumerate(self.layers)}
        if ranking is None:
            ranking = self.layers if direction == "forward" else self.layers[::-1]
        unknown = [r for r in ranking if r not in self._index]
        if unknown or len(set(ranking)) != len(self.layers):
            raise AgentError("bad_argument", "the ranking must order exactly the candidate "
                             "layers; unknown: {}".format(unknown[:5]))
        self.ranking = list(ranking)
        self.suspects = suspects
        self.max_evaluations = max_evaluations
        self.history: List[Evaluation] = []
        self.memo: Dict[FrozenSet[str], bool] = {}
        self.answer: Optional[List[str]] = None
        self.exhausted = False  # stopped by max_evaluations
        self._pending: Optional[FrozenSet[str]] = None
        if mode == "bisect":
            self._gen: Strategy = _bisect(self.layers, direction)
        elif mode == "linear":
            self._gen = _linear(self.layers, direction)
        elif mode == "worst-first":
            self._gen = _worst_first(self.ranking)
        else:
            self._gen = _minimal(self.ranking, max(0, int(suspects)))
        self._started = False
        self._advance(None)

    # -- stepping

    @property
    def done(self) -> bool:
        return self._pending is None

    def ordered(self, names: Iterable[str]) -> List[str]:
        """Names in topological order."""
        return sorted(names, key=lambda x: self._index[x])

    def propose(self) -> Optional[List[str]]:
        """The next set to evaluate (topological order), or None when the search is over."""
        return None if self._pending is None else self.ordered(self._pending)

    def observe(self, passed: bool, info: Optional[Dict[str, Any]] = None) -> None:
        """Record the evaluation of the proposed set and move on."""
        if self._pending is None:
            raise RuntimeError("observe() called with nothing proposed")
        keep = self._pending
        self.memo[keep] = bool(passed)
        self.history.append(Evaluation(len(self.history) + 1, keep, bool(passed), info))
        self._advance(bool(passed))

    def _advance(self, value: Optional[bool]) -> None:
        while True:
            try:
                if not self._started:
                    self._started = True
                    cand = next(self._gen)
                else:
                    cand = self._gen.send(bool(value))
            except StopIteration as stop:
                self.answer = self.ordered(stop.value or [])
                self._pending = None
                return
            except _ReferenceFailed:
                self._pending = None
                last = self.history[-1].info if self.history else {}
                raise AgentError(
                    "reference_mismatch",
                    "with all {} candidate layers kept in higher precision the outputs still "
                    "fail the goldens: the problem is not precision (check the goldens, the "
                    "inputs and the tolerances)".format(len(self.layers)),
                    {"comparison": last})
            if cand in self.memo:
                value = self.memo[cand]
                continue
            if self.max_evaluations is not None and len(self.history) >= self.max_evaluations:
                self._pending = None
                self.exhausted = True
                return
            self._pending = cand
            return

    # -- answers

    @property
    def evaluations(self) -> int:
        return len(self.history)

    @property
    def complete(self) -> bool:
        return self.answer is not None

    def best(self) -> Optional[List[str]]:
        """The answer when complete, else the smallest passing set evaluated so far."""
        if self.answer is not None:
            return list(self.answer)
        passing = [e for e in self.history if e.passed]
        if not passing:
            return None
        smallest = min(passing, key=lambda e: (len(e.keep), e.index))
        return self.ordered(smallest.keep)

    @property
    def keep(self) -> Optional[List[str]]:
        return self.best()
