"""ONNX Runtime sessions on the CPU provider, and the runner over one: what the host backend's
engines (and any ONNX model) run on. ``import_onnxruntime`` says how to get the package when it
is missing; ``open_session`` turns ONNX Runtime's load errors into stable codes. Worker side:
Python >= 3.6.
"""

import functools
import os
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from agent.engines.backends.base import Runner, TensorSpec
from agent.errors import AgentError

_ORT_TYPES = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
    "tensor(int8)": np.int8, "tensor(uint8)": np.uint8, "tensor(int16)": np.int16,
    "tensor(uint16)": np.uint16, "tensor(int32)": np.int32, "tensor(uint32)": np.uint32,
    "tensor(int64)": np.int64, "tensor(uint64)": np.uint64, "tensor(bool)": np.bool_,
}


def import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise AgentError("backend_unavailable",
                         "the onnxruntime backend needs the onnxruntime package: {}".format(exc))
    return onnxruntime


def session_options(threads: Optional[int] = None, arena: bool = True,
                    profile_prefix: Optional[str] = None) -> Any:
    """CPU session options. ORT_ENABLE_ALL keeps explicit fp32->fp16->fp32 Cast pairs (only
    casts it inserted itself are removed), which the fp16 tests check on every run.
    ``arena`` False returns memory after each run (instrumented runs with every tensor as an
    output: the arena would keep the largest run's worth for good)."""
    ort = import_onnxruntime()
    options = ort.SessionOptions()
    if not arena:
        options.enable_cpu_mem_arena = False
        options.enable_mem_pattern = False
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = int(threads)
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    if profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    return options


def open_session(model_bytes: bytes, threads: Optional[int], source: str, arena: bool = True,
                 profile_prefix: Optional[str] = None) -> Any:
    ort = import_onnxruntime()
    try:
        return ort.InferenceSession(
            model_bytes, sess_options=session_options(threads, arena, profile_prefix),
            providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - ORT raises its own unexported error types
        text = str(exc)
        code = "unsupported_model" if ("NOT_IMPLEMENTED" in text or "not a registered" in text
                                       or "Could not find an implementation" in text) \
            else "build_failed"
        raise AgentError(code, "{}: onnxruntime {} cannot load it: {}".format(
            source, ort.__version__, text.strip().splitlines()[0] if text.strip() else text))


def _specs(args: List[Any]) -> List[TensorSpec]:
    out = []
    for arg in args:
        dims = tuple(d if isinstance(d, int) and d > 0 else None for d in arg.shape)
        out.append(TensorSpec(arg.name, _ORT_TYPES.get(arg.type, np.float32), dims))
    return out


class OnnxRuntimeRunner(Runner):
    """Runs an engine (or any ONNX model) on ONNX Runtime's CPU provider."""

    def __init__(self, session: Any, metadata: Optional[Dict[str, Any]] = None,
                 profiling: Optional[Callable[[str], Any]] = None) -> None:
        self.session = session
        self._profiling = profiling  # prefix -> a session that profiles (``layer_times``)
        self.metadata = dict(metadata or {})
        self._inputs = _specs(session.get_inputs())
        self._outputs = _specs(session.get_outputs())
        self._output_names = [o.name for o in self._outputs]
        self._input_names = frozenset(spec.name for spec in self._inputs)

    def infer(self, feeds: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
        if feeds.keys() != self._input_names:
            raise AgentError("bad_argument",
                             "expected inputs {}, found {}".format(
                                 ", ".join(sorted(self._input_names)),
                                 ", ".join(sorted(feeds)) or "none"))
        arrays = feeds
        # Fast path (the benchmark loop): arrays of the right dtype pass through untouched.
        if any(not isinstance(feeds[spec.name], np.ndarray)
               or feeds[spec.name].dtype != spec.dtype for spec in self._inputs):
            arrays = {spec.name: self._converted(spec, feeds[spec.name]) for spec in self._inputs}
        try:
            values = self.session.run(self._output_names, arrays)
        except Exception as exc:  # noqa: BLE001 - ORT's error types are not exported
            raise AgentError("bad_argument", "inference failed: {}".format(
                str(exc).strip().splitlines()[0] if str(exc).strip() else exc))
        return dict(zip(self._output_names, values))

    def bind(self, feeds: Dict[str, np.ndarray]) -> Callable[[], Any]:
        self.infer(feeds)  # validates, converts, and surfaces errors before timing
        arrays = {spec.name: self._converted(spec, feeds[spec.name]) for spec in self._inputs}
        return functools.partial(self.session.run, self._output_names, arrays)

    @staticmethod
    def _converted(spec: TensorSpec, value: Any) -> np.ndarray:
        value = np.asarray(value)
        if value.dtype != spec.dtype:
            if not np.can_cast(value.dtype, spec.dtype, casting="same_kind"):
                raise AgentError("bad_argument", "input {!r}: expected dtype {}, found {}".format(
                    spec.name, spec.dtype, value.dtype))
            value = value.astype(spec.dtype)
        return value

    def layer_times(self, feeds: Dict[str, np.ndarray], runs: int) -> Dict[str, List[float]]:
        """ONNX Runtime's profiler over ``runs`` inferences, after one untimed run (the first
        allocates), in a session of its own: profiling slows every run, so the benchmark's
        session never profiles."""
        if self._profiling is None:
            return super(OnnxRuntimeRunner, self).layer_times(feeds, runs)
        import json
        import shutil
        import tempfile

        from agent.engines.layer_view import ort_layer_times

        self.infer(feeds)  # validates before a second session is opened
        arrays = {spec.name: self._converted(spec, feeds[spec.name]) for spec in self._inputs}
        folder = tempfile.mkdtemp(prefix="jetson-agent-profile-")
        try:
            session = self._profiling(os.path.join(folder, "ort"))
            for _ in range(int(runs) + 1):
                session.run(self._output_names, arrays)
            with open(session.end_profiling()) as f:
                times = ort_layer_times(json.load(f))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return {name: values[1:] for name, values in times.items() if len(values) > 1}

    def close(self) -> None:
        self.session = None
