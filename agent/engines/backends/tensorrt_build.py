"""One TensorRT build, step by step: load (and name) the ONNX model, rewrite its precision into
the graph (strongly typed TensorRT), parse, configure, calibrate INT8 (a calibrator, a cache, or
ranges measured on the device), build, read back what the engine inspector says, write. What to
ask each TensorRT version for is ``tensorrt_plan``'s; ``tensorrt.TensorRTBackend.build`` runs
one ``Build``. TensorRT is imported lazily. Worker side: Python >= 3.6.
"""

import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

from agent.engines.backends.base import (
    BuildPlan,
    BuildResult,
    CalibrationSettings,
    Progress,
    TensorSpec,
    no_progress,
)
from agent.engines.backends.tensorrt_caches import (
    TimingCache,
    existing_calibration_cache,
    timing_cache_path,
)
from agent.engines.backends.tensorrt_inspect import (
    dla_nodes,
    node_precisions,
    parser_error,
    precision_mismatches,
)
from agent.engines.backends.tensorrt_network import (
    _make_logger,
    _network_inputs,
    _set_dynamic_ranges,
    _set_profile_shape,
    _write_dla_core,
    apply_layer_precisions,
    dla_placement,
    inspect_engine,
    mark_layerwise,
    register_plugins,
    write_platform,
    write_plugins,
)
from agent.engines.backends.tensorrt_plan import (
    apply_builder_settings,
    builder_settings,
    cap_build_memory,
    check_dla_cores,
    check_dla_profile,
    network_creation_flags,
    parse_version,
    plan_floor,
)
from agent.engines.backends.tensorrt_progress import make_monitor
from agent.engines.backends.tensorrt_runner import TensorRTRunner
from agent.engines.backends.tensorrt_shapes import (
    ProfileShapes,
    calibration_shapes,
    profile_shapes,
    range_profile,
)
from agent.errors import AgentError
from agent.fsio import atomic_write

if TYPE_CHECKING:  # the stubs (scripts/lib/trt_stubs.py): mypy checks our calls against them
    import tensorrt

    from agent.engines.backends.tensorrt import TensorRTBackend


class _Network(object):
    """A parsed network and its inputs."""

    def __init__(self, builder: "tensorrt.Builder", network: "tensorrt.INetworkDefinition",
                 parser: "tensorrt.OnnxParser", inputs: List[TensorSpec]) -> None:
        self.builder = builder
        self.network = network
        self.parser = parser  # keeps the parsed weights alive until the build is done
        self.inputs = inputs


class Build(object):
    """One build: load, (rewrite,) parse, configure, calibrate, build, inspect, write."""

    def __init__(self, backend: "TensorRTBackend", ctx: Any, model_path: str, plan: BuildPlan,
                 engine_path: str, progress: Progress) -> None:
        self.backend = backend
        self.ctx = ctx
        self.model_path = model_path
        self.plan = plan
        self.engine_path = engine_path
        self.progress = progress
        self.version_text = backend.version()
        self.version = parse_version(self.version_text)
        self.settings = builder_settings(plan, self.version)
        self.logger = _make_logger()
        self.log_mark = self.logger.mark()  # this build's messages start here
        self.details: Dict[str, Any] = {"trt_version": self.version_text,
                                        "strongly_typed": self.settings.strongly_typed,
                                        "flags": list(self.settings.set_flags),
                                        "notes": list(self.settings.notes)}
        self.calibrated = False
        self.calibration_cache: Optional[str] = None
        self.calibrator: Any = None
        self.graph_mismatches: List[Tuple[str, str, str]] = []
        self.graph_assignment: Dict[str, str] = {}
        self.quantization = "none"  # the model's (set when it is loaded)
        self.int8_layers: Set[str] = set()  # a Q/DQ model's: its pairs decide them

    # ONNX side --------------------------------------------------------------------------

    def _load_model(self) -> Tuple[Any, List[str]]:
        from agent.engines.backends import onnx_model, quantization

        model = onnx_model.load_model(self.model_path)  # names unnamed nodes, as the plan does
        self.quantization = quantization.quantization(model)
        self.details["quantization"] = self.quantization
        if self.quantization != "none":
            # Q/DQ: never calibrated; weakly typed, the INT8 flag whatever the precision.
            self.int8_layers = quantization.int8_layers(model)
            self.settings = builder_settings(self.plan, self.version, self.quantization)
            self.details.update(flags=list(self.settings.set_flags),
                                notes=list(self.settings.notes))
        order = [str(n.name) for n in model.graph.node]
        unknown = sorted(set(self.plan.layer_precisions) - set(order))
        if unknown:
            raise AgentError(
                "unknown_layer",
                "--layer-precisions names {} but the model has no such node (expected ONNX "
                "node names such as {})".format(
                    ", ".join(repr(u) for u in unknown), ", ".join(order[:5]) or "none"),
                {"unknown": unknown})
        return model, order

    def _parse(self, model: Any) -> _Network:
        import tensorrt as trt

        # Standard plugins and the plan's libraries, before the parser looks for their ops.
        register_plugins(trt, self.logger, self.plan.plugins)
        builder = trt.Builder(self.logger)
        network = builder.create_network(network_creation_flags(trt, self.settings))
        parser = trt.OnnxParser(network, self.logger)
        # The model's folder lets the parser find external weights the model still names.
        if not parser.parse(model.SerializeToString(), self.model_path):
            errors = []
            for i in range(parser.num_errors):
                err = parser.get_error(i)
                node = err.node_name() if hasattr(err, "node_name") else str(err.node())
                errors.append((str(err.code()).split(".")[-1], str(err.desc()),
                               "" if node in ("-1", "") else node))
            raise parser_error(errors, self.model_path)
        return _Network(builder, network, parser, _network_inputs(network))

    # build ------------------------------------------------------------------------------

    def _config(self, net: _Network, profile: ProfileShapes) -> "tensorrt.IBuilderConfig":
        import tensorrt as trt

        # The DLA core asked for must exist on this device (TensorRT says how many).
        check_dla_cores(self.settings.dla_core,
                        int(getattr(net.builder, "num_DLA_cores", 0) or 0),
                        self.backend.features, self.version_text)
        if self.quantization != "none" and \
                getattr(net.builder, "platform_has_fast_int8", True) is False:
            # The pairs run in INT8 or not at all (Nano, TX1, TX2: support_matrix.yaml).
            raise AgentError(
                "unsupported_precision",
                "{} is quantized already (Q/DQ, {}): its layers run in INT8, and TensorRT {} "
                "reports no fast INT8 on this GPU; expected a float model here".format(
                    self.model_path, self.quantization, self.version_text))
        config = net.builder.create_builder_config()
        apply_builder_settings(trt, config, self.settings)
        if self.backend.memory_limit:  # builder.memory_limit: room for the serving app
            self.details["memory_pools"] = cap_build_memory(trt, config,
                                                            self.backend.memory_limit,
                                                            self.settings)
        if profile:
            prof = net.builder.create_optimization_profile()
            for name, (lo, opt, hi) in profile.items():
                _set_profile_shape(prof, name, lo, opt, hi)
            config.add_optimization_profile(prof)
        return config

    def _serialize(self, net: _Network, config: "tensorrt.IBuilderConfig") -> Any:
        import tensorrt as trt

        self.progress("building", 0, 1)
        monitor = None
        if self.backend.features.progress_monitor and hasattr(trt, "IProgressMonitor"):
            monitor = make_monitor(trt, self.progress)
            config.progress_monitor = monitor
        serialized = net.builder.build_serialized_network(net.network, config)
        if serialized is None and monitor is not None and monitor.stopped:
            if monitor.stopped == "interrupted":
                raise KeyboardInterrupt
            raise AgentError("cancelled", "the build of {} was cancelled while TensorRT built "
                             "it (its progress monitor stopped it)".format(self.model_path))
        if serialized is None:
            messages = self.logger.since(self.log_mark)
            raise AgentError(
                "build_failed",
                "TensorRT {} could not build {}: {}".format(
                    self.version_text, self.model_path,
                    " | ".join(messages[-5:]) or "no message"),
                {"messages": messages})
        self.progress("building", 1, 1)
        return serialized

    def _timing_cache(self) -> TimingCache:
        major, minor = self.ctx.compute_capability()
        device = "{}-sm{}{}".format(self.ctx.name(), major, minor)
        return TimingCache(timing_cache_path(self.version_text, device))

    def run(self) -> BuildResult:
        import tensorrt as trt

        from agent.engines.backends import onnx_model, quantization

        plan = self.plan
        model, order = self._load_model()
        if self.settings.strongly_typed and (plan.precision != "fp32" or plan.layer_precisions):
            model = self._rewrite(model, order)
        if plan.mark_outputs:
            model = onnx_model.mark_outputs(model, list(plan.mark_outputs))
        net = self._parse(model)
        profile = profile_shapes(net.inputs, plan.shapes)
        check_dla_profile(self.settings.dla_core, profile)
        config = self._config(net, profile)
        if self.settings.layer_constraints:
            applied, skipped = apply_layer_precisions(trt, net.network,
                                                      plan.layer_precisions, order,
                                                      self.settings.pin_others)
            self.details["constrained_layers"] = applied
            self.details["skipped_layers"] = [list(s) for s in skipped]
        if self.settings.dla_core is not None:
            self._check_placement(trt, net, config, order)
        feeder = None
        if self.settings.int8_source in ("calibrator", "ranges"):
            feeder = self._implicit_int8(net, config, profile, model)
        timing = self._timing_cache()
        timing.attach(config)
        try:
            serialized = self._serialize(net, config)
        except AgentError:
            self._raise_calibrator_error()
            raise
        finally:
            if feeder is not None:
                feeder.close()
        self._raise_calibrator_error()
        if feeder is not None:
            self.calibrated = feeder.batches_fed > 0
            self.details["calibration_batches"] = feeder.batches_fed
        self.details["timing_cache"] = {"path": timing.path, "loaded_bytes": timing.loaded_bytes,
                                        "saved_bytes": timing.save(config)}
        if timing.errors:  # the build went on without it: said, not hidden
            self.details["timing_cache"]["errors"] = list(timing.errors)
            self.details["notes"].extend(timing.errors)
        atomic_write(self.engine_path, bytes(serialized))
        # The inspector deserializes the engine once more: let the builder, network and parsed
        # weights go first, so a 2-4 GB board does not hold both at once.
        del net, config, feeder
        _write_dla_core(self.engine_path, self.settings.dla_core)
        write_plugins(self.engine_path, plan.plugins)
        if plan.plugins:
            self.details["plugins"] = [dict(p) for p in plan.plugins]
        write_platform(self.engine_path, self.backend.engine_platform(self.settings.dla_core))
        if self.settings.dla_core is not None:
            self.details["dla_core"] = self.settings.dla_core
        got, mismatches = self._read_back(serialized, order)
        return BuildResult(
            self.engine_path, quantization.label(plan.precision, self.quantization),
            layer_precisions=got, mismatches=mismatches,
            calibration_cache=self.calibration_cache, calibrated=self.calibrated,
            details=self.details)

    def _check_placement(self, trt: Any, net: _Network, config: "tensorrt.IBuilderConfig",
                         order: Sequence[str]) -> None:
        """The placement report of a DLA build (``details.dla_placement``: nodes on the DLA,
        nodes on the GPU); without GPU fallback, nodes DLA cannot run are refused by name
        before TensorRT is asked (it would fail with one layer's name)."""
        if not hasattr(config, "can_run_on_DLA"):
            return
        placement = dla_placement(trt, net.network, config, order)
        self.details["dla_placement"] = placement
        if placement["gpu"] and "GPU_FALLBACK" not in self.settings.set_flags:
            raise AgentError(
                "dla_layers_on_gpu",
                "--dla-core {} without GPU fallback: DLA cannot run {} (expected every layer "
                "on the DLA; allow GPU fallback or change those layers)".format(
                    self.settings.dla_core, ", ".join(placement["gpu"][:20])),
                {"gpu": placement["gpu"][:200]})

    def _raise_calibrator_error(self) -> None:
        """An error kept by the calibrator (bad data, full disk) explains a failed build."""
        error = getattr(self.calibrator, "error", None)
        if error is not None:
            raise error

    def _read_back(self, serialized: Any,
                   order: Sequence[str]) -> Tuple[Dict[str, str], List[Tuple[str, str, str]]]:
        """Per-node precisions and mismatches. Weakly typed: what the engine inspector
        shows. Strongly typed: TensorRT follows the graph's types exactly, so the rewrite's
        assignment is the truth (fused Casts make the inspector's output types misleading);
        the inspector's view goes to the details."""
        import tensorrt as trt

        # A Q/DQ model's int8 layers are its pairs' (not asked, never a mismatch).
        explicit = dict((name, "int8") for name in self.int8_layers)
        typed = dict(self.graph_assignment, **explicit) if self.graph_assignment else {}
        if not self.settings.detailed_profiling:
            self.details["inspector"] = "unavailable (TensorRT < 8.2)"
            return typed, list(self.graph_mismatches)
        layers = inspect_engine(trt.Runtime(self.logger), serialized)
        if layers is None:
            self.details["inspector"] = "unavailable"
            return typed, list(self.graph_mismatches)
        self.details["inspector"] = "json"
        placement = self.details.get("dla_placement")
        if placement is not None:
            placement["engine_dla"] = dla_nodes(layers, order)
        seen = node_precisions(layers, order)
        if self.settings.strongly_typed and self.graph_assignment:
            self.details["inspector_precisions"] = seen
            return typed, list(self.graph_mismatches)
        missing = sorted(set(self.plan.layer_precisions) - set(seen))
        if missing:
            self.details["not_in_engine"] = missing
        floor = plan_floor(self.plan.precision) if not self.settings.strongly_typed else None
        mismatches = precision_mismatches(self.plan.layer_precisions, seen, floor)
        return seen, [m for m in mismatches
                      if not (m[0] in explicit and m[2] == "int8")]

    # INT8 -------------------------------------------------------------------------------

    def _calibration(self) -> CalibrationSettings:
        settings = self.plan.calibration
        if settings is None or not (settings.data or settings.cache):
            raise AgentError("bad_argument",
                             "{} needs calibration data (--calib) or a calibration cache "
                             "(--calibration-cache)".format(self.plan.precision))
        return settings

    def _cache_path(self, settings: CalibrationSettings) -> str:
        if settings.cache:
            return settings.cache
        return os.path.splitext(self.engine_path)[0] + ".calibration.cache"

    def _existing_cache(self, path: str, algorithm: str, check_version: bool) -> Any:
        return existing_calibration_cache(path, algorithm,
                                          self.version_text if check_version else None)

    def _dataset(self, settings: CalibrationSettings, inputs: Sequence[TensorSpec],
                 batch: int) -> Any:
        from calib.dataset import CalibrationDataset

        if not settings.data:
            raise AgentError("bad_argument",
                             "no calibration cache at {} and no calibration data (--calib) to "
                             "make one".format(self._cache_path(settings)))
        return CalibrationDataset(settings.data, list(inputs), batch,
                                  shuffle_seed=settings.shuffle_seed,
                                  max_samples=settings.max_samples)

    def _implicit_int8(self, net: _Network, config: "tensorrt.IBuilderConfig",
                       profile: ProfileShapes, model: Any) -> Any:
        from calib.calibrators import BatchFeeder, calibration_dtypes, make_calibrator

        settings = self._calibration()
        algorithm = settings.algorithm
        path = self._cache_path(settings)
        self.calibration_cache = path
        if algorithm == "percentile":
            # No TensorRT calibrator: ranges measured here, handed over as dynamic ranges.
            amax = self._amax(net.inputs, profile, settings, path, model)
            self.details["dynamic_ranges"] = _set_dynamic_ranges(net.network, amax)
            return None
        existing = self._existing_cache(path, algorithm, check_version=True)
        batch, shapes, notes = calibration_shapes(net.inputs, profile, settings.batch_size)
        self.details["notes"].extend(notes)
        cache_bytes = None
        feeder = None
        if existing is not None:
            with open(path, "rb") as f:
                cache_bytes = f.read()
            self.details["calibration"] = "cache"
        else:
            dataset = self._dataset(settings, net.inputs, batch)
            feeder = BatchFeeder(dataset, batch, calibration_dtypes(net.inputs),
                                 progress=self.progress, total=dataset.num_batches(),
                                 shapes=shapes)
            self.details["calibration"] = algorithm
        self.calibrator = make_calibrator(algorithm, feeder, batch, path, cache_bytes)
        config.int8_calibrator = self.calibrator
        if profile:
            cprof = net.builder.create_optimization_profile()
            for name, shape in shapes.items():
                _set_profile_shape(cprof, name, shape, shape, shape)
            config.set_calibration_profile(cprof)
        return feeder

    def _amax(self, inputs: Sequence[TensorSpec], profile: ProfileShapes,
              settings: CalibrationSettings, path: str, model: Any) -> Dict[str, float]:
        """amax per tensor: from a compatible cache, else measured on this device by running
        an fp32 engine of ``model`` (the build's ONNX model, already loaded: not read twice on
        a small board) with every layer output marked (``mark_layerwise``) through
        ``calib.ranges``, float outputs only (the cache is then written for the next build)."""
        import tensorrt as trt

        from calib import cache as calib_cache
        from calib.ranges import RangeCollector

        # Scales mean the same whichever TensorRT wrote them: only the algorithm must match.
        existing = self._existing_cache(path, settings.algorithm, check_version=False)
        if existing is not None:
            self.details["calibration"] = "cache"
            return dict(existing.amax)
        batch, shapes, notes = calibration_shapes(inputs, profile, settings.batch_size)
        self.details["notes"].extend(notes)
        dataset = self._dataset(settings, inputs, batch)
        fp32 = BuildPlan(precision="fp32", workspace_bytes=self.plan.workspace_bytes,
                         shapes=range_profile(shapes, profile))
        sub = Build(self.backend, self.ctx, self.model_path, fp32, self.engine_path,
                     no_progress)
        net = sub._parse(model)
        self.details["range_outputs"] = len(mark_layerwise(trt, net.network))
        serialized = sub._serialize(net, sub._config(net, profile_shapes(net.inputs,
                                                                         fp32.shapes)))
        collector = RangeCollector(settings.algorithm)
        total = dataset.num_batches()
        with TensorRTRunner(bytes(serialized), self.backend.device,
                            source="range engine", ctx=self.ctx) as runner:
            for done, feeds in enumerate(dataset, start=1):
                for name, array in feeds.items():
                    collector.update(name, array)
                for name, array in runner.infer(feeds).items():
                    if array.dtype.kind == "f":
                        collector.update(name, array)
                self.progress("calibrating", done, total)
        amax = collector.amax()
        self.calibrated = True
        self.details["calibration"] = settings.algorithm
        calib_cache.write_cache(path, amax, settings.algorithm, self.version_text)
        return amax

    # explicitly typed -------------------------------------------------------------------

    def _rewrite(self, model: Any, order: Sequence[str]) -> Any:
        """Precision into the graph (graph.py, shared with the host backend, typed mode):
        fp32 islands stay fp32 between Casts, INT8 becomes Q/DQ from calibration ranges."""
        from agent.engines.backends import graph, layer_precisions

        plan = self.plan
        amax = None
        if plan.needs_calibration and self.quantization == "none":
            settings = self._calibration()
            path = self._cache_path(settings)
            self.calibration_cache = path
            inputs = self._parse(model).inputs  # the fp32 network's inputs, for the profile
            amax = self._amax(inputs, profile_shapes(inputs, plan.shapes), settings, path,
                              model)
        assignment, mismatches, ignored = layer_precisions.resolve_precisions(
            model, plan.precision, plan.layer_precisions, amax=amax, emulate=False)
        self.graph_mismatches = list(mismatches)
        self.graph_assignment = dict(assignment)
        if ignored:
            self.details["ignored_layers"] = ignored
        self.details["graph_rewrite"] = graph.REWRITE_VERSION
        return graph.apply_precisions(model, assignment, amax=amax, emulate=False)
