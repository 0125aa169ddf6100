"""The precision-search strategies as generators (pure, no backend; worker side: Python 3.6).

Each strategy yields a candidate set of layers to keep in higher precision, is sent back
whether that set passed, and returns its answer (a list of layer names). Generators keep each
algorithm readable top to bottom; ``search.Search`` drives them and adds what every mode shares
(memoization, the evaluation budget, partial answers).

- ``bisect`` / ``linear``: Polygraphy's ``debug precision`` markers (forward = a prefix of the
  layers from the inputs, reverse = a suffix);
- ``worst_first``: the smallest passing prefix of the error ranking (``ranking``);
- ``minimal``: bisect's steps, then a bound by worst-first's ranking (usually one build:
  never a larger answer than either where keeping more never hurts), then shrunk by group
  testing within a ``Budget`` (adaptive: about twice bisect's evaluations, past that only
  while the set shrinks fast and evaluations are cheap) until it stalls.
"""

import math
from typing import Any, FrozenSet, Generator, Iterable, List, Optional, Sequence, Set, Tuple

# A strategy yields candidate sets and is sent back whether each passed; its return value is
# the answer (a list of layer names).
Strategy = Generator[FrozenSet[str], bool, List[str]]


class ReferenceFailed(Exception):
    """Even with every candidate kept the outputs fail: ``Search`` turns it into
    ``reference_mismatch``."""


def _sanity(layers: Sequence[str]) -> Generator[FrozenSet[str], bool, bool]:
    """True when nothing needs to be kept; raises ReferenceFailed when keeping all fails."""
    if (yield frozenset()):
        return True
    if not (yield frozenset(layers)):
        raise ReferenceFailed()
    return False


def bisect(layers: Sequence[str], direction: str) -> Strategy:
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


def linear(layers: Sequence[str], direction: str) -> Strategy:
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


def worst_first(ranking: Sequence[str]) -> Strategy:
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
        gen, memo, value, started = bisect(layers, direction), {}, False, False
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


# The ranking's two instrumented builds and runs, counted in evaluations (measured on the
# real-model table: 3 to 7 evaluations' CPU time).
RANKING_COST = 5


def default_budget(n: int, ranked: bool = True) -> int:
    """``minimal``'s default evaluation budget: twice bisect's, less what the ranking costs
    and the one build that bounds the answer by worst-first's (so the default takes about
    twice bisect's time). Past it the search goes on only while the set still shrinks fast
    and evaluations are cheap (``Budget.go_on``)."""
    b = bisect_evaluations(n)
    return max(b, 2 * b - (RANKING_COST + 1 if ranked else 0))


# ``minimal`` stops shrinking after this many evaluations in a row decided nothing (removed
# no layer, and group testing confirmed none; memo hits do not count): past that point the
# budget rarely buys a smaller set.
STALL_LIMIT = 8
# The adaptive budget: past the default budget, shrinking goes on while the evaluations are
# cheap (median at most CHEAP_S seconds: host emulation, not a device build) and the set is
# still shrinking fast: a first look of FIRST_LOOK shrinking evaluations (where the budget
# left fewer, and the set holds at most DENSE of the candidates or FIRST_LOOK layers:
# bisect's prefix holding nearly all of many says the needed layers reach the end, where
# group testing rarely pays), then while the last WINDOW evaluations (fewer at first)
# decided (removed, or confirmed needed) at least FAST of the set and at least one layer;
# never past CAP evaluations in all.
FIRST_LOOK = 4
DENSE = 0.75
WINDOW = 8
FAST = 0.04
CHEAP_S = 5.0
CAP = 100


def shrinking_fast(trace: Sequence[Tuple[int, int]], window: int = WINDOW,
                   fast: float = FAST) -> bool:
    """``trace``: (layers in the set, layers decided so far) after each evaluation of the
    shrinking phase, from its start. True when the last ``window`` evaluations decided at
    least ``fast`` of the set they started from, and at least one layer."""
    if len(trace) < 2:
        return False
    before, now = trace[max(0, len(trace) - 1 - window)], trace[-1]
    return now[1] - before[1] >= max(1.0, fast * before[0])


class Budget(object):
    """Evaluations spent so far (read from the Search) against a budget (None = unbounded),
    and, with a ``cap``, the adaptive extension past it; the strategy asks ``go_on`` before
    each shrinking evaluation, and flags when its answer is bounded."""

    def __init__(self, limit: Optional[int], cap: Optional[int] = None) -> None:
        self.limit = limit
        self.cap = cap
        self.spent = lambda: 0
        self.cheap = lambda: True  # the Search tells from its evaluations' times
        # (layers in the set, layers decided) at the start of shrinking and after each of
        # its evaluations
        self.trace: List[Tuple[int, int]] = []
        self._granted: Optional[int] = None  # evaluations spent when first let past limit
        self.bounded = False  # the answer keeps no more layers than bisect and worst-first
        self.looked = 0  # shrinking evaluations so far
        self.candidates = 0  # layers searched (the Search sets it)
        self.phase = "sanity"

    @property
    def extended(self) -> bool:
        """Shrinking evaluations ran past ``limit`` (a first look, or still shrinking fast)."""
        return self._granted is not None and self.spent() > self._granted

    def go_on(self) -> bool:
        """Within the budget; past it, while evaluations are cheap and the set shrinks fast
        (after a first look), up to the cap."""
        spent = self.spent()
        if self.limit is None or spent < self.limit:
            return True
        if self.cap is None or spent >= self.cap or not self.cheap():
            return False
        looking = self.looked < FIRST_LOOK and bool(self.trace) and \
            self.trace[-1][0] <= max(FIRST_LOOK, DENSE * self.candidates)
        if not looking and not shrinking_fast(self.trace):
            return False
        if self._granted is None:
            self._granted = spent
        return True


def _recorded(gen: Generator[FrozenSet[str], bool, Any], failed: List[FrozenSet[str]]
              ) -> Generator[FrozenSet[str], bool, Any]:
    """``gen``'s proposals passed through, each set that failed appended to ``failed``."""
    value: Optional[bool] = None
    try:
        cand = next(gen)
        while True:
            value = yield cand
            if not value:
                failed.append(cand)
            cand = gen.send(bool(value))
    except StopIteration as stop:
        return stop.value


def _failing_prefix(order: Sequence[str], failed: Sequence[FrozenSet[str]]) -> int:
    """The longest prefix of ``order`` inside a set that failed: it fails too where keeping
    more never hurts (bisect's own assumption), so it needs no build."""
    longest = 0
    for bad in failed:
        k = 0
        while k < len(order) and order[k] in bad:
            k += 1
        longest = max(longest, k)
    return longest


def _prefix_bound(order: Sequence[str], best: List[str], failed: List[FrozenSet[str]]
                  ) -> Generator[FrozenSet[str], bool, List[str]]:
    """``best`` (a passing set), or a shorter passing prefix of ``order``, such that the
    prefix one layer shorter than the answer fails (built, or inside a set that failed): then
    no passing prefix of ``order`` is shorter, where keeping more never hurts, and neither is
    the answer of a strategy that looks for the smallest passing prefix of ``order``
    (worst-first on the ranking, bisect on the topological order).

    One build when that prefix fails. Else the smallest passing prefix is looked for near
    the top first (2 layers shorter: a dense answer), then from the bottom (1, 2, 4, ...
    layers past the longest failing prefix: a good ranking), then by bisection."""
    bad = _failing_prefix(order, failed)
    good = len(best)
    for step in (1, 1):
        if good - step <= bad:
            break
        if not (yield frozenset(order[:good - step])):
            bad = good - step
            break
        good -= step
    size = 1
    while bad + size < good:
        if (yield frozenset(order[:bad + size])):
            good = bad + size
            break
        bad, size = bad + size, size * 2
    while good - bad > 1:
        mid = (good + bad) // 2
        if (yield frozenset(order[:mid])):
            good = mid
        else:
            bad = mid
    return best if good == len(best) else list(order[:good])


def minimal(ranking: Sequence[str], layers: Sequence[str], suspects: int, budget: Budget,
            ranked: bool = True, stall: int = STALL_LIMIT) -> Strategy:
    """The smallest passing set it can find, never larger than what ``bisect`` (forward) and
    ``worst_first`` (on the same ranking) answer where keeping more layers never makes a
    passing build fail (the assumption bisect itself makes).

    1. ``bisect``'s steps exactly: its answer is a passing prefix, the prefix one shorter
       failed (so no shorter set shrunk from it is larger than bisect's).
    2. The bound (``_prefix_bound``, with a ranking, whatever the budget): the ranking's
       prefix one layer shorter than the set must fail, so worst-first (the smallest passing
       prefix of the ranking) keeps no fewer; where a shorter prefix passes, it is the set.
       Usually one build.
    3. Shrink the set with the budget: generalized binary splitting (Hwang's adaptive group
       testing) over the set, least suspicious first, then a build without each member in
       turn. Stops when ``budget.go_on()`` says so or when ``stall`` evaluations in a row
       decided nothing. Where it shrank, step 2 again (usually a set already built).
    """
    failed: List[FrozenSet[str]] = []
    return (yield from _recorded(_minimal(ranking, layers, suspects, budget, ranked, stall,
                                          failed), failed))


def _minimal(ranking: Sequence[str], layers: Sequence[str], suspects: int, budget: Budget,
             ranked: bool, stall: int, failed: List[FrozenSet[str]]) -> Strategy:
    if (yield from _sanity(ranking)):
        return []
    rank = {name: i for i, name in enumerate(ranking)}

    def by_rank(names: Iterable[str]) -> List[str]:
        return sorted(names, key=lambda x: rank[x])

    budget.phase = "bisect"
    keep = set((yield from bisect(layers, "forward")))
    # What the adaptive budget measures starts here: a bound that drops layers counts as
    # shrinking (one entry per evaluation).
    budget.trace = [(len(keep), 0)]
    if ranked:
        budget.phase = "bound"
        spent, size = budget.spent(), len(keep)
        keep = set((yield from _prefix_bound(ranking, by_rank(keep), failed)))
        budget.trace += [(size, 0)] * max(0, budget.spent() - spent - 1)
        if budget.spent() > spent:
            budget.trace.append((len(keep), size - len(keep)))
    budget.bounded = True
    while budget.go_on():
        budget.phase = "shrinking"
        before = len(keep)
        keep = yield from _shrink(keep, by_rank, set(ranking[:suspects]), budget, stall)
        if not ranked or len(keep) == before:
            break
        phase = budget.phase
        bounded = yield from _prefix_bound(ranking, by_rank(keep), failed)
        budget.phase = phase
        if len(bounded) == len(keep) or phase == "stalled":
            keep = set(bounded)
            break
        keep = set(bounded)  # a shorter prefix passed: shrink that
    return by_rank(keep)


def _shrink(keep: Set[str], by_rank: Any, suspects: Set[str], budget: Budget, stall: int
            ) -> Generator[FrozenSet[str], bool, Set[str]]:
    """Drop what can be dropped from the passing set ``keep`` while the budget lasts and
    fewer than ``stall`` evaluations in a row decided nothing: group testing (a passing build
    drops a whole group), then one member at a time (least suspicious first)."""
    keep = set(keep)
    confirmed: Set[str] = set()
    # decided: layers removed, or confirmed needed (group testing's, or a failed removal of
    # one member): what the adaptive budget measures, continuing its trace.
    if not budget.trace:
        budget.trace = [(len(keep), 0)]
    state = {"stalled": 0, "seen": budget.spent(), "decided": budget.trace[-1][1]}

    def probe(cand: Set[str]) -> Generator[FrozenSet[str], bool, bool]:
        before = budget.spent()
        passed = yield frozenset(cand)
        if budget.spent() > before:  # a real evaluation, not a memo hit
            state["stalled"] = 0 if passed else state["stalled"] + 1
        if passed:
            state["decided"] += len(keep) - len(cand)
        return passed

    def go_on() -> bool:
        if budget.spent() > state["seen"]:  # after each real evaluation
            state["seen"] = budget.spent()
            budget.trace.append((len(keep), state["decided"]))
            budget.looked += 1
        if state["stalled"] >= stall:
            budget.phase = "stalled"
            return False
        return budget.go_on()

    # Expected number of needed layers: the suspects still kept (at least 1).
    expected = max(1, len(keep & suspects))
    while go_on():
        pool = by_rank(keep - confirmed)
        d = max(1, expected)
        if not pool or len(pool) <= max(2, 2 * d - 2):
            break  # dense or small: one at a time is cheaper
        size = 2 ** int(math.floor(math.log2(max(1.0, (len(pool) - d + 1) / float(d)))))
        group = pool[-size:]
        if (yield from probe(keep - set(group))):
            keep.difference_update(group)
            continue
        while len(group) > 1 and go_on():
            half = (len(group) + 1) // 2
            top, low = group[:half], group[half:]
            if (yield from probe(keep - set(low))):
                keep.difference_update(low)
                group = top
            else:
                group = low
        if len(group) > 1:
            break
        confirmed.add(group[0])
        state["stalled"], state["decided"] = 0, state["decided"] + 1  # found one needed
        expected -= 1

    checked: Set[str] = set()
    while True:
        for name in reversed(by_rank(keep)):  # least suspicious first: drops come early
            if name in checked:
                continue
            if not go_on():
                return keep
            if (yield from probe(keep - {name})):
                keep.discard(name)
                checked = set()  # accuracy is not always monotonic: check the rest again
                break
            checked.add(name)
            state["decided"] += 1
        else:
            budget.phase = "done"
            return keep
