"""Latency and throughput of a Runner, reported the way trtexec does.

Latency percentiles use the nearest-rank rule trtexec uses (the p-th percentile of n sorted
samples is the ceil(p/100*n)-th one; the median averages the two middle samples of an even
count). Throughput is inferences completed over the wall time of the timed loop (not 1/mean),
and samples/s multiplies by the batch. Pure measurement: nothing is printed here.

Like trtexec, the loop runs a warm-up of at least ``warmup_seconds`` (and ``warmup``
iterations), then at least ``iterations`` and at least ``duration`` seconds. A runner that can
time the phases of one inference (the TensorRT runner, with CUDA events) offers
``time_phases(iterations, feeds) -> [{"enqueue": ms, "h2d": ms, "compute": ms, "d2h": ms}]``;
``phase_split`` turns that into trtexec's Enqueue Time / H2D Latency / GPU Compute Time / D2H
Latency statistics. A runner with only ``time_inference(iterations, warmup, feeds)`` (CUDA
events around copies and execution together) gives one "GPU Time" row. A high coefficient of
variation (stddev / mean) becomes a warning, as trtexec warns about unstable GPU compute time.

Worker side: Python >= 3.6.
"""

import functools
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from agent.errors import AgentError

PERCENTILES = (90, 95, 99)
# trtexec's defaults: --warmUp=200 (ms), --duration=3 (s), --iterations=10 (at least).
DEFAULT_WARMUP_S = 0.2
DEFAULT_DURATION_S = 3.0
DEFAULT_ITERATIONS = 10
# (key in time_phases' dicts, trtexec's name), in trtexec's order.
PHASES = (("enqueue", "Enqueue Time"), ("h2d", "H2D Latency"),
          ("compute", "GPU Compute Time"), ("d2h", "D2H Latency"),
          ("gpu", "GPU Time (H2D + compute + D2H)"))
# Coefficient of variation above which a timing is called unstable: trtexec's 1 % for GPU
# compute time (device time of one kernel sequence); host latency includes Python and the OS
# scheduler, so it gets 10 %.
UNSTABLE_COV_GPU = 0.01
UNSTABLE_COV_HOST = 0.10


def percentile(sorted_ms: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending sequence (trtexec's rule)."""
    if not sorted_ms:
        raise ValueError("no samples")
    if not 0 <= pct <= 100:
        raise ValueError("percentile must be in [0, 100], found {}".format(pct))
    rank = int(math.ceil(pct / 100.0 * len(sorted_ms) - 1e-9))  # guard 0.9*100 = 90.0000001
    return float(sorted_ms[min(max(rank, 1), len(sorted_ms)) - 1])


def median(sorted_ms: Sequence[float]) -> float:
    n = len(sorted_ms)
    if not n:
        raise ValueError("no samples")
    mid = n // 2
    if n % 2:
        return float(sorted_ms[mid])
    return (float(sorted_ms[mid - 1]) + float(sorted_ms[mid])) / 2.0


class LatencyStats(object):
    """min / max / mean / median / p90 / p95 / p99 of a list of latencies in ms."""

    def __init__(self, samples_ms: Sequence[float]) -> None:
        ordered = sorted(float(x) for x in samples_ms)
        if not ordered:
            raise ValueError("no samples")
        self.count = len(ordered)
        self.min = ordered[0]
        self.max = ordered[-1]
        self.mean = sum(ordered) / len(ordered)
        self.stddev = math.sqrt(sum((x - self.mean) ** 2 for x in ordered) / len(ordered))
        self.median = median(ordered)
        self.percentiles = {p: percentile(ordered, p) for p in PERCENTILES}

    @property
    def cov(self) -> float:
        """Coefficient of variation: stddev / mean (0 for a zero mean)."""
        return self.stddev / self.mean if self.mean > 0 else 0.0

    def to_dict(self) -> Dict[str, float]:
        out = {"min": self.min, "max": self.max, "mean": self.mean, "median": self.median,
               "stddev": self.stddev, "cov": self.cov}
        for p, value in self.percentiles.items():
            out["p{}".format(p)] = value
        return {k: round(v, 6) for k, v in out.items()}


class BenchResult(object):
    """What ``benchmark`` measured."""

    def __init__(self, latencies_ms: Sequence[float], wall_seconds: float, batch: int,
                 warmup: int, warmup_seconds: float = 0.0) -> None:
        self.latencies_ms = list(latencies_ms)
        self.latency = LatencyStats(self.latencies_ms)
        self.iterations = len(self.latencies_ms)
        self.wall_seconds = wall_seconds
        self.batch = batch
        self.warmup = warmup
        self.warmup_seconds = warmup_seconds
        self.phases = {}  # type: Dict[str, LatencyStats]

    def add_phases(self, rows: Sequence[Dict[str, float]]) -> None:
        """trtexec's per-phase statistics from ``time_phases`` rows (phases a row lacks are
        left out)."""
        for key, _ in PHASES:
            values = [float(r[key]) for r in rows if r.get(key) is not None]
            if values:
                self.phases[key] = LatencyStats(values)

    def warnings(self) -> List[str]:
        """Unstable timings, in trtexec's words where it has them."""
        out = []
        gpu = self.phases.get("compute") or self.phases.get("gpu")
        if gpu is not None and gpu.cov > UNSTABLE_COV_GPU:
            out.append("GPU compute time is unstable, with coefficient of variance = {:.3g}%; "
                       "lock the clocks (sudo jetson_clocks) and stop other GPU work".format(
                           gpu.cov * 100))
        lat = self.latency
        if lat.cov > UNSTABLE_COV_HOST:
            out.append("latency is unstable, with coefficient of variance = {:.3g}% (median "
                       "{:.4g} ms, max {:.4g} ms): other load on this machine, or too few "
                       "iterations; the percentiles are more telling than the mean".format(
                           lat.cov * 100, lat.median, lat.max))
        enq = self.phases.get("enqueue")
        if gpu is not None and enq is not None and enq.median > gpu.median:
            out.append("throughput may be bound by enqueue time rather than GPU compute "
                       "(median {:.4g} ms vs {:.4g} ms)".format(enq.median, gpu.median))
        return out

    @property
    def inferences_per_second(self) -> float:
        return self.iterations / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def samples_per_second(self) -> float:
        return self.inferences_per_second * self.batch

    def to_dict(self) -> Dict[str, Any]:
        return {
            "iterations": self.iterations,
            "warmup": self.warmup,
            "warmup_seconds": round(self.warmup_seconds, 6),
            "batch": self.batch,
            "phases_ms": {k: v.to_dict() for k, v in self.phases.items()},
            "warnings": self.warnings(),
            "wall_seconds": round(self.wall_seconds, 6),
            "latency_ms": self.latency.to_dict(),
            "throughput": {
                "inferences_per_second": round(self.inferences_per_second, 3),
                "samples_per_second": round(self.samples_per_second, 3),
            },
        }

    def summary(self) -> List[str]:
        """trtexec's "Performance summary" lines (for the CLI to print)."""
        lat = self.latency
        pcts = ", ".join("percentile({}%) = {:.6g} ms".format(p, v)
                         for p, v in lat.percentiles.items())
        lines = [
            "=== Performance summary ===",
            "Throughput: {:.6g} qps ({:.6g} samples/s at batch {})".format(
                self.inferences_per_second, self.samples_per_second, self.batch),
            "Latency: min = {:.6g} ms, max = {:.6g} ms, mean = {:.6g} ms, median = {:.6g} ms, "
            "{}".format(lat.min, lat.max, lat.mean, lat.median, pcts),
        ]
        for key, name in PHASES:
            st = self.phases.get(key)
            if st is not None:
                lines.append("{}: min = {:.6g} ms, max = {:.6g} ms, mean = {:.6g} ms, median = "
                             "{:.6g} ms, percentile(99%) = {:.6g} ms".format(
                                 name, st.min, st.max, st.mean, st.median, st.percentiles[99]))
        lines.append("Total Host Walltime: {:.6g} s ({} iterations after {} warm-up "
                     "iterations in {:.3g} s)".format(self.wall_seconds, self.iterations,
                                                      self.warmup, self.warmup_seconds))
        return lines


def batch_of(feeds: Dict[str, np.ndarray]) -> int:
    """The leading dimension of the first input (1 for scalars)."""
    for name in sorted(feeds):
        shape = np.shape(feeds[name])
        return int(shape[0]) if shape else 1
    return 1


def check_settings(iterations: int, warmup: int, duration: Optional[float] = None,
                   batch: int = 1, warmup_seconds: float = 0.0) -> None:
    """Reject bad loop settings before any build work."""
    if iterations < 1:
        raise AgentError("bad_argument", "--iterations must be >= 1, found {}".format(iterations))
    if warmup < 0:
        raise AgentError("bad_argument", "warm-up iterations must be >= 0, found {}".format(
            warmup))
    if warmup_seconds < 0:
        raise AgentError("bad_argument", "--warm-up must be >= 0 s, found {}".format(
            warmup_seconds))
    if duration is not None and duration < 0:
        raise AgentError("bad_argument", "--duration must be >= 0 s, found {}".format(duration))
    if batch < 1:
        raise AgentError("bad_argument", "--batch must be >= 1, found {}".format(batch))


def benchmark(
    runner: Any,
    feeds: Dict[str, np.ndarray],
    iterations: int = 100,
    warmup: int = 10,
    duration: Optional[float] = None,
    clock: Callable[[], float] = time.perf_counter,
    warmup_seconds: float = 0.0,
) -> BenchResult:
    """Run ``runner.infer(feeds)`` untimed ``warmup`` times and for ``warmup_seconds`` (like
    trtexec's --warmUp), then at least ``iterations`` times and (like trtexec's --duration) for
    at least ``duration`` seconds, timing each call."""
    check_settings(iterations, warmup, duration, 1, warmup_seconds)
    bind = getattr(runner, "bind", None)
    infer = bind(feeds) if bind else functools.partial(runner.infer, feeds)
    warm_start = clock()
    for _ in range(warmup):
        infer()
    warmed = warmup
    while warmup_seconds and clock() - warm_start < warmup_seconds:
        infer()
        warmed += 1
    warm_time = clock() - warm_start
    # Only completion times are recorded in the loop (one clock read per call); latencies are
    # the differences, taken afterwards.
    stamps: List[float] = []
    append = stamps.append
    start = clock()
    for _ in range(iterations):
        infer()
        append(clock())
    if duration:
        end_by = start + duration
        while stamps[-1] < end_by:
            infer()
            append(clock())
    latencies = [b - a for a, b in zip([start] + stamps[:-1], stamps)]
    wall = stamps[-1] - start
    return BenchResult([x * 1000.0 for x in latencies], wall, batch_of(feeds), warmed,
                       warm_time)


def phase_split(runner: Any, feeds: Dict[str, np.ndarray], iterations: int
                ) -> Optional[List[Dict[str, float]]]:
    """The runner's per-phase times (see the module docstring), or None when it has none."""
    fn = getattr(runner, "time_phases", None)
    if fn is not None:
        return list(fn(iterations, feeds))
    whole = getattr(runner, "time_inference", None)
    if whole is not None:
        return [{"gpu": float(ms)} for ms in whole(iterations, 0, feeds)]
    return None


def _concrete_shape(name: str, shape: Sequence[Any], batch: int) -> List[int]:
    dims = []
    for i, dim in enumerate(shape):
        if isinstance(dim, int) and dim >= 0:
            dims.append(dim)
        elif i == 0:
            dims.append(batch)
        else:
            raise AgentError(
                "dynamic_shape",
                "input {!r} has dynamic dimension {} (shape {}); only the leading (batch) "
                "dimension can be chosen by --batch: give the shape explicitly".format(
                    name, i, list(shape)))
    return dims


def random_feeds(
    input_specs: Sequence[Any],
    batch: int = 1,
    seed: int = 0,
    shapes: Optional[Dict[str, Sequence[int]]] = None,
) -> Dict[str, np.ndarray]:
    """Random inputs for TensorSpecs: floats uniform in [0, 1) (Polygraphy's default value
    range), integers in [0, 10), booleans. A dynamic leading dimension becomes ``batch``;
    ``shapes`` gives full shapes for inputs with other dynamic dimensions."""
    check_settings(1, 0, None, batch)
    rng = np.random.RandomState(seed)
    feeds = {}
    batch_used = False
    for spec in input_specs:
        if shapes and spec.name in shapes:
            dims = [int(d) for d in shapes[spec.name]]
            if batch != 1 and dims and dims[0] != batch:
                raise AgentError("bad_argument", "--batch {} contradicts --shapes for input {!r} "
                                 "(leading dimension {}): give one or the other".format(
                                     batch, spec.name, dims[0]))
            batch_used = batch_used or (batch != 1 and bool(dims))
        else:
            dims = _concrete_shape(spec.name, spec.shape, batch)
            batch_used = batch_used or not _is_static(spec.shape[:1])
        dtype = np.dtype(spec.dtype)
        if dtype.kind == "f":
            value = rng.random_sample(dims).astype(dtype)
        elif dtype.kind in "iu":
            value = rng.randint(0, 10, size=dims).astype(dtype)
        elif dtype.kind == "b":
            value = rng.randint(0, 2, size=dims).astype(bool)
        else:
            raise AgentError("unsupported_model", "input {!r} has dtype {}; random inputs are "
                             "made for float, integer and bool inputs".format(spec.name, dtype))
        feeds[spec.name] = np.ascontiguousarray(value)
    if batch != 1 and not batch_used:
        # A --batch that changes nothing would report numbers for another batch than asked.
        raise AgentError(
            "bad_argument",
            "--batch {} cannot apply: no input has a dynamic leading dimension ({}); export "
            "the model with a dynamic batch dimension, or leave --batch out".format(
                batch, ", ".join("{} {}".format(s.name, list(s.shape)) for s in input_specs)))
    return feeds


def _is_static(dims: Sequence[Any]) -> bool:
    return all(isinstance(d, int) and d >= 0 for d in dims)
