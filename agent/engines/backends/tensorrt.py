"""The device backend: TensorRT 8.0.1 / 8.2 / 8.5 / 8.6 / 10.x / 11.x through the ONNX parser.

Two ways to get reduced precision, chosen by the TensorRT version (``tensorrt_plan`` decides
what to ask; ``tensorrt_build`` carries it out):

- TensorRT < 10.12 (implicit quantization): builder flags (FP16 / INT8 / TF32), per-layer
  ``layer.precision`` + ``set_output_type`` under OBEY or PREFER precision constraints, INT8
  scales from a calibrator (``calib.calibrators``), a calibration cache, or (percentile) ranges
  measured on the device and set as dynamic ranges.
- TensorRT >= 10.12 / 11 (explicitly typed): the network is created STRONGLY_TYPED and the
  precision is written into the ONNX graph by ``agent.engines.backends.graph`` (the same rewrites
  as the host backend, typed rather than emulated): fp16 regions with Cast nodes, INT8 as
  QuantizeLinear/DequantizeLinear pairs whose scales come from the calibration cache or from
  ranges measured on the device (``calib.ranges``).

The model is always read by ``onnx_model.load_model`` (which names unnamed nodes) and handed to
the parser as bytes, so TensorRT's layer names are built from the same node names the plan uses.
After a build the engine inspector says what precision each layer really got (fusions can
override requests; ``tensorrt_inspect`` reads it); layers that did not get what was asked are
reported as mismatches. Builds share a persistent timing cache per TensorRT version and device,
merged under a file lock (``tensorrt_caches``).

This module is the backend's face (``create``, ``TensorRTBackend``: build, open, fingerprint).
TensorRT and pycuda are imported lazily. Worker side: Python >= 3.6.
"""

import os
import time
from typing import Any, Dict, Optional

from agent.engines.backends.base import Backend, BuildPlan, BuildResult, Progress, no_progress
from agent.engines.backends.tensorrt_build import Build
from agent.engines.backends.tensorrt_network import read_dla_core, read_platform, read_plugins
from agent.engines.backends.tensorrt_plan import (
    HARDWARE_COMPATIBILITY,
    VERSION_COMPATIBLE,
    Features,
    parse_version,
)
from agent.engines.backends.tensorrt_runner import TensorRTRunner
from agent.errors import AgentError


def import_tensorrt() -> Any:
    """The tensorrt module, or ``backend_unavailable`` saying how to get it."""
    try:
        import tensorrt
    except ImportError as exc:
        raise AgentError(
            "backend_unavailable",
            "the tensorrt backend needs TensorRT's Python bindings (JetPack installs them as "
            "python3-libnvinfer); importing tensorrt failed: {}. On a host use --backend "
            "onnxruntime".format(exc))
    return tensorrt


class TensorRTBackend(Backend):
    name = "tensorrt"

    def __init__(self, version: str, device: int = 0) -> None:
        self._version = version
        self.device = device
        self.features = Features(parse_version(version))
        # Bytes a build's memory pools may take (builder.memory_limit; None: TensorRT's
        # defaults). A resource bound, not a property of the engine: not in the cache key.
        self.memory_limit: Optional[int] = None

    def version(self) -> str:
        return self._version

    def fingerprint(self) -> Dict[str, str]:
        """What an engine built here depends on (the engine cache key's backend part): the
        TensorRT version, the GPU (name, compute capability, SM count), CUDA (runtime and
        driver) and the engine-compatibility settings; the plan adds the DLA core."""
        from agent.engines.backends import graph

        record = self.engine_platform()
        out = {"backend": self.name, "version": self.version(), "device": record["gpu"],
               "compute_capability": record["compute_capability"],
               "sm_count": record["sm_count"], "cuda_runtime": record["cuda_runtime"],
               "cuda_driver": record["cuda_driver"],
               "hardware_compatibility": record["hardware_compatibility"],
               "version_compatible": record["version_compatible"]}
        if self.features.strongly_typed:
            out["graph_rewrite"] = graph.REWRITE_VERSION
        return out

    def engine_platform(self, dla_core: Optional[int] = None, dla_cores: bool = False
                        ) -> Dict[str, str]:
        """This device as an engine's platform record (``cache_key.PLATFORM_FIELDS``):
        written beside every engine built here, compared with the record of an engine
        before it is loaded. ``dla_cores`` adds the device's DLA count (asks TensorRT)."""
        from agent.engines.backends.cuda_buffers import CudaContext, cuda_version, driver_version

        with CudaContext(self.device) as ctx:
            major, minor = ctx.compute_capability()
            record = {"tensorrt": self.version(), "gpu": ctx.name(),
                      "compute_capability": "{}.{}".format(major, minor),
                      "sm_count": str(ctx.sm_count()), "cuda_runtime": cuda_version(),
                      "cuda_driver": driver_version(),
                      "dla_core": "" if dla_core is None else str(int(dla_core)),
                      "hardware_compatibility": HARDWARE_COMPATIBILITY,
                      "version_compatible": "true" if VERSION_COMPATIBLE else "false"}
            if dla_cores:
                record["dla_cores"] = str(self.num_dla_cores())
        return record

    def num_dla_cores(self) -> int:
        """The DLA cores TensorRT can use here: the runtime's ``num_DLA_cores`` (opening an
        engine must not create a builder, which loads the builder's resources on a small
        board), the builder's where a runtime has no such attribute."""
        trt = import_tensorrt()
        from agent.engines.backends.tensorrt_network import _make_logger

        runtime = trt.Runtime(_make_logger())
        try:
            if hasattr(runtime, "num_DLA_cores"):
                return int(runtime.num_DLA_cores or 0)
        finally:
            del runtime
        builder = trt.Builder(_make_logger())
        try:
            return int(getattr(builder, "num_DLA_cores", 0) or 0)
        finally:
            del builder

    def check_platform(self, engine_path: str, dla_core: Optional[int] = None) -> None:
        """Refuse (``engine_platform_mismatch``, every differing field with this device's
        value and the engine's) an engine whose recorded platform is not this device. An
        engine without a record (built before records existed) is left to TensorRT."""
        from agent.engines.cache_key import platform_mismatches

        recorded = read_platform(engine_path)
        if recorded is None:
            return
        if dla_core is not None:
            recorded = dict(recorded, dla_core=str(int(dla_core)))
        here = self.engine_platform(dla_cores=bool(recorded.get("dla_core")))
        wrong = platform_mismatches(recorded, here)
        if wrong:
            raise AgentError(
                "engine_platform_mismatch",
                "{} was built for another platform: {}; rebuild it on this device".format(
                    os.path.basename(engine_path), "; ".join(
                        "{}: expected {} (this device), found {} (the engine's)".format(
                            field, want, found) for field, want, found in wrong)),
                {"mismatches": [{"field": f, "expected": w, "found": g}
                                for f, w, g in wrong]})

    def build(self, model_path: str, plan: BuildPlan, engine_path: str,
              progress: Progress = no_progress) -> BuildResult:
        from agent.engines.backends.cuda_buffers import CudaContext

        started = time.monotonic()
        if not os.path.isfile(model_path):
            raise AgentError("file_not_found",
                             "model {} does not exist (expected an .onnx file)".format(model_path))
        with CudaContext(self.device) as ctx:
            result = Build(self, ctx, model_path, plan, engine_path, progress).run()
        result.seconds = time.monotonic() - started
        return result

    def open(self, engine_path: str, dla_core: Optional[int] = None) -> "TensorRTRunner":
        """A runner for ``engine_path``; a DLA engine runs on the core it was built for (or
        ``dla_core``): TensorRT's runtime would otherwise use its default core."""
        if not os.path.isfile(engine_path):
            raise AgentError("file_not_found", "engine {} does not exist".format(engine_path))
        with open(engine_path, "rb") as f:
            data = f.read()
        if dla_core is None:
            dla_core = read_dla_core(engine_path)
        self.check_platform(engine_path, dla_core)
        return TensorRTRunner(data, self.device, source=engine_path, dla_core=dla_core,
                              plugins=read_plugins(engine_path))


def create() -> TensorRTBackend:
    """The backend, or ``backend_unavailable`` when TensorRT or pycuda is missing."""
    trt = import_tensorrt()
    from agent.engines.backends.cuda_buffers import require_pycuda

    require_pycuda()
    return TensorRTBackend(str(trt.__version__))
