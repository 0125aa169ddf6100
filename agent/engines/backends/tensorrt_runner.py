"""Runs a serialized TensorRT engine (the tensorrt backend's ``Runner``): pinned host and
device buffers, one stream, CUDA-event timing (whole inferences, or trtexec's H2D / compute /
D2H / enqueue split); the bindings API before TensorRT 8.5, the tensor-name API from 8.5.
Worker side: Python >= 3.6.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.engines.backends.base import Runner, TensorSpec
from agent.engines.backends.tensorrt_network import (
    _dims,
    _ints,
    _make_logger,
    numpy_dtype,
    register_plugins,
)
from agent.engines.backends.tensorrt_plan import Features, parse_version
from agent.engines.backends.tensorrt_shapes import shape_text
from agent.errors import AgentError


class TensorRTRunner(Runner):
    """Runs a serialized engine: pinned host buffers, device buffers, one stream.

    TensorRT >= 8.5 uses the tensor-name API (``set_input_shape``, ``set_tensor_address``,
    ``execute_async_v3``), older versions the bindings API (``set_binding_shape``,
    ``execute_async_v2``). One optimization profile (the first) is used."""

    def __init__(self, data: bytes, device: int = 0, source: str = "engine",
                 ctx: Any = None, dla_core: Optional[int] = None,
                 plugins: Sequence[Dict[str, str]] = ()) -> None:
        import tensorrt as trt

        from agent.engines.backends.cuda_buffers import CudaContext, EventTimer, IOBuffers

        self.source = source
        self.features = Features(parse_version(trt.__version__))
        self._own_ctx = ctx is None
        self.ctx = ctx if ctx is not None else CudaContext(device)
        self.buffers: Optional[IOBuffers] = None
        self.timer: Optional[EventTimer] = None
        self._binding_index: Dict[str, int] = {}
        self._last_feeds: Optional[Dict[str, np.ndarray]] = None
        try:
            self.logger = _make_logger()
            mark = self.logger.mark()
            # An engine with plugin layers deserializes only once their creators are known.
            register_plugins(trt, self.logger, plugins)
            self.runtime = trt.Runtime(self.logger)
            if dla_core is not None:
                self.runtime.DLA_core = int(dla_core)  # before deserializing: it is read then
            engine = self.runtime.deserialize_cuda_engine(data)
            if engine is None:
                raise AgentError(
                    "bad_engine",
                    "{} is not a TensorRT {} engine for this device: {}".format(
                        source, trt.__version__,
                        " | ".join(self.logger.since(mark)[-3:]) or "deserialization failed"))
            self.engine = engine
            self.context = engine.create_execution_context()
            self.buffers = IOBuffers()
            self.timer = EventTimer(self.buffers.stream)
            self._inputs, self._outputs = self._io_specs()
        except BaseException:
            self.close()
            raise

    def _io_specs(self) -> Tuple[List[TensorSpec], List[TensorSpec]]:
        import tensorrt as trt

        engine = self.engine
        inputs: List[TensorSpec] = []
        outputs: List[TensorSpec] = []
        if self.features.tensor_io_api:
            for i in range(engine.num_io_tensors):
                name = engine.get_tensor_name(i)
                spec = TensorSpec(name, numpy_dtype(trt, engine.get_tensor_dtype(name),
                                                     "tensor {!r}".format(name)),
                                  _dims(engine.get_tensor_shape(name)))
                is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
                (inputs if is_input else outputs).append(spec)
            return inputs, outputs
        # TensorRT < 8.5: the bindings API (gone in 10, so absent from the stubs).
        for i in range(engine.num_bindings):  # type: ignore[attr-defined]
            name = engine.get_binding_name(i)  # type: ignore[attr-defined]
            self._binding_index[name] = i
            dtype = engine.get_binding_dtype(i)  # type: ignore[attr-defined]
            spec = TensorSpec(name, numpy_dtype(trt, dtype, "binding {!r}".format(name)),
                              _dims(engine.get_binding_shape(i)))  # type: ignore[attr-defined]
            (inputs if engine.binding_is_input(i) else outputs).append(spec)  # type: ignore[attr-defined]
        return inputs, outputs

    def _io(self) -> Any:
        if self.buffers is None:
            raise AgentError("bad_argument", "{} is closed".format(self.source))
        return self.buffers

    def _prepare(self, feeds: Dict[str, np.ndarray]) -> None:
        """Check the feeds, fill the pinned inputs, set dynamic shapes, size the outputs."""
        buffers = self._io()
        names = {s.name for s in self._inputs}
        if set(feeds) != names:
            raise AgentError("bad_argument",
                             "{}: expected inputs {}, found {}".format(
                                 self.source, ", ".join(sorted(names)),
                                 ", ".join(sorted(feeds)) or "none"))
        context = self.context
        for spec in self._inputs:
            array = np.asarray(feeds[spec.name])
            ok = array.ndim == len(spec.shape) and all(
                want is None or want == got for want, got in zip(spec.shape, array.shape))
            if not ok:
                raise AgentError("bad_argument",
                                 "{}: input {!r}: expected shape {}, found {}".format(
                                     self.source, spec.name, shape_text(spec.shape),
                                     list(array.shape)))
            buffers.set_input(spec.name, array, spec.dtype)
            if any(d is None for d in spec.shape):
                if self.features.tensor_io_api:
                    accepted = context.set_input_shape(spec.name, tuple(array.shape))
                else:
                    accepted = context.set_binding_shape(  # type: ignore[attr-defined]
                        self._binding_index[spec.name], tuple(array.shape))
                if not accepted:  # else the outputs stay unresolved (-1): not data-dependent
                    raise AgentError(
                        "bad_argument",
                        "{}: input {!r}: expected a shape within the engine's optimization "
                        "profile{}, found {}".format(self.source, spec.name,
                                                     self._profile_text(spec.name),
                                                     list(array.shape)))
        for spec in self._outputs:
            if self.features.tensor_io_api:
                shape = _ints(context.get_tensor_shape(spec.name))
            else:
                shape = _ints(context.get_binding_shape(  # type: ignore[attr-defined]
                    self._binding_index[spec.name]))
            if any(d < 0 for d in shape):
                raise AgentError("unsupported_model",
                                 "{}: output {!r} has a data-dependent shape {}, which this "
                                 "runner does not support".format(self.source, spec.name,
                                                                  list(shape)))
            buffers.ensure(spec.name, shape, spec.dtype)
        if self.features.tensor_io_api:
            for spec in self._inputs + self._outputs:
                if not context.set_tensor_address(spec.name, buffers.device_ptr(spec.name)):
                    raise AgentError("internal_error",
                                     "{}: TensorRT refused the device address of tensor {!r}"
                                     .format(self.source, spec.name))
        self._last_feeds = feeds

    def _profile_text(self, name: str) -> str:
        """`` (min [1, 3], opt [..], max [..])`` of profile 0 for input ``name``, or ``""``."""
        try:
            if self.features.tensor_io_api:
                shapes = self.engine.get_tensor_profile_shape(name, 0)
            else:
                shapes = self.engine.get_profile_shape(  # type: ignore[attr-defined]
                    0, self._binding_index[name])
            lo, opt, hi = (list(_ints(s)) for s in shapes)
        except Exception:  # noqa: BLE001 - only decorates the message
            return ""
        return " (min {}, opt {}, max {})".format(lo, opt, hi)

    def _to_device(self) -> None:
        self._io().to_device([s.name for s in self._inputs])

    def _execute(self) -> None:
        """Queue the inference on the stream (the call trtexec's Enqueue Time measures)."""
        buffers = self._io()
        handle = buffers.stream.handle
        if self.features.tensor_io_api:
            ok = self.context.execute_async_v3(handle)
        else:
            bindings = [0] * len(self._binding_index)
            for spec in self._inputs + self._outputs:
                bindings[self._binding_index[spec.name]] = buffers.device_ptr(spec.name)
            ok = self.context.execute_async_v2(bindings, handle)  # type: ignore[attr-defined]
        if not ok:
            raise AgentError("internal_error",
                             "{}: TensorRT failed to enqueue inference".format(self.source))

    def _to_host(self) -> None:
        self._io().to_host([s.name for s in self._outputs])

    def _enqueue(self) -> None:
        """Queue input copies, the inference and output copies on the stream."""
        self._to_device()
        self._execute()
        self._to_host()

    def infer(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        self._prepare(feeds)
        self._enqueue()
        buffers = self._io()
        buffers.synchronize()
        return {s.name: np.array(buffers.host(s.name)) for s in self._outputs}

    def _timer_for(self, feeds: Optional[Dict[str, np.ndarray]], what: str) -> Any:
        """The event timer, after preparing ``feeds`` (or checking a previous ``infer``)."""
        if feeds is not None:
            self._prepare(feeds)
        elif self._last_feeds is None:
            raise AgentError("bad_argument",
                             "{} needs feeds (or a previous infer call)".format(what))
        if self.timer is None:
            raise AgentError("bad_argument", "{} is closed".format(self.source))
        return self.timer

    def time_inference(self, iterations: int, warmup: int = 0,
                       feeds: Optional[Dict[str, np.ndarray]] = None) -> List[float]:
        """Milliseconds per inference (host->device copies, execution, device->host copies)
        measured with CUDA events, on ``feeds`` or the last ones given to ``infer``."""
        timer = self._timer_for(feeds, "time_inference")
        return list(timer.time(self._enqueue, iterations, warmup))

    def time_phases(self, iterations: int, feeds: Optional[Dict[str, np.ndarray]] = None
                    ) -> List[Dict[str, float]]:
        """trtexec's split of each inference, in ms: ``h2d``, ``compute`` and ``d2h`` from CUDA
        events, ``enqueue`` the host time of the execute call (see ``agent.engines.bench``)."""
        timer = self._timer_for(feeds, "time_phases")
        return list(timer.time_phases(self._to_device, self._execute, self._to_host,
                                      iterations))

    def engine_information(self) -> str:
        """The engine inspector's JSON (TensorRT >= 8.2; layer names only unless the engine
        was built with detailed profiling verbosity, as this agent's builds are)."""
        import tensorrt as trt

        if not hasattr(self.engine, "create_engine_inspector"):
            raise AgentError("profile_unavailable",
                             "expected TensorRT >= 8.2 (the engine inspector), found {}".format(
                                 trt.__version__))
        inspector = self.engine.create_engine_inspector()
        return str(inspector.get_engine_information(trt.LayerInformationFormat.JSON))

    def layer_times(self, feeds: Dict[str, np.ndarray], runs: int) -> Dict[str, List[float]]:
        """TensorRT's ``IProfiler`` on the execution context (trtexec's ``--dumpProfile``):
        each layer's time in each of ``runs`` synchronous inferences, after an untimed one."""
        import tensorrt as trt

        times: Dict[str, List[float]] = {}

        class Profiler(trt.IProfiler):  # type: ignore[misc,name-defined]
            def report_layer_time(self, layer_name: str, ms: float) -> None:
                times.setdefault(layer_name, []).append(float(ms))

        self.infer(feeds)
        # Kept on the context for its life (TensorRT holds a pointer; the bindings take no
        # None back): call it after the timed runs, as bench does.
        self._profiler = Profiler()
        self.context.profiler = self._profiler
        for _ in range(int(runs)):
            self.infer(feeds)
        return times

    def close(self) -> None:
        """Free in order while the CUDA context is still current: pycuda skips destroying a
        stream or event whose context is gone (a leak per runner), so the events, then the
        buffers and the stream, then TensorRT's objects, and only then the context."""
        if self.timer is not None:
            self.timer.close()
            self.timer = None
        if self.buffers is not None:
            self.buffers.close()
            self.buffers = None
        for attr in ("context", "engine", "runtime"):
            if hasattr(self, attr):
                delattr(self, attr)
        if self._own_ctx and self.ctx is not None:
            self.ctx.close()
            self.ctx = None
