"""Run a precision search against a backend: every candidate goes through the engine cache.

One evaluation = ``build_engine(plan.with_layers(keep))`` (a cache hit when that set was built
before, by this search or an earlier one), run every input iteration, compare with the goldens
(``agent.precision.compare``). ``minimal`` and ``worst-first`` first build two instrumented engines
(every float tensor marked as an output, ``"*"``): the plan with every candidate kept in higher
precision, and the plan as asked; ``ranking.instrumented_ranking`` turns their tensors into the
ranking and the per-layer sensitivity table (cached by ``ranking.ranking_key``). INT8 builds
share one calibration cache (``build_engine`` defaults it), so calibration runs once per
search. What it returns, and the sensitivity table and message in it, is ``search_result``.

The search can be stopped (``should_stop()`` returns True, or KeyboardInterrupt): the result
then holds what was found so far, flagged ``interrupted``; every engine it published is whole
(the cache publishes atomically). The platform fingerprint is passed in: this module is worker
side (Python 3.6) and never imports ``agent.platform``.
"""

import logging
import os
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.engines.backends import layer_precisions, onnx_model
from agent.engines.backends.base import (
    Backend,
    BuildPlan,
    Progress,
    no_progress,
)
from agent.engines.build import EngineRecord, build_engine
from agent.engines.cache import EngineCache
from agent.errors import AgentError
from agent.precision import golden
from agent.precision import ranking as scoring
from agent.precision.compare import compare_outputs
from agent.precision.comparison import Comparison
from agent.precision.search import Search, check_mode
from agent.precision.search_result import (
    SearchResult,
    describe_needs,
    output_stats,
    result_message,
    sensitivity_table,
)

log = logging.getLogger(__name__)

Feed = Dict[str, np.ndarray]
# Iteration logs list the kept layers when there are at most this many (else only the size).
LOG_KEEP_MAX = 64


class _Verified(Exception):
    """The pre-flight prediction passed: no search needed."""


def _quiet_builds(progress: Progress) -> Progress:
    """Pass calibration progress through (it is long); per-candidate build steps are not."""
    def forward(stage: str, done: int, total: int) -> None:
        if stage == "calibrating":
            progress(stage, done, total)
    return forward


def _run(backend: Backend, record: EngineRecord, inputs: Sequence[Feed]) -> List[Feed]:
    with backend.open(record.engine_path) as runner:
        return [runner.infer(dict(feed)) for feed in inputs]


def _candidates(model: Any, plan: BuildPlan, keep_precision: str) -> List[str]:
    """Float nodes that the plan runs in something other than ``keep_precision`` (keeping the
    others changes nothing), in topological order."""
    assignment, _, _ = layer_precisions.resolve_precisions(model, plan.precision,
                                                           plan.layer_precisions)
    return [name for name in layer_precisions.float_nodes(model)
            if assignment.get(name, keep_precision) != keep_precision
            and name not in plan.layer_precisions]


def run_search(
    model_path: str,
    plan: BuildPlan,
    inputs: Sequence[Feed],
    goldens: Sequence[Feed],
    backend: Backend,
    cache: EngineCache,
    platform_fingerprint: Dict[str, str],
    mode: str = "minimal",
    direction: str = "forward",
    compare_options: Optional[Dict[str, Any]] = None,
    progress: Progress = no_progress,
    should_stop: Optional[Callable[[], bool]] = None,
    max_evaluations: Optional[int] = None,
    keep_precision: str = "float32",
    calibration_dir: Optional[str] = None,
    instrument: bool = True,
    ranking_dir: Optional[str] = None,
    predicted: Optional[Sequence[str]] = None,
) -> SearchResult:
    """Search which layers of ``model_path`` must run in ``keep_precision`` for ``plan`` (fp16,
    int8, or best = int8 with fp16 fallback) to pass the goldens.

    ``compare_options``: keyword arguments of ``compare.compare_outputs`` (atol, rtol,
    check_error_stat, error_quantile, infinities_compare_equal). ``max_evaluations`` caps the
    number of candidate builds (the result is then partial, ``exhausted``). ``instrument``
    False skips the two instrumented builds: ``minimal`` then works from topological order
    without suspects (``worst-first`` needs them). The ranking is cached by (model, plan,
    inputs, backend) under ``ranking_dir`` (default: beside ``calibration_dir``), so a
    repeated search skips the instrumented runs. ``predicted`` (pre-flight, ``preflight``): a
    set to verify first with one build; the search runs only when it fails. Raises
    ``reference_mismatch`` when even every candidate kept fails, ``golden_mismatch`` when the
    goldens do not fit the model's outputs."""
    started = time.monotonic()
    check_mode(mode, direction)
    if plan.precision == "fp32":
        raise AgentError("bad_argument", "a precision search needs a reduced precision "
                         "(fp16, int8 or best), found fp32")
    if len(inputs) != len(goldens):
        raise AgentError("golden_mismatch", "expected one golden iteration per input iteration "
                         "({}), found {}".format(len(inputs), len(goldens)))
    opts = dict(compare_options or {})
    model = onnx_model.load_model(model_path)
    # Fail fast on inputs, goldens and tolerances that do not fit, before any build.
    golden.validate_inputs(inputs, onnx_model.input_specs(model))
    golden.validate_goldens(goldens, onnx_model.output_specs(model), len(inputs))
    compare_outputs(list(goldens), list(goldens), **opts)
    stop = should_stop or (lambda: False)
    result = SearchResult()
    result.model = model_path
    result.mode, result.direction = mode, direction
    result.precision, result.keep_precision = plan.precision, keep_precision
    layers = _candidates(model, plan, keep_precision)
    result.candidates = len(layers)
    build_progress = _quiet_builds(progress)

    def build(p: BuildPlan) -> EngineRecord:
        record = build_engine(model_path, p, backend, cache, platform_fingerprint,
                              build_progress, calibration_dir=calibration_dir)
        result.builds += 1
        result.cache_hits += int(record.cache_hit)
        return record

    scores: List[scoring.LayerScore] = []
    search: Optional[Search] = None
    comparisons: Dict[frozenset, Comparison] = {}

    def evaluate(keep: List[str], index: int) -> Tuple[Comparison, Dict[str, Any]]:
        t0 = time.monotonic()
        record = build(plan.with_layers(keep, keep_precision))
        build_seconds = time.monotonic() - t0
        outputs = _run(backend, record, inputs)
        cmp = compare_outputs(outputs, list(goldens), **opts)
        comparisons[frozenset(keep)] = cmp
        entry: Dict[str, Any] = OrderedDict([
            ("index", index),
            ("size", len(keep)),
            ("passed", cmp.passed),
            ("seconds", round(time.monotonic() - t0, 3)),
            ("build_seconds", round(build_seconds, 3)),
            ("cache_hit", record.cache_hit),
            ("engine_key", record.key),
            ("stats", output_stats(cmp)),
        ])
        if len(keep) <= LOG_KEEP_MAX:
            entry["keep"] = list(keep)
        result.iterations.append(entry)
        log.info("search %s: %d layer(s) kept -> %s (%.2f s%s)", mode, len(keep),
                 "pass" if cmp.passed else "fail", entry["seconds"],
                 ", cached" if record.cache_hit else "")
        return cmp, entry

    try:
        if predicted is not None:
            # Pre-flight: the set the host predicted, verified with one build; the search
            # runs only when it fails.
            if not isinstance(predicted, (list, tuple)) or len(predicted) > len(layers) or \
                    not all(isinstance(x, str) for x in predicted):
                raise AgentError("bad_argument", "the predicted set must be a list of at most "
                                 "{} layer names, found {}".format(
                                     len(layers), type(predicted).__name__))
            unknown = sorted(set(predicted) - set(layers))
            if unknown:
                raise AgentError("unknown_layer", "the predicted set names {} that are not "
                                 "candidate layers of this model".format(", ".join(unknown[:5])))
            order = {name: i for i, name in enumerate(layers)}
            keep0 = sorted(set(predicted), key=lambda x: order[x])
            progress("verifying", 0, 1)
            cmp0, _ = evaluate(keep0, 1)
            progress("verifying", 1, 1)
            result.predicted = keep0
            result.prediction_passed = cmp0.passed
            if cmp0.passed:
                result.evaluations = 1
                result.complete = result.passed = True
                result.keep = keep0
                raise _Verified()
        ranking: Optional[List[str]] = None
        if (mode == "worst-first" or (mode == "minimal" and instrument)) and layers:
            if ranking_dir is None and calibration_dir:
                ranking_dir = os.path.join(os.path.dirname(calibration_dir), "rankings")
            cached_path = os.path.join(ranking_dir, scoring.ranking_key(
                model, plan, inputs, keep_precision, platform_fingerprint, backend) + ".json"
            ) if ranking_dir else None
            loaded = scoring.load_ranking(cached_path, layers)
            if loaded is not None:
                scores = loaded
                result.ranking_cached = True
            else:
                progress("instrumenting", 0, 2)
                scores = scoring.instrumented_ranking(model, layers, plan, inputs, build, backend,
                                               keep_precision)
                scoring.save_ranking(cached_path, scores)
                progress("instrumenting", 2, 2)
            ranking = [s.name for s in scores]
            result.suspects = scoring.count_suspects(scores)
        result.ranking = ranking or []
        search = Search(layers, mode=mode, direction=direction, ranking=ranking,
                                   suspects=result.suspects, max_evaluations=max_evaluations)
        result.budget = search.max_evaluations
        progress("searching", 0, search.total)
        while not search.done:
            if stop():
                result.interrupted = True
                break
            keep = search.propose() or []
            cmp, entry = evaluate(keep, search.evaluations + 1)
            try:
                search.observe(cmp.passed, entry)
            except AgentError as exc:
                if exc.code == "reference_mismatch":
                    raise AgentError("reference_mismatch", "{}; with all kept: {}".format(
                        exc.message, describe_needs(cmp)), {"comparison": cmp.to_dict()["outputs"]})
                raise
            progress("searching", search.evaluations, search.total)
    except KeyboardInterrupt:
        result.interrupted = True
    except _Verified:
        pass

    if search is not None:
        result.evaluations = search.evaluations + (1 if result.predicted is not None else 0)
        result.complete = search.complete and not result.interrupted
        result.one_minimal = search.one_minimal and not result.interrupted
        result.exhausted = search.exhausted
        best = search.best()
        result.keep = best if best is not None else []
        result.passed = best is not None
    result.sensitivity = sensitivity_table(scores, layers, result.keep, comparisons, mode)
    if result.passed:
        # The found set was evaluated, so this is a cache hit; it pins the answer's engine.
        try:
            record = build(plan.with_layers(result.keep, keep_precision))
            result.engine_key, result.engine_path = record.key, record.engine_path
        except KeyboardInterrupt:
            result.interrupted = True
        result.comparison = comparisons.get(frozenset(result.keep))
    result.message = result_message(result)
    result.seconds = time.monotonic() - started
    progress("searching", result.evaluations, result.evaluations)
    return result


def preflight(model_path: str, plan: BuildPlan, inputs: Sequence[Feed],
              goldens: Sequence[Feed], cache: EngineCache, platform_fingerprint: Dict[str, str],
              **kwargs: Any) -> SearchResult:
    """Host pre-flight: the same search on the host emulation (onnxruntime backend, which
    emulates TensorRT's build-time rewrites). Its ``keep`` is the ``predicted`` set a device
    search verifies with one build (``run_search(..., predicted=result.keep)``) before
    searching itself. ``kwargs``: those of ``run_search`` (mode, compare_options, ...)."""
    from agent.engines.backends.base import get_backend

    host = get_backend("onnxruntime")
    return run_search(model_path, plan, inputs, goldens, host, cache, platform_fingerprint,
                      **kwargs)
