"""Run a precision search against a backend: every candidate goes through the engine cache.

A candidate is a layer as TensorRT sets it (``layer_groups``: nodes folded or fused into one
layer are one candidate, every node of it kept together). One evaluation =
``build_engine(plan.with_layers(keep))`` (a cache hit when that set was built
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

from agent.engines.backends import emulation, layer_precisions, onnx_model
from agent.engines.backends.base import (
    Backend,
    BuildPlan,
    Progress,
    no_progress,
)
from agent.engines.build import EngineRecord, build_engine
from agent.engines.cache import EngineCache
from agent.errors import AgentError
from agent.precision import golden, strategies
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
# Without a ``report`` callback, per-evaluation lines go to this module's log at most once per
# this many seconds (the device worker's log): the skipped ones are counted in the next line.
LOG_EVERY_S = 10.0
Report = Callable[[str], None]
# ``minimal`` ranks only more candidates than this: with so few, shrinking builds each removal
# anyway, and the two instrumented builds cost more than the order they give (Silero VAD's 2).
RANK_MIN = 2


class RateLimitedLog(object):
    """``log.info`` of evaluation lines, at most one per ``interval`` seconds; the last line of
    a search is always written (``flush``)."""

    def __init__(self, interval: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.interval = interval
        self.clock = clock
        self._last: Optional[float] = None
        self._skipped = 0
        self._pending: Optional[str] = None

    def __call__(self, line: str) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.interval:
            self._skipped += 1
            self._pending = line
            return
        self._write(line)
        self._last = now

    def _write(self, line: str) -> None:
        if self._skipped:
            line = "{} ({} more evaluation(s) since the last line)".format(line, self._skipped)
        log.info("%s", line)
        self._skipped, self._pending = 0, None

    def flush(self) -> None:
        if self._pending is not None:
            self._skipped -= 1
            self._write(self._pending)


def evaluation_line(mode: str, index: int, total: int, entry: Dict[str, Any]) -> str:
    """One line per evaluation: layers kept, verdict, time (progress without a terminal)."""
    return "search {}: evaluation {}/{}: {} layer(s) kept -> {} ({:.2f} s{})".format(
        mode, index, total, entry["size"], "pass" if entry["passed"] else "fail",
        entry["seconds"], ", cached" if entry.get("cache_hit") else "")


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
    """Nodes that the plan runs in something other than ``keep_precision`` (keeping the others
    changes nothing), in topological order: every node the build rounds, output nodes and
    type-only nodes (an Identity after an If, a Cast) included."""
    assignment, _, _ = layer_precisions.resolve_precisions(model, plan.precision,
                                                           plan.layer_precisions)
    return [n.name for n in model.graph.node
            if n.name in assignment and assignment[n.name] != keep_precision
            and n.name not in plan.layer_precisions]


def layer_groups(model: Any, nodes: Sequence[str]) -> "OrderedDict[str, List[str]]":
    """The candidates as TensorRT can set them: nodes folded or fused into one layer
    (``emulation.layer_groups``: a BatchNormalization folded into its Conv, a fused
    activation) form one group, named by its first node; each group is one candidate.
    Returns group name -> its nodes, both in topological order."""
    head = emulation.layer_groups(model)
    groups: "OrderedDict[str, List[str]]" = OrderedDict()
    first: Dict[str, str] = {}
    for name in nodes:
        root = head.get(name, name)
        groups.setdefault(first.setdefault(root, name), []).append(name)
    return groups


def out_of_reach(model: Any) -> List[Dict[str, Any]]:
    """Nodes with nested subgraphs (If / Loop / Scan): the search pins top-level nodes only,
    so the nodes inside are out of its reach one by one: they follow their node's precision,
    searched as one layer."""
    found: List[Dict[str, Any]] = []

    def count(graph: Any) -> int:
        total = 0
        for node in graph.node:
            total += 1
            for attr in node.attribute:
                for g in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                    total += count(g)
        return total

    for node in model.graph.node:
        graphs = [a.g for a in node.attribute if a.HasField("g")] + \
            [g for a in node.attribute for g in a.graphs]
        if graphs:
            found.append(OrderedDict([("node", node.name), ("op", node.op_type),
                                      ("nodes_inside", sum(count(g) for g in graphs))]))
    return found


def _unreachable_text(reach: List[Dict[str, Any]], pinned: List[str]) -> str:
    parts = []
    if reach:
        parts.append("out of the search's reach one by one (searched as one layer): the nodes "
                     "inside {}".format(", ".join(
            "{} {!r} ({} nodes)".format(r["op"], r["node"], r["nodes_inside"])
            for r in reach[:5])))
    if pinned:
        parts.append("pinned by --layer-precisions to reduced precision, so never offered: "
                     "{}".format(", ".join(pinned[:8])))
    return "; ".join(parts)


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
    report: Optional[Report] = None,
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
    goldens do not fit the model's outputs. ``report``: called with one line per evaluation
    (layers kept, verdict, time); default: this module's log, rate-limited
    (``LOG_EVERY_S``)."""
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
    groups = layer_groups(model, _candidates(model, plan, keep_precision))
    layers = list(groups)  # one candidate per group, named by its first node
    group_of = {node: name for name, members in groups.items() for node in members}
    result.candidates = len(layers)
    result.candidate_nodes = len(group_of)

    def nodes(keep: Sequence[str]) -> List[str]:
        """The ONNX nodes of the groups ``keep`` (topological order)."""
        return [node for name in keep for node in groups[name]]

    result.out_of_reach = out_of_reach(model)
    limited = RateLimitedLog() if report is None else None
    # The total shown before the search exists (the check, the pre-flight build).
    first_total = max_evaluations or (strategies.default_budget(len(layers))
                                      if mode == "minimal" else 1)
    say: Report = report if report is not None else limited  # type: ignore[assignment]
    build_progress = _quiet_builds(progress)

    def build(p: BuildPlan) -> EngineRecord:
        record = build_engine(model_path, p, backend, cache, platform_fingerprint,
                              build_progress, calibration_dir=calibration_dir)
        result.builds += 1
        result.cache_hits += int(record.cache_hit)
        return record

    scores: List[scoring.LayerScore] = []
    search: Optional[Search] = None
    kept: List[str] = []  # the groups of the answer
    comparisons: Dict[frozenset, Comparison] = {}

    def evaluate(keep: List[str], index: int) -> Tuple[Comparison, Dict[str, Any]]:
        t0 = time.monotonic()
        record = build(plan.with_layers(nodes(keep), keep_precision))
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
            entry["keep"] = nodes(keep)
        result.iterations.append(entry)
        say(evaluation_line(mode, index, search.total if search is not None else first_total,
                            entry))
        return cmp, entry

    try:
        if predicted is not None:
            # Pre-flight: the set the host predicted, verified with one build; the search
            # runs only when it fails.
            if not isinstance(predicted, (list, tuple)) or len(predicted) > len(group_of) or \
                    not all(isinstance(x, str) for x in predicted):
                raise AgentError("bad_argument", "the predicted set must be a list of at most "
                                 "{} layer names, found {}".format(
                                     len(group_of), type(predicted).__name__))
            unknown = sorted(set(predicted) - set(group_of))
            if unknown:
                raise AgentError("unknown_layer", "the predicted set names {} that are not "
                                 "candidate layers of this model".format(", ".join(unknown[:5])))
            order = {name: i for i, name in enumerate(layers)}
            keep0 = sorted(set(group_of[x] for x in predicted), key=lambda x: order[x])
            progress("verifying", 0, 1)
            cmp0, _ = evaluate(keep0, 1)
            progress("verifying", 1, 1)
            result.predicted = nodes(keep0)
            result.prediction_passed = cmp0.passed
            if cmp0.passed:
                result.evaluations = 1
                result.complete = result.passed = True
                kept = keep0
                raise _Verified()
        prior: List[Tuple[frozenset, bool, Dict[str, Any]]] = []
        if result.predicted is not None:  # it failed: the search never builds it again
            prior.append((frozenset(keep0), False, result.iterations[-1]))
        if layers and result.predicted != []:
            # Check first: the plan as asked (nothing kept), before any instrumented build
            # (at int8 this build calibrates once; every later one reuses the cache).
            progress("checking", 0, 1)
            cmp_e, entry_e = evaluate([], 1 + len(result.iterations))
            progress("checking", 1, 1)
            prior.append((frozenset(), cmp_e.passed, entry_e))
        ranking: Optional[List[str]] = None
        if any(p[1] for p in prior):
            pass  # it passes as asked: nothing to rank
        elif layers and (mode == "worst-first" or (
                mode == "minimal" and instrument and len(layers) > RANK_MIN)):
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
                scores = scoring.instrumented_ranking(model, groups, plan, inputs, build,
                                                      backend, keep_precision)
                scoring.save_ranking(cached_path, scores)
                progress("instrumenting", 2, 2)
            ranking = [s.name for s in scores]
            result.suspects = scoring.count_suspects(scores)
        result.ranking = ranking or []
        search = Search(layers, mode=mode, direction=direction, ranking=ranking,
                        suspects=result.suspects, max_evaluations=max_evaluations, prior=prior)
        result.budget = search.budget.limit if search.budget.cap else search.max_evaluations
        result.budget_cap = search.budget.cap
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
                    pinned = [n for n, p in plan.layer_precisions.items() if p != keep_precision]
                    extra = _unreachable_text(result.out_of_reach, pinned)
                    raise AgentError("reference_mismatch", "{}; with all kept: {}{}".format(
                        exc.message, describe_needs(cmp),
                        "; " + extra if extra else ""),
                        {"comparison": cmp.to_dict()["outputs"],
                         "out_of_reach": result.out_of_reach, "pinned": pinned})
                raise
            progress("searching", search.evaluations, search.total)
    except KeyboardInterrupt:
        result.interrupted = True
    except _Verified:
        pass

    if search is not None:
        result.evaluations = search.evaluations
        result.complete = search.complete and not result.interrupted
        result.one_minimal = search.one_minimal and not result.interrupted
        result.untested_removals = search.untested_removals
        result.exhausted = search.exhausted
        result.budget_extended = search.budget.extended
        best = search.best()
        kept = best if best is not None else []
        result.passed = best is not None
    result.keep, result.layers_kept = nodes(kept), len(kept)
    result.groups = OrderedDict((name, groups[name]) for name in kept if len(groups[name]) > 1)
    result.sensitivity = sensitivity_table(scores, layers, kept, comparisons, mode)
    if result.passed:
        # The found set was evaluated, so this is a cache hit; it pins the answer's engine.
        try:
            record = build(plan.with_layers(result.keep, keep_precision))
            result.engine_key, result.engine_path = record.key, record.engine_path
        except KeyboardInterrupt:
            result.interrupted = True
        result.comparison = comparisons.get(frozenset(kept))
    result.message = result_message(result)
    if limited is not None:
        limited.flush()
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
