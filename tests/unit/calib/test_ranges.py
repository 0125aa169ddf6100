"""Activation ranges per calibration algorithm (calib/ranges.py)."""

import numpy as np
import pytest

from agent.errors import AgentError
from calib.ranges import AbsHistogram, RangeCollector, entropy_threshold


def batches(seed=0, n=8, size=4096, scale=1.0):
    rs = np.random.RandomState(seed)
    return [(rs.randn(size) * scale).astype(np.float32) for _ in range(n)]


def collect(algorithm, arrays, **kwargs):
    c = RangeCollector(algorithm, **kwargs)
    for a in arrays:
        c.update("t", a)
    return c.amax()["t"]


def test_minmax_is_the_largest_absolute_value_over_all_batches():
    data = [np.array([0.5, -3.0]), np.array([2.0, 1.0]), np.array([-0.1])]
    assert collect("minmax", data) == 3.0


def test_entropy2_clips_rare_outliers_that_minmax_keeps():
    data = batches(n=10, size=10000)
    data[3][:5] = 100.0  # five outliers among 100k gaussian samples
    assert collect("minmax", data) == 100.0
    amax = collect("entropy2", data)
    assert 2.0 < amax < 10.0


def test_entropy2_keeps_the_range_of_a_uniform_distribution():
    rs = np.random.RandomState(1)
    data = [rs.uniform(-1, 1, 20000) for _ in range(5)]
    assert collect("entropy2", data) > 0.9


def test_entropy_threshold_picks_the_last_bin_for_a_flat_histogram():
    assert entropy_threshold(np.full(512, 10, dtype=np.int64)) == 512


def test_percentile_reads_the_histogram():
    rs = np.random.RandomState(2)
    data = [rs.uniform(-1, 1, 50000) for _ in range(4)]
    amax = collect("percentile", data, percentile=99.0)
    assert amax == pytest.approx(0.99, abs=2.0 / 2048 + 0.005)
    assert collect("percentile", data, percentile=100.0) <= collect("minmax", data)


def test_legacy_stays_between_the_cutoff_and_the_maximum():
    data = batches(seed=3)
    data[0][0] = 50.0
    amax = collect("legacy", data)
    assert 0.5 * 50.0 <= amax <= 50.0
    assert collect("legacy", batches(seed=3), regression_cutoff=0.0) < 5.0


def test_histogram_growth_merges_exactly_and_keeps_its_size():
    rs = np.random.RandomState(4)
    parts = [rs.uniform(0, s, 5000) for s in (0.1, 0.3, 1.0, 7.0, 7.5)]
    h = AbsHistogram(2048)
    for p in parts:
        h.add(np.abs(p))
    assert len(h.counts) == 2048
    assert h.total() == 25000
    assert h.top >= 7.5 > h.top / 2
    one = AbsHistogram(2048)
    one.add(np.concatenate(parts))
    # Percentiles agree within two bins of the grown histogram.
    for q in (0.5, 0.9, 0.999):
        assert h.quantile(q) == pytest.approx(one.quantile(q), abs=2 * h.bin_width)


def test_streamed_and_single_pass_entropy_agree():
    data = batches(seed=5, n=6, size=20000)
    data[2][:3] = 40.0
    streamed = collect("entropy2", data)
    single = collect("entropy2", [np.concatenate(data)])
    assert streamed == pytest.approx(single, rel=0.1)


def test_zeros_and_non_finite_values():
    c = RangeCollector("entropy2")
    c.update("z", np.zeros(100))
    c.update("n", np.array([np.nan, np.inf, -2.0, 1.0]))
    out = c.amax()
    assert out["z"] == 0.0
    assert 0 < out["n"] <= 2.0
    # zeros first, then real values: the zeros land in bin 0
    h = AbsHistogram(256)
    h.add(np.zeros(10))
    h.add(np.array([1.0, 2.0]))
    assert h.counts[0] == 10 and h.total() == 12


def test_names_keep_first_seen_order():
    c = RangeCollector("minmax")
    for name in ("b", "a", "b"):
        c.update(name, np.ones(2))
    assert c.names() == ["b", "a"]
    assert list(c.amax()) == ["b", "a"]


@pytest.mark.parametrize("kwargs", [
    {"algorithm": "kl"}, {"algorithm": "entropy2", "num_bins": 16},
    {"algorithm": "percentile", "percentile": 0.0},
])
def test_bad_settings(kwargs):
    with pytest.raises(AgentError) as err:
        RangeCollector(**kwargs)
    assert err.value.code == "bad_argument"


def test_entropy_threshold_matches_the_one_candidate_at_a_time_form():
    from calib.ranges import entropy_threshold_reference

    rng = np.random.RandomState(0)
    for trial in range(48):
        n = rng.randint(10, 40000)
        x = np.abs(rng.standard_normal(n) * rng.uniform(0.1, 3)) ** rng.uniform(0.5, 2)
        kind = trial % 4
        if kind == 1:  # rare outliers
            x = np.concatenate([x, rng.uniform(0, 50, rng.randint(1, 20))])
        elif kind == 2:  # ReLU-like: half zeros
            x[: n // 2] = 0
        elif kind == 3:  # few distinct values: mostly empty bins
            x = np.round(rng.uniform(0, 5, n))
        hist = AbsHistogram(2048)
        hist.add(x)
        assert entropy_threshold(hist.counts) == entropy_threshold_reference(hist.counts)
    flat = np.full(512, 10, dtype=np.int64)
    assert entropy_threshold(flat) == entropy_threshold_reference(flat) == 512
