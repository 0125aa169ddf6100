import math
import random

import numpy as np
import pytest

from agent.errors import AgentError
from agent.precision.ranking import count_suspects, rank_layers, tensor_error
from agent.precision.search import Search

LAYERS = ["L{}".format(i) for i in range(40)]


def run(search, passes):
    """Drive a search with an oracle; returns the sets it evaluated, in order."""
    seen = []
    while not search.done:
        keep = search.propose()
        seen.append(frozenset(keep))
        search.observe(passes(frozenset(keep)))
    return seen


def needs(*names):
    required = frozenset(names)
    return lambda keep: required <= keep


# -- Polygraphy's markers (tools/Polygraphy debug precision), step for step -------------------

def polygraphy_bisect(n, direction, passes):
    good, bad, num = n + 1, 0, n
    tried = []
    while True:
        sel = LAYERS[:num] if direction == "forward" else LAYERS[n - num:n]
        tried.append(frozenset(sel))
        if passes(frozenset(sel)):
            good = num
            new = int(math.floor((good + bad) / 2.0))
        else:
            bad = num
            new = int(math.ceil((good + bad) / 2.0))
        old, num = num, new
        if old == num or abs(good - bad) <= 1 or num > n:
            break
    keep = LAYERS[:good] if direction == "forward" else LAYERS[n - good:n]
    return keep, tried


def polygraphy_linear(n, direction, passes):
    tried = []
    for num in range(n + 1):
        sel = LAYERS[:num] if direction == "forward" else LAYERS[n - num:n]
        tried.append(frozenset(sel))
        if passes(frozenset(sel)):
            return sel, tried
    return None, tried


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize("mode", ["bisect", "linear"])
def test_bisect_and_linear_match_polygraphy(mode, direction):
    rng = random.Random(7)
    reference = polygraphy_bisect if mode == "bisect" else polygraphy_linear
    for _trial in range(60):
        n = rng.randint(1, len(LAYERS))
        culprits = rng.sample(LAYERS[:n], rng.randint(1, min(4, n)))
        passes = needs(*culprits)
        s = Search(LAYERS[:n], mode=mode, direction=direction)
        ours = run(s, passes)
        expected_keep, expected_tried = reference(n, direction, passes)
        assert s.keep == expected_keep, (n, culprits)
        # The same builds, plus the sanity steps (nothing kept, everything kept) first; a set
        # Polygraphy builds twice is built once here.
        assert ours[:2] == [frozenset(), frozenset(LAYERS[:n])]
        assert [t for t in ours[2:]] == [t for t in dict.fromkeys(expected_tried)
                                         if t not in ours[:2]]
        if mode == "bisect":
            assert s.evaluations <= math.ceil(math.log2(n)) + 3


def test_fp16_max_like_prefixes():
    layers = ["MatMul_0", "Add", "Sub", "MatMul_1"]
    passes = needs("Add", "Sub")
    for mode, direction, keep in [("bisect", "forward", layers[:3]),
                                  ("bisect", "reverse", layers[1:]),
                                  ("linear", "forward", layers[:3]),
                                  ("linear", "reverse", layers[1:])]:
        s = Search(layers, mode=mode, direction=direction)
        run(s, passes)
        assert s.keep == keep, (mode, direction)


def _ranking(culprits, rng, good):
    rest = [x for x in LAYERS if x not in culprits]
    rng.shuffle(rest)
    if good:
        return list(culprits) + rest
    order = list(LAYERS)
    rng.shuffle(order)
    return order


@pytest.mark.parametrize("good", [True, False])
def test_minimal_finds_exactly_the_needed_layers(good):
    rng = random.Random(3)
    n = len(LAYERS)
    for _trial in range(40):
        k = rng.randint(1, 5)
        culprits = rng.sample(LAYERS, k)
        ranking = _ranking(culprits, rng, good)
        suspects = k + rng.randint(0, k) if good else 0
        # A bad ranking needs more than the bounded default to shrink to the exact set.
        s = Search(LAYERS, mode="minimal", ranking=ranking, suspects=suspects,
                   max_evaluations=None if good else 1000, stall=1000)
        seen = run(s, needs(*culprits))
        assert set(s.keep) == set(culprits)
        assert s.keep == [x for x in LAYERS if x in culprits]  # topological order
        assert len(seen) == len(set(seen))  # memoized: no set built twice
        budget = k * math.log2(n) + 2 * k
        if good:
            # bisect's steps, the bound from the ranking's prefixes, a removal per culprit
            assert s.evaluations <= math.log2(n) + 2 * k + 2 * math.log2(2 * k) + 8
        else:
            # Group testing plus worst-first's and bisect's steps that come first.
            assert s.evaluations <= budget + 3 * math.log2(n) + 8, (k, s.evaluations)


def test_minimal_answer_is_one_minimal_even_when_accuracy_is_not_monotonic():
    # L1 and L2 are needed together, or L3 alone -- unless L4 is kept too (more fp32 making
    # things worse, which bisect silently assumes never happens).
    def passes(keep):
        return ({"L1", "L2"} <= keep) or ("L3" in keep and "L4" not in keep)

    for seed in range(10):
        ranking = list(LAYERS)
        random.Random(seed).shuffle(ranking)
        s = Search(LAYERS, mode="minimal", ranking=ranking, max_evaluations=1000, stall=1000)
        run(s, lambda keep: passes(set(keep)))
        assert s.one_minimal and s.untested_removals == []
        keep = set(s.keep)
        assert passes(keep)
        for name in keep:
            assert not passes(keep - {name})


def _bisected(layers, passes):
    b = Search(layers, mode="bisect")
    run(b, passes)
    return b


def _worst_first(layers, ranking, passes):
    w = Search(layers, mode="worst-first", ranking=ranking)
    run(w, passes)
    return w


def _nonmonotone(culprits, spoilers):
    """Passes with every culprit kept, unless a spoiler is kept too while its partner is not
    (more fp32 making things worse: what bisect silently assumes never happens)."""
    need = frozenset(culprits)
    return lambda keep: need <= keep and not any(s in keep and p not in keep
                                                 for s, p in spoilers)


@pytest.mark.parametrize("ranked", ["good", "shuffled", "none"])
@pytest.mark.parametrize("monotone", [True, False])
def test_minimal_is_never_worse_than_bisect_and_worst_first(ranked, monotone):
    # Never more layers than bisect keeps, nor worst-first (same ranking) where keeping more
    # never fails (bisect's own assumption, which the bound by worst-first relies on), in at
    # most three times bisect's evaluations + 4 unless the set was still shrinking fast
    # (then at most the cap), sparse or dense, with a good, a useless or no ranking; every
    # set evaluated once; monotone or not, the answer passes.
    rng = random.Random(11 if monotone else 12)
    for _trial in range(60):
        n = rng.randint(2, 300)
        layers = ["N{}".format(i) for i in range(n)]
        k = rng.choice([1, 2, 6, max(1, n // 2), max(1, n - 3), n])
        culprits = rng.sample(layers, min(k, n))
        if monotone:
            passes = needs(*culprits)
        else:
            rest = [x for x in layers if x not in culprits]
            spoilers = [tuple(rng.sample(rest, 2)) for _ in range(min(3, len(rest) // 2))]
            passes = _nonmonotone(culprits, spoilers)
            if not passes(frozenset(layers)):
                continue
        ranking, suspects = None, 0
        if ranked != "none":
            rest = [x for x in layers if x not in culprits]
            rng.shuffle(rest)
            ranking = list(culprits) + rest if ranked == "good" else rest + list(culprits)
            suspects = len(culprits) if ranked == "good" else rng.randint(0, n)
        s = Search(layers, mode="minimal", ranking=ranking, suspects=suspects)
        totals = []
        seen = []
        while not s.done:
            totals.append(s.total)
            keep = s.propose()
            seen.append(frozenset(keep))
            s.observe(passes(frozenset(keep)))
        assert len(seen) == len(set(seen))
        b = _bisected(layers, passes)
        assert s.complete and passes(frozenset(s.keep))
        assert len(s.keep) <= len(b.keep), (n, k, ranked)
        if ranking is not None and monotone:
            assert len(s.keep) <= len(_worst_first(layers, ranking, passes).keep)
        assert s.evaluations <= 3 * b.evaluations + 4 or s.budget.extended, (
            n, k, ranked, s.evaluations)
        assert s.evaluations <= s.budget.cap
        assert all(t >= 1 for t in totals) and s.total == s.evaluations
        if ranked == "good" and k <= 6 and monotone:
            assert sorted(s.keep) == sorted(culprits) and s.one_minimal


def test_planted_six_in_127_stays_exact():
    rng = random.Random(5)
    layers = ["N{}".format(i) for i in range(127)]
    for _trial in range(20):
        culprits = rng.sample(layers, 6)
        rest = [x for x in layers if x not in culprits]
        rng.shuffle(rest)
        for suspects in (6, 8, 12):
            s = Search(layers, mode="minimal", ranking=culprits + rest, suspects=suspects)
            run(s, needs(*culprits))
            assert sorted(s.keep) == sorted(culprits) and s.evaluations <= 22, suspects


def test_keep_nearly_all_is_found_from_the_top():
    layers = ["N{}".format(i) for i in range(200)]
    passes = needs(*layers[:-1])
    s = Search(layers, mode="minimal", ranking=layers, suspects=200)
    run(s, passes)
    assert len(s.keep) == 199 and s.evaluations <= 3 * _bisected(layers, passes).evaluations + 4


def test_minimal_replays_bisect_and_bounds_by_worst_first_in_a_build_or_two():
    # bisect's sets are among minimal's (its answer is then never larger), each built once;
    # worst-first's bound costs one build where worst-first keeps more (its prefix one
    # shorter than bisect's answer fails), and none where bisect's failures imply it.
    rng = random.Random(7)
    for _trial in range(20):
        culprits = rng.sample(LAYERS, rng.randint(1, 4))
        ranking = _ranking(culprits, rng, True)
        passes = needs(*culprits)
        b_sets = run(Search(LAYERS, mode="bisect"), passes)
        seen = run(Search(LAYERS, mode="minimal", ranking=ranking, suspects=len(culprits)),
                   passes)
        assert set(b_sets) <= set(seen) and len(seen) == len(set(seen))
    layers = ["N{}".format(i) for i in range(64)]
    passes = needs("N3", "N40")
    ranking = layers[::-1]  # worst-first keeps 61 layers, bisect 41
    b_sets = run(Search(layers, mode="bisect"), passes)
    s = Search(layers, mode="minimal", ranking=ranking, max_evaluations=len(b_sets) + 1)
    seen = run(s, passes)
    assert seen[:len(b_sets)] == b_sets and seen[len(b_sets)] == frozenset(ranking[:40])
    assert s.budget.bounded and len(s.keep) == 41 and len(seen) == len(b_sets) + 1
    ranking = layers[39::-1] + layers[40:]  # its prefix of 40 is bisect's failed N0-N39
    s = Search(layers, mode="minimal", ranking=ranking, max_evaluations=len(b_sets))
    run(s, passes)
    assert s.budget.bounded and len(s.keep) == 41


def test_default_budget_is_twice_bisect_less_the_ranking_and_covers_both_classics():
    from agent.precision import strategies

    for n in (1, 2, 3, 7, 40, 127, 403, 709, 2000):
        fewest = strategies.bisect_evaluations(n)
        assert strategies.default_budget(n) == max(
            fewest, 2 * fewest - strategies.RANKING_COST - 1)
        assert strategies.default_budget(n, ranked=False) == 2 * fewest
        layers = ["N{}".format(i) for i in range(n)]
        # The worst case for the classics: the last layer of the ranking and of the graph.
        # Their steps always run to the end (the budget bounds the shrinking only), in at
        # most three times bisect's evaluations + 4.
        s = Search(layers, mode="minimal", ranking=layers[::-1], stall=0)
        run(s, needs(layers[0], layers[-1]))
        assert s.budget.bounded and s.evaluations <= 3 * fewest + 4, n


def test_shrinking_stops_after_k_evaluations_in_a_row_removed_nothing():
    layers = ["N{}".format(i) for i in range(64)]
    needed = layers[:20]  # every one needed: each single removal fails
    for stall in (3, 8):
        s = Search(layers, mode="minimal", ranking=layers, suspects=20, stall=stall,
                   max_evaluations=1000)
        seen = run(s, needs(*needed))
        assert sorted(s.keep) == sorted(needed) and s.budget.phase == "stalled"
        tail = [set(x) >= set(needed) for x in seen[-stall:]]
        assert not any(tail)  # the last K builds all failed
        assert not s.one_minimal and 0 < len(s.untested_removals) <= 20 - stall


def test_one_minimal_is_honest_in_every_mode():
    layers = ["N{}".format(i) for i in range(64)]
    passes = needs("N5", "N40")
    b = _bisected(layers, passes)
    assert len(b.keep) == 41 and not b.one_minimal
    assert b.untested_removals == [x for x in b.keep if x != "N40"]  # prefix 40 was built
    ranking = ["N40", "N7", "N5"] + [x for x in layers if x not in ("N40", "N7", "N5")]
    w = Search(layers, mode="worst-first", ranking=ranking)
    run(w, passes)
    assert w.keep == ["N5", "N7", "N40"] and not w.one_minimal
    m = Search(layers, mode="minimal", ranking=ranking, suspects=3)
    run(m, passes)
    assert m.keep == ["N5", "N40"] and m.one_minimal and m.untested_removals == []
    one = Search(layers, mode="bisect")
    run(one, needs("N0"))
    assert one.keep == ["N0"] and one.one_minimal  # the empty set was built and failed
    empty = Search(layers, mode="bisect")
    run(empty, lambda keep: True)
    assert empty.keep == [] and empty.one_minimal and empty.untested_removals == []


def test_prior_evaluations_count_and_are_never_built_again():
    # The driver checks the plan as asked before any instrumented build.
    s = Search(LAYERS, mode="minimal", ranking=LAYERS[::-1], prior=[(frozenset(), True, {})])
    assert s.done and s.keep == [] and s.evaluations == 1 and s.complete
    s = Search(LAYERS, mode="minimal", ranking=LAYERS[::-1], prior=[(frozenset(), False, {})],
               max_evaluations=40)
    seen = run(s, needs("L3"))
    assert frozenset() not in seen and s.keep == ["L3"] and s.evaluations == len(seen) + 1


def test_sanity_steps():
    s = Search(LAYERS, mode="minimal")
    run(s, lambda keep: True)
    assert s.keep == [] and s.evaluations == 1 and s.complete
    for mode in ("minimal", "bisect", "linear", "worst-first"):
        s = Search(LAYERS, mode=mode)
        with pytest.raises(AgentError) as err:
            run(s, lambda keep: False)
        assert err.value.code == "reference_mismatch"
        assert s.evaluations == 2


def test_worst_first_is_the_smallest_passing_prefix_of_the_ranking():
    ranking = ["L5", "L9", "L1", "L30", "L2"] + [x for x in LAYERS
                                               if x not in ("L5", "L9", "L1", "L30", "L2")]
    s = Search(LAYERS, mode="worst-first", ranking=ranking)
    run(s, needs("L5", "L30"))
    assert set(s.keep) == {"L5", "L9", "L1", "L30"}


def test_stopping_midway_gives_the_smallest_passing_set_so_far():
    s = Search(LAYERS, mode="minimal", max_evaluations=4)
    run(s, needs("L3", "L20"))  # 4 builds are not enough for the bisect bound
    assert s.exhausted and not s.complete and s.evaluations == 4
    best = s.best()
    assert best is not None and {"L3", "L20"} <= set(best)
    s = Search(LAYERS, mode="bisect")
    s.observe(False)  # nothing kept fails; stop before anything passed
    assert s.best() is None


def test_bad_arguments():
    for kwargs in ({"mode": "greedy"}, {"direction": "sideways"},
                   {"ranking": ["L1", "nope"]}):
        with pytest.raises(AgentError) as err:
            Search(["L1", "L2"], **kwargs)
        assert err.value.code == "bad_argument"
    with pytest.raises(AgentError):
        Search(["L1", "L1"])


def test_no_candidates():
    s = Search([], mode="minimal")
    run(s, lambda keep: True)
    assert s.keep == []
    s = Search([], mode="bisect")
    with pytest.raises(AgentError) as err:
        run(s, lambda keep: False)
    assert err.value.code == "reference_mismatch"


# -- ranking ---------------------------------------------------------------------------------

def test_tensor_error_is_scale_free_and_counts_nonfinite_apart():
    ref = np.linspace(1, 2, 100)
    q, m, nf = tensor_error(ref, ref * 1.01)
    q2, m2, _ = tensor_error(ref * 1e4, ref * 1e4 * 1.01)
    assert q == pytest.approx(q2) and m == pytest.approx(m2)
    assert q == pytest.approx(0.01, rel=0.05) and nf == 0.0
    bad = ref.copy()
    bad[:10] = np.inf
    q, m, nf = tensor_error(ref, bad)
    assert nf == pytest.approx(0.1) and q == 0.0


def test_rank_layers_puts_the_layers_that_introduce_error_first():
    rng = np.random.RandomState(0)
    x = rng.random_sample(1000) + 1.0
    ref = {"x": x, "a": x * 2, "b": x * 2e5, "c": x * 2, "d": x * 2 + 1}
    low = {"x": x, "a": ref["a"] * (1 + 1e-4), "b": np.full(1000, np.inf),
           "c": np.full(1000, np.inf), "d": ref["d"] * (1 + 0.2)}
    layers = [("A", ["x"], ["a"]), ("B", ["a"], ["b"]), ("C", ["b"], ["c"]),
              ("D", ["c"], ["d"])]
    scores = rank_layers(layers, ref, low, precision="fp16")
    order = [s.name for s in scores]
    # B and C touch values past the fp16 range; D's error grew 1000x; A only rounds.
    assert order[:2] == ["B", "C"] and order[2] == "D" and order[3] == "A"
    assert scores[0].out_of_range == 1.0 and scores[0].nonfinite == 1.0
    assert count_suspects(scores) == 3
    row = scores[0].to_dict()
    assert row["layer"] == "B" and row["nonfinite_introduced"] == 1.0
    # int8 has no fixed range: only growth counts.
    assert [s.name for s in rank_layers(layers, ref, low, precision="int8")][0] == "B"


def test_evaluation_lines_are_rate_limited_in_the_log(caplog):
    import logging

    from agent.precision.searcher import RateLimitedLog, evaluation_line

    now = [0.0]
    limited = RateLimitedLog(interval=10.0, clock=lambda: now[0])
    entry = {"size": 3, "passed": False, "seconds": 1.25, "cache_hit": False}
    with caplog.at_level(logging.INFO, logger="agent.precision.searcher"):
        for i in range(1, 8):  # one evaluation every 3 s
            limited(evaluation_line("minimal", i, 26, entry))
            now[0] += 3.0
        limited.flush()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "search minimal: evaluation 1/26: 3 layer(s) kept -> fail (1.25 s)"
    assert lines[1].startswith("search minimal: evaluation 5/26") and "(3 more" in lines[1]
    assert lines[-1].startswith("search minimal: evaluation 7/26") and "(1 more" in lines[-1]
    assert len(lines) == 3


def test_budget_goes_past_twice_bisect_only_while_shrinking_fast_cheaply_up_to_the_cap():
    from agent.precision.strategies import FIRST_LOOK, Budget, shrinking_fast

    # (layers in the set, layers decided so far) after each shrinking evaluation
    assert shrinking_fast([(49, 0), (41, 8)]) and not shrinking_fast([(49, 0)])
    assert not shrinking_fast([(200, 0)] + [(200, k) for k in range(1, 9)][:7])  # 7 of 200
    assert shrinking_fast([(200, 0)] + [(200, k) for k in range(1, 9)])  # 8 of 200: 4 %
    assert shrinking_fast([(22, 0)] * 8 + [(22, 1)])  # one needed layer found in 8: small set
    assert not shrinking_fast([(22, 0)] * 9)
    spent = [5]
    b = Budget(10, cap=30)
    b.spent = lambda: spent[0]
    assert b.go_on() and not b.extended  # within the budget: always
    spent[0] = 10
    b.trace = [(40, 0)]
    assert not b.go_on()  # a set of at least DENSE of the candidates: no first look
    b.candidates = 100
    assert b.go_on() and not b.extended  # a first look past the budget...
    b.looked = FIRST_LOOK
    assert not b.go_on()  # ... then only while shrinking fast
    b.trace = [(40, 0)] * 4 + [(30, 10)]
    assert b.go_on() and not b.extended
    spent[0] = 11
    assert b.extended  # once an evaluation ran past it
    b.trace = [(40, 0)] * 9
    assert not b.go_on()
    b.cheap = lambda: False
    assert not b.go_on()  # expensive evaluations (device builds): no further
    b.cheap, spent[0] = (lambda: True), 30
    assert not b.go_on()  # the cap


def test_sparse_culprits_past_the_budget_when_cheap_not_when_expensive():
    # 6 culprits among the first 42 of a rough ranking of 300 layers: worst-first keeps 39,
    # and the shrinking drops a few layers per two evaluations (issue 35's det int8 case).
    layers = ["N{}".format(i) for i in range(300)]
    culprits = ["N3", "N50", "N90", "N140", "N200", "N290"]
    rng = random.Random(1)
    rest = [x for x in layers if x not in culprits]
    rng.shuffle(rest)
    ranking = rest[:40]
    for i, c in enumerate(culprits):
        ranking.insert(7 * i + 3, c)
    ranking += rest[40:]
    found = {}
    for seconds in (0.2, 30.0):
        s = Search(layers, mode="minimal", ranking=ranking, suspects=6)
        while not s.done:
            s.observe(needs(*culprits)(frozenset(s.propose())), {"seconds": seconds})
        found[seconds] = s
    cheap, costly = found[0.2], found[30.0]
    base = cheap.budget.limit
    assert costly.evaluations == base and not costly.budget.extended and len(costly.keep) > 10
    assert cheap.budget.extended and base < cheap.evaluations <= cheap.budget.cap
    assert sorted(cheap.keep) == sorted(culprits) and cheap.one_minimal


def test_passing_rows_where_the_golden_is_about_zero_show_no_sqnr():
    from agent.cli.search import format_result
    from agent.precision.compare import compare_outputs
    from agent.precision.search_result import SearchResult, output_stats

    golden = {"p": np.full(16, 1e-4, np.float32)}
    # The noise is twice the signal (-6 dB), all of it within atol: the row passes.
    cmp = compare_outputs([{"p": golden["p"] + np.float32(2e-4)}], [golden], atol=1e-3,
                          rtol=1e-3)
    assert cmp.passed and cmp.results[0].sqnr_db is None and cmp.results[0].golden_near_zero
    assert "SQNR: n/a (golden ~0) |" in cmp.format_report()
    result = SearchResult()
    result.iterations = [{"index": 1, "size": 0, "passed": True, "seconds": 0.1,
                          "cache_hit": False, "stats": output_stats(cmp)}]
    row = [x for x in format_result(result.to_dict()).splitlines() if x.startswith("      1")]
    assert row and row[0].endswith("n/a (golden ~0)") and "-6" not in row[0]
    # A golden above atol keeps its SQNR (10^-4 relative noise: 80 dB).
    one = {"p": np.ones(16, np.float32)}
    big = compare_outputs([{"p": one["p"] + np.float32(1e-4)}], [one], atol=1e-3, rtol=1e-3)
    assert big.results[0].sqnr_db == pytest.approx(80.0, abs=0.1)
    assert not big.results[0].golden_near_zero
