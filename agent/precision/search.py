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
- ``worst-first``: layers ranked by the error each introduces (``agent.precision.ranking``, from the
  instrumented runs); the smallest passing prefix of that ranking, found by doubling then
  bisection;
- ``minimal`` (default): bounded by bisect. Within a budget (``--max-evaluations``, by
  default twice the fewest evaluations bisect needs on N layers, plus 4): the smallest passing
  prefix of the ranking (galloping from the number of suspects, from the top when nearly all
  must be kept), then one build that proves the set no larger than bisect's answer (or a
  bisection inside the shorter prefix), then shrinking with what is left of the budget (group
  testing, least suspicious first, then a 1-minimal check verified by builds). Never more
  layers than bisect; with a good ranking the exact set (6 among 127 in <= 16 builds).

Worker side: Python 3.6.
"""

import math
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
)

from agent.errors import AgentError
from agent.precision.ranking import (  # noqa: F401 - the ranking API, re-exported for callers
    ERROR_FLOOR,
    FP16_MAX,
    SUSPECT_SCORE,
    LayerScore,
    count_suspects,
    merge_stats,
    rank_errors,
    rank_layers,
    tensor_error,
    tensor_stats,
)

MODES = ("minimal", "bisect", "linear", "worst-first")
DIRECTIONS = ("forward", "reverse")

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


def bisect_evaluations(n: int, direction: str = "forward") -> int:
    """The fewest evaluations ``bisect`` needs on ``n`` layers when some layer must be kept
    (sanity steps included): the yardstick of the ``minimal`` budget."""
    if n <= 0:
        return 2
    layers = [str(i) for i in range(n)]
    fewest = None
    for k in sorted(set([1, n] + [max(1, n >> s) for s in range(n.bit_length())]
                        + [n - (n >> s) for s in range(1, n.bit_length())])):
        need = frozenset(layers[:k]) if direction == "forward" else frozenset(layers[n - k:])
        gen, memo, value, started = _bisect(layers, direction), {}, False, False
        try:
            while True:
                cand = gen.send(value) if started else next(gen)
                started = True
                if cand not in memo:
                    memo[cand] = need <= cand
                value = memo[cand]
        except StopIteration:
            pass
        fewest = len(memo) if fewest is None else min(fewest, len(memo))
    return int(fewest or 2)


def default_budget(n: int) -> int:
    """``minimal``'s default evaluation budget: twice bisect's plus four."""
    return 2 * bisect_evaluations(n) + 4


class _Budget(object):
    """Evaluations spent so far (read from the Search) against a budget (None = unbounded);
    the strategy reads it to stop shrinking, and flags when its answer is bounded."""

    def __init__(self, limit: Optional[int]) -> None:
        self.limit = limit
        self.spent = lambda: 0
        self.bounded = False  # the answer keeps no more layers than bisect would
        self.phase = "sanity"

    def left(self) -> float:
        return float("inf") if self.limit is None else self.limit - self.spent()


def _prefix_from(order: Sequence[str], estimate: Optional[int], cap: float
                 ) -> Generator[FrozenSet[str], bool, int]:
    """Smallest passing prefix of ``order`` (the empty prefix fails, the full one passes).
    With an ``estimate`` it gallops from there: steps of 1, 2, 4, ... down while prefixes
    pass (from the top when most layers must be kept: a search of the complement), up while
    they fail, then bisects; without one it bisects. Stops after ``cap`` evaluations with
    the smallest prefix known to pass."""
    n = len(order)
    bad, good, spent = 0, n, 0
    if estimate is not None and n > 1 and spent < cap:
        mid = min(max(1, estimate), n - 1)
        spent += 1
        down = yield frozenset(order[:mid])
        if down:
            good = mid
        else:
            bad = mid
        step = 1
        while good - bad > 1 and spent < cap:
            mid = good - step if down else bad + step
            mid = min(max(mid, bad + 1), good - 1)
            spent += 1
            passed = yield frozenset(order[:mid])
            if passed:
                good = mid
            else:
                bad = mid
            if passed != down:
                break  # crossed the boundary: bisect what lies between
            step *= 2
    while good - bad > 1 and spent < cap:
        mid = (good + bad) // 2
        spent += 1
        if (yield frozenset(order[:mid])):
            good = mid
        else:
            bad = mid
    return good


def _minimal(ranking: Sequence[str], layers: Sequence[str], suspects: int, budget: _Budget
             ) -> Strategy:
    """A small passing set, bounded: never more layers than ``bisect`` keeps (under the
    monotonicity bisect assumes), in at most ``budget`` evaluations.

    1. Smallest passing prefix of the ranking, galloping from the number of suspects (a
       good ranking finds it in about 2 builds; "keep nearly all" is found from the top, the
       complement), capped at log2(N) + 1 builds.
    2. The bisect bound: build the forward prefix of the topological order one shorter than
       the set found. If it fails, bisect's answer is no smaller (bisect returns the smallest
       passing prefix of a monotonic search). If it passes, binary search that prefix down
       and continue inside it.
    3. Shrink with what is left of the budget: generalized binary splitting (Hwang's adaptive
       group testing) over the set, least suspicious layers first, then a check that
       dropping any single member fails (1-minimal, verified by builds). The budget may stop
       this step: the answer is then the smallest passing set, still bounded by step 2.
    """
    if (yield from _sanity(ranking)):
        return []
    n = len(ranking)
    rank = {name: i for i, name in enumerate(ranking)}

    def by_rank(names: Iterable[str]) -> List[str]:
        return sorted(names, key=lambda x: rank[x])

    budget.phase = "ranked prefix"
    # Where to start: the number of suspects; all of them suspect = keep nearly all (start
    # from the top); none = no useful ranking (bisect).
    estimate = suspects if 0 < suspects < n else (n - 1 if suspects >= n else None)
    cap = int(math.ceil(math.log2(n + 1))) + 1
    m = yield from _prefix_from(ranking, estimate, cap)
    keep: Set[str] = set(ranking[:m])
    budget.phase = "bisect bound"
    size = len(keep)
    if size > 1:
        shorter = list(layers[:size - 1])
        if (yield frozenset(shorter)):
            p = yield from _prefix_from(shorter, None, float("inf"))
            keep = set(shorter[:p])
    budget.bounded = True
    budget.phase = "shrinking"
    keep = yield from _shrink(keep, by_rank, set(ranking[:suspects]), budget)
    return by_rank(keep)


def _shrink(keep: Set[str], by_rank: Any, suspects: Set[str], budget: _Budget
            ) -> Generator[FrozenSet[str], bool, Set[str]]:
    """Drop what can be dropped from the passing set ``keep`` while the budget lasts: group
    testing (a passing build drops a whole group), then one member at a time."""
    keep = set(keep)
    confirmed: Set[str] = set()
    # Expected number of needed layers: the suspects still kept (at least 1).
    expected = max(1, len(keep & suspects))

    while budget.left() > 0:
        pool = by_rank(keep - confirmed)
        d = max(1, expected)
        if not pool or (expected > 0 and len(pool) <= max(2, 2 * d - 2)):
            break  # dense or small: one at a time is cheaper
        size = 2 ** int(math.floor(math.log2(max(1.0, (len(pool) - d + 1) / float(d)))))
        group = pool[-size:] if expected > 0 else pool
        if (yield frozenset(keep - set(group))):
            keep.difference_update(group)
            continue
        while len(group) > 1 and budget.left() > 0:
            half = (len(group) + 1) // 2
            top, low = group[:half], group[half:]
            if (yield frozenset(keep - set(low))):
                keep.difference_update(low)
                group = top
            else:
                group = low
        if len(group) > 1:
            break
        confirmed.add(group[0])
        expected -= 1

    checked: Set[str] = set()
    while budget.left() > 0:
        for name in reversed(by_rank(keep)):  # least suspicious first: drops come early
            if name in checked:
                continue
            if budget.left() <= 0:
                return keep
            if (yield frozenset(keep - {name})):
                keep.discard(name)
                checked = set()  # accuracy is not always monotonic: check the rest again
                break
            checked.add(name)
        else:
            budget.phase = "done"
            break
    return keep


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
        self.budget = _Budget(None)
        if mode == "minimal":
            # The bounded default: a budget of twice bisect's evaluations + 4, or the caller's.
            if max_evaluations is None:
                max_evaluations = default_budget(len(self.layers))
            self.budget = _Budget(max_evaluations)
            self.budget.spent = lambda: len(self.history)
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
            self._gen = _minimal(self.ranking, self.layers, max(0, int(suspects)), self.budget)
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

    @property
    def one_minimal(self) -> bool:
        """``minimal``: every member of the answer was shown needed (the budget did not stop
        the shrinking first)."""
        return self.complete and (self.mode != "minimal" or self.budget.phase == "done"
                                  or not self.answer)

    @property
    def total(self) -> int:
        """The most evaluations this search can take (for progress): the budget, or the
        bound of the mode; once done, the evaluations it took."""
        if self.done:
            return self.evaluations
        n = len(self.layers)
        log = int(math.ceil(math.log2(n + 1))) if n else 0
        bound = {"bisect": log + 3, "linear": n + 2, "worst-first": 2 * log + 3}.get(
            self.mode, n + 2)
        if self.max_evaluations is not None:
            bound = min(bound, self.max_evaluations) if self.mode != "minimal" \
                else self.max_evaluations
        return max(bound, self.evaluations + 1)

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
