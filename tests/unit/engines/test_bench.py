import numpy as np
import pytest

from agent.engines import bench
from agent.engines.backends.base import TensorSpec
from agent.errors import AgentError


def test_percentiles_nearest_rank_like_trtexec():
    samples = [float(i) for i in range(1, 101)]  # 1..100 ms
    stats = bench.LatencyStats(samples[::-1])
    assert stats.min == 1.0 and stats.max == 100.0
    assert stats.mean == pytest.approx(50.5)
    assert stats.median == 50.5  # even count: mean of the two middle samples
    assert stats.percentiles == {90: 90.0, 95: 95.0, 99: 99.0}


def test_percentiles_small_and_odd_counts():
    assert bench.percentile([5.0], 99) == 5.0
    assert bench.median([3.0, 1.0, 2.0][:1]) == 3.0
    ordered = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert bench.median(ordered) == 3.0
    assert bench.percentile(ordered, 90) == 10.0  # ceil(4.5) = 5th
    assert bench.percentile(ordered, 50) == 3.0
    assert bench.percentile(ordered, 0) == 1.0
    ten = [float(i) for i in range(10)]
    assert bench.percentile(ten, 90) == 8.0  # 9th of 10
    assert bench.percentile(ten, 95) == 9.0
    with pytest.raises(ValueError):
        bench.percentile([], 50)


class CountingRunner(object):
    """A Runner stand-in whose infer advances a fake clock by known latencies."""

    def __init__(self, clock, latencies_s):
        self.clock = clock
        self.latencies = list(latencies_s)
        self.calls = 0

    def infer(self, feeds):
        self.clock.now += self.latencies[self.calls % len(self.latencies)]
        self.calls += 1
        return {}


class FakeClock(object):
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_benchmark_times_each_call_and_throughput_from_wall_time():
    clock = FakeClock()
    runner = CountingRunner(clock, [0.001, 0.002, 0.003, 0.004])
    feeds = {"x": np.zeros((8, 3), np.float32)}
    result = bench.benchmark(runner, feeds, iterations=8, warmup=2, clock=clock)
    assert runner.calls == 10
    assert result.iterations == 8
    # warm-up consumed latencies 1 and 2 ms; timed: 3,4,1,2,3,4,1,2 ms
    assert result.latency.min == pytest.approx(1.0)
    assert result.latency.max == pytest.approx(4.0)
    assert result.latency.mean == pytest.approx(2.5)
    assert result.wall_seconds == pytest.approx(0.020)
    assert result.inferences_per_second == pytest.approx(400.0)
    assert result.batch == 8
    assert result.samples_per_second == pytest.approx(3200.0)
    d = result.to_dict()
    assert set(d["latency_ms"]) == {"min", "max", "mean", "median", "p90", "p95", "p99",
                                    "stddev", "cov"}
    assert d["throughput"]["inferences_per_second"] == pytest.approx(400.0)
    assert result.summary()[0] == "=== Performance summary ==="


def test_benchmark_duration_runs_at_least_that_long():
    clock = FakeClock()
    runner = CountingRunner(clock, [0.01])
    result = bench.benchmark(runner, {"x": np.zeros(1)}, iterations=2, warmup=0,
                             duration=0.1, clock=clock)
    assert result.iterations == 10
    assert result.wall_seconds == pytest.approx(0.1)


def test_benchmark_rejects_bad_counts():
    with pytest.raises(AgentError) as err:
        bench.benchmark(CountingRunner(FakeClock(), [0.0]), {}, iterations=0)
    assert err.value.code == "bad_argument"


def test_random_feeds_fill_dynamic_batch_and_respect_dtypes():
    specs = [TensorSpec("input", np.float32, (None, 64)), TensorSpec("ids", np.int64, (-1, 4)),
             TensorSpec("mask", np.bool_, (2,))]
    feeds = bench.random_feeds(specs, batch=5, seed=1)
    assert feeds["input"].shape == (5, 64) and feeds["input"].dtype == np.float32
    assert 0.0 <= feeds["input"].min() and feeds["input"].max() < 1.0
    assert feeds["ids"].shape == (5, 4) and feeds["ids"].dtype == np.int64
    assert feeds["mask"].shape == (2,) and feeds["mask"].dtype == np.bool_
    again = bench.random_feeds(specs, batch=5, seed=1)
    assert np.array_equal(feeds["input"], again["input"])


def test_random_feeds_inner_dynamic_dim_needs_a_shape():
    specs = [TensorSpec("img", np.float32, (1, 3, "H", "W"))]
    with pytest.raises(AgentError) as err:
        bench.random_feeds(specs, batch=1)
    assert err.value.code == "dynamic_shape" and "img" in err.value.message
    feeds = bench.random_feeds(specs, shapes={"img": (1, 3, 8, 8)})
    assert feeds["img"].shape == (1, 3, 8, 8)


def test_warm_up_in_seconds_like_trtexec():
    clock = FakeClock()
    runner = CountingRunner(clock, [0.01])
    result = bench.benchmark(runner, {"x": np.zeros(1)}, iterations=3, warmup=0,
                             warmup_seconds=0.05, clock=clock)
    assert result.warmup == 5 and result.warmup_seconds == pytest.approx(0.05)
    assert runner.calls == 8 and result.iterations == 3
    assert (bench.DEFAULT_WARMUP_S, bench.DEFAULT_DURATION_S, bench.DEFAULT_ITERATIONS) == (
        0.2, 3.0, 10)
    with pytest.raises(AgentError):
        bench.benchmark(runner, {}, iterations=1, warmup_seconds=-1)


class PhasedRunner(CountingRunner):
    """A TensorRT-like runner: per-phase times as CUDA events would give them."""

    def __init__(self, clock, latencies_s, compute_ms):
        super().__init__(clock, latencies_s)
        self.compute_ms = compute_ms

    def time_phases(self, iterations, feeds):
        return [{"enqueue": 0.01, "h2d": 0.02, "compute": self.compute_ms[i % len(
            self.compute_ms)], "d2h": 0.03} for i in range(iterations)]


def test_phase_split_and_trtexec_lines():
    clock = FakeClock()
    runner = PhasedRunner(clock, [0.001], [1.0, 1.0, 1.0, 1.0])
    feeds = {"x": np.zeros((1, 3), np.float32)}
    result = bench.benchmark(runner, feeds, iterations=4, warmup=0, clock=clock)
    result.add_phases(bench.phase_split(runner, feeds, result.iterations))
    lines = result.summary()
    names = [line.split(":")[0] for line in lines]
    assert names[3:7] == ["Enqueue Time", "H2D Latency", "GPU Compute Time", "D2H Latency"]
    d = result.to_dict()
    assert d["phases_ms"]["compute"]["median"] == 1.0 and d["phases_ms"]["h2d"]["mean"] == 0.02
    assert result.warnings() == []  # steady: nothing to say
    assert bench.phase_split(CountingRunner(clock, [0.001]), feeds, 4) is None


def test_unstable_timings_are_warned_about():
    clock = FakeClock()
    # The case: median 0.028 ms, one 208 ms outlier.
    runner = PhasedRunner(clock, [0.000028] * 99 + [0.208], [1.0, 1.2])
    feeds = {"x": np.zeros(1)}
    result = bench.benchmark(runner, feeds, iterations=100, warmup=0, clock=clock)
    result.add_phases(bench.phase_split(runner, feeds, result.iterations))
    text = " ".join(result.warnings())
    assert "GPU compute time is unstable, with coefficient of variance = 9.09%" in text
    assert "latency is unstable" in text and "max 208 ms" in text
    assert result.to_dict()["warnings"] == result.warnings()


def test_batch_that_changes_nothing_is_refused():
    specs = [TensorSpec("x", np.float32, (1, 4))]
    with pytest.raises(AgentError) as err:
        bench.random_feeds(specs, batch=8)
    assert err.value.code == "bad_argument" and "x [1, 4]" in err.value.message
    assert bench.random_feeds(specs, batch=1)["x"].shape == (1, 4)


def test_a_runner_with_only_whole_gpu_timings_gives_one_gpu_row():
    class EventTimed(CountingRunner):  # today's TensorRT runner: time_inference only
        def time_inference(self, iterations, warmup=0, feeds=None):
            return [0.5] * iterations

    clock = FakeClock()
    runner = EventTimed(clock, [0.001])
    result = bench.benchmark(runner, {"x": np.zeros(1)}, iterations=3, warmup=0, clock=clock)
    result.add_phases(bench.phase_split(runner, {"x": np.zeros(1)}, result.iterations))
    assert list(result.phases) == ["gpu"]
    assert any(line.startswith("GPU Time (H2D + compute + D2H): min = 0.5 ms")
               for line in result.summary())


def test_batch_and_shapes_must_agree():
    specs = [TensorSpec("x", np.float32, (None, 4))]
    assert bench.random_feeds(specs, batch=8, shapes={"x": (8, 4)})["x"].shape == (8, 4)
    with pytest.raises(AgentError) as err:
        bench.random_feeds(specs, batch=8, shapes={"x": (2, 4)})
    assert "--batch 8 contradicts --shapes for input 'x'" in err.value.message
