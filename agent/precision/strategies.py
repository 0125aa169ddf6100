"""The precision-search strategies as generators (pure, no backend; worker side: Python 3.6).

Each strategy yields a candidate set of layers to keep in higher precision, is sent back
whether that set passed, and returns its answer (a list of layer names). Generators keep each
algorithm readable top to bottom; ``search.Search`` drives them and adds what every mode shares
(memoization, the evaluation budget, partial answers).

- ``bisect`` / ``linear``: Polygraphy's ``debug precision`` markers (forward = a prefix of the
  layers from the inputs, reverse = a suffix);
- ``worst_first``: the smallest passing prefix of the error ranking (``ranking``);
- ``minimal``: bounded by bisect, then shrunk by group testing within a ``Budget``.
"""

import math
from typing import Any, FrozenSet, Generator, Iterable, List, Optional, Sequence, Set

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


def default_budget(n: int) -> int:
    """``minimal``'s default evaluation budget: twice bisect's plus four."""
    return 2 * bisect_evaluations(n) + 4


class Budget(object):
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


def minimal(ranking: Sequence[str], layers: Sequence[str], suspects: int, budget: Budget
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


def _shrink(keep: Set[str], by_rank: Any, suspects: Set[str], budget: Budget
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
