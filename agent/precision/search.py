"""A precision search in progress: which layers must stay in higher precision (pure).

A strategy (``agent.precision.strategies``) proposes a set of layers to keep in higher
precision, is told whether the build with that set passed the comparison against the goldens,
and proposes the next set until it stops. ``Search`` is what a driver (``searcher``) steps: it
wraps the strategy of a mode with the steps every mode shares:

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
- ``minimal`` (default): bisect's steps, then the bound by worst-first (the ranking's prefix
  one layer shorter than the set must fail: usually one build; where keeping more never
  hurts, its answer is then never larger than either's), then shrinking (group testing,
  least suspicious first, then one member at a time) until the budget ends or
  ``strategies.STALL_LIMIT`` evaluations in a row decided nothing. The budget is
  ``--max-evaluations``, or by default adaptive: twice the fewest evaluations bisect needs on
  N layers less the ranking's cost and the bound's build, then more while the set still
  shrinks fast and evaluations are cheap, up to ``strategies.CAP``
  (``strategies.Budget.go_on``).

``one_minimal`` is computed, in every mode, from what was built: true only when the build
without each member of the answer was evaluated and failed; ``untested_removals`` lists the
members whose removal was never built.

Worker side: Python 3.6.
"""

import math
from typing import Any, Dict, FrozenSet, Iterable, List, Optional, Sequence, Tuple

from agent.errors import AgentError
from agent.precision import strategies
from agent.precision.strategies import Budget, ReferenceFailed, Strategy

MODES = ("minimal", "bisect", "linear", "worst-first")
DIRECTIONS = ("forward", "reverse")


def check_mode(mode: str, direction: str = "forward") -> None:
    if mode not in MODES:
        raise AgentError("bad_argument", "--mode must be one of {}, found {!r}".format(
            ", ".join(MODES), mode))
    if direction not in DIRECTIONS:
        raise AgentError("bad_argument", "--direction must be one of {}, found {!r}".format(
            ", ".join(DIRECTIONS), direction))


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
        prior: Optional[Sequence[Tuple[FrozenSet[str], bool, Dict[str, Any]]]] = None,
        stall: Optional[int] = None,
    ) -> None:
        """``prior``: evaluations the driver ran before the search (the check of the plan as
        asked, before any instrumented build): they count, and are never built again.
        ``stall``: ``minimal`` stops shrinking after this many evaluations in a row decided
        nothing; default ``strategies.STALL_LIMIT`` with the default budget, and no such stop
        when the caller gives ``max_evaluations`` (that budget is spent as asked)."""
        if stall is None:
            stall = strategies.STALL_LIMIT if max_evaluations is None else 1 << 30
        check_mode(mode, direction)
        if len(set(layers)) != len(layers):
            raise AgentError("bad_argument", "layer names must be unique")
        self.layers = list(layers)
        self.mode = mode
        self.direction = direction
        self._index = {name: i for i, name in enumerate(self.layers)}
        self.ranked = ranking is not None
        if ranking is None:
            ranking = self.layers if direction == "forward" else self.layers[::-1]
        unknown = [r for r in ranking if r not in self._index]
        if unknown or len(set(ranking)) != len(self.layers):
            raise AgentError("bad_argument", "the ranking must order exactly the candidate "
                             "layers; unknown: {}".format(unknown[:5]))
        self.ranking = list(ranking)
        self.suspects = suspects
        self.budget = Budget(None)
        if mode == "minimal":
            if max_evaluations is None:
                # The adaptive default: about twice bisect's evaluations, more while the set
                # shrinks fast and evaluations are cheap, never past CAP (nor fewer than
                # bisect's steps and the bound need).
                n = len(self.layers)
                cap = max(strategies.CAP, 3 * strategies.bisect_evaluations(n) + 4)
                self.budget = Budget(strategies.default_budget(n, self.ranked), cap=cap)
                self.budget.candidates = n
                max_evaluations = cap
            else:  # the caller's, spent as asked
                self.budget = Budget(max_evaluations)
            self.budget.spent = lambda: len(self.history)
            self.budget.cheap = self._cheap
        self.max_evaluations = max_evaluations
        self.history: List[Evaluation] = []
        self.memo: Dict[FrozenSet[str], bool] = {}
        self.answer: Optional[List[str]] = None
        self.exhausted = False  # stopped by max_evaluations
        self._pending: Optional[FrozenSet[str]] = None
        for keep, passed, info in prior or ():
            keep = frozenset(keep)
            if keep not in self.memo:
                self.memo[keep] = bool(passed)
                self.history.append(Evaluation(len(self.history) + 1, keep, bool(passed), info))
        if mode == "bisect":
            self._gen: Strategy = strategies.bisect(self.layers, direction)
        elif mode == "linear":
            self._gen = strategies.linear(self.layers, direction)
        elif mode == "worst-first":
            self._gen = strategies.worst_first(self.ranking)
        else:
            self._gen = strategies.minimal(self.ranking, self.layers, max(0, int(suspects)),
                                           self.budget, ranked=self.ranked, stall=stall)
        self._started = False
        self._advance(None)

    def _cheap(self) -> bool:
        """The median evaluation took at most ``strategies.CHEAP_S`` seconds (``seconds`` in
        the evaluations' info; an evaluation without it counts as cheap)."""
        times = sorted(float(e.info.get("seconds") or 0.0) for e in self.history)
        return not times or times[len(times) // 2] <= strategies.CHEAP_S

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
            except ReferenceFailed:
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
    def untested_removals(self) -> List[str]:
        """Members of the answer (or of the best set so far) whose removal was never built."""
        best = self.best() or []
        kept = frozenset(best)
        return [x for x in best if kept - {x} not in self.memo]

    @property
    def one_minimal(self) -> bool:
        """Every member of the answer shown needed by a build: the answer without it was
        evaluated and failed (any mode; the empty answer trivially)."""
        if not self.complete or self.answer is None:
            return False
        kept = frozenset(self.answer)
        return all(self.memo.get(kept - {x}) is False for x in kept)

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
        if self.budget.cap is not None and not self.budget.extended:
            bound = int(self.budget.limit or bound)  # the cap only once past the budget
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
