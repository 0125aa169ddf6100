"""The build side of the fake ``tensorrt`` (``tests/fake_trt.py``): tensors, layers and networks,
the ONNX parser (with each profile's Cast import), the builder config, and a builder whose
"engine" is the JSON of what it chose. The choice of layer precision follows NvInfer.h's rule
for weakly typed networks: a layer without a constraint runs in whatever the flags allow
(modelled as the lowest allowed precision, the worst case a device may pick).
"""

import json
import types

import onnx
from onnx import TensorProto, helper

from tests.fake_trt import version_tuple

_ONNX_TO_ALIAS = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16",
                  TensorProto.INT8: "int8", TensorProto.INT32: "int32",
                  TensorProto.INT64: "int64", TensorProto.BOOL: "bool",
                  TensorProto.UINT8: "uint8", TensorProto.BFLOAT16: "bfloat16"}
_OP_LAYER = {"Conv": "CONVOLUTION", "Relu": "ACTIVATION", "Sigmoid": "ACTIVATION",
             "Add": "ELEMENTWISE", "Sub": "ELEMENTWISE", "Mul": "ELEMENTWISE",
             "Div": "ELEMENTWISE", "MatMul": "MATRIX_MULTIPLY", "Gemm": "MATRIX_MULTIPLY",
             "Softmax": "SOFTMAX", "Shape": "SHAPE", "Constant": "CONSTANT",
             "Gather": "GATHER", "Identity": "IDENTITY", "Reshape": "SHUFFLE",
             "QuantizeLinear": "QUANTIZE", "DequantizeLinear": "DEQUANTIZE"}
_INT8_CAPABLE = ("CONVOLUTION", "MATRIX_MULTIPLY", "FULLY_CONNECTED")
# Layer types DLA runs (TensorRT's "DLA supported layers", abridged); anything else, a plugin
# or a layer with integer outputs is GPU-only.
_DLA_CAPABLE = ("CONVOLUTION", "DECONVOLUTION", "FULLY_CONNECTED", "ACTIVATION", "POOLING",
                "LRN", "SCALE", "ELEMENTWISE", "CONCATENATION", "RESIZE", "UNARY", "SLICE",
                "SOFTMAX", "SHUFFLE", "REDUCE")


def add_builder(trt, p, drv):
    """Put Builder, OnnxParser, IBuilderConfig and INetworkDefinition on the fake ``trt``."""
    api = p["api"]
    Dims, Severity = trt.Dims, trt.ILogger.Severity
    attach, emit = trt._attach, trt._emit

    class Tensor(object):
        def __init__(self, name, dtype, shape=()):
            self.name, self.dtype, self.shape = name, dtype, Dims(shape)
            self.is_shape_tensor = False
            self.dynamic_range = None
            self.is_network_output = False

    if api["set_dynamic_range"]:
        def set_dynamic_range(self, lo, hi):
            self.dynamic_range = (lo, hi)
            return True
        Tensor.set_dynamic_range = set_dynamic_range

    class Layer(object):
        def __init__(self, name, layer_type, outputs, op):
            self.name, self.type, self._outputs, self.op = name, layer_type, outputs, op
            self.precision = trt.float32
            self.precision_is_set = False
            self.output_types = {}
            self.metadata = ("[ONNX Layer: {}]".format(name) if version_tuple(p) >= (8, 6)
                             else "")

        def __setattr__(self, key, value):
            if key == "precision" and hasattr(self, "precision_is_set"):
                object.__setattr__(self, "precision_is_set", True)
            object.__setattr__(self, key, value)

        @property
        def num_outputs(self):
            return len(self._outputs)

        def get_output(self, i):
            return self._outputs[i]

    if api["set_output_type"]:
        def set_output_type(self, i, dtype):
            self.output_types[i] = dtype
            self._outputs[i].dtype = dtype  # a network output takes this type too
        Layer.set_output_type = set_output_type

    class Network(object):
        def __init__(self, flags):
            self.flags = flags
            self.layers, self.inputs, self.outputs = [], [], []

        num_layers = property(lambda self: len(self.layers))
        num_inputs = property(lambda self: len(self.inputs))
        num_outputs = property(lambda self: len(self.outputs))

        def get_layer(self, i):
            return self.layers[i]

        def get_input(self, i):
            return self.inputs[i]

        def get_output(self, i):
            return self.outputs[i]

        def mark_output(self, tensor):
            tensor.is_network_output = True
            self.outputs.append(tensor)

    class ParserError(object):
        def __init__(self, desc, node=-1):
            self._desc = desc
            self._node = node

        def code(self):
            return "ErrorCode.UNSUPPORTED_NODE"

        def desc(self):
            return self._desc

        def node(self):
            return self._node

    def _trt_type(alias):
        # The 8.x parser imports INT64 as INT32 (8.x has no int64 type).
        return getattr(trt, alias) if hasattr(trt, alias) else trt.int32

    class OnnxParser(object):
        def __init__(self, network, logger):
            self.network = network
            self.errors = []

        @property
        def num_errors(self):
            return len(self.errors)

        def get_error(self, i):
            return self.errors[i]

        def parse(self, data, path=None):
            model = onnx.load_from_string(bytes(data))
            types_ = {vi.name: vi.type.tensor_type.elem_type
                      for vi in list(model.graph.input) + list(model.graph.output)
                      + list(model.graph.value_info)}
            inits = {i.name for i in model.graph.initializer}
            net = self.network
            for vi in model.graph.input:
                if vi.name in inits:
                    continue
                dims = [d.dim_value if d.HasField("dim_value") else -1
                        for d in vi.type.tensor_type.shape.dim]
                net.inputs.append(Tensor(vi.name, getattr(trt, _ONNX_TO_ALIAS[
                    vi.type.tensor_type.elem_type]), dims))
            by_name = {t.name: t for t in net.inputs}
            for index, node in enumerate(model.graph.node):
                plugin = node.domain not in ("", "ai.onnx") or not onnx.defs.has(node.op_type)
                if plugin and node.op_type not in drv.plugins:
                    # onnx-tensorrt: an op without an importer is looked up in the plugin
                    # registry; not registered there, the node is unsupported.
                    self.errors.append(ParserError(
                        "No importer registered for op: {}. Attempted to import as plugin: "
                        "Plugin not found, are the plugin name, version, and namespace "
                        "correct?".format(node.op_type), index))
                    return False
                if node.op_type == "Cast":
                    kind = p["cast_layer"]
                    to = helper.get_attribute_value(
                        [a for a in node.attribute if a.name == "to"][0])
                    dtype = _trt_type(_ONNX_TO_ALIAS[to])
                else:
                    kind = "PLUGIN_V2" if plugin else _OP_LAYER.get(node.op_type, "ELEMENTWISE")
                    dtype = _trt_type(_ONNX_TO_ALIAS.get(types_.get(
                        node.output[0], TensorProto.FLOAT), "float32"))
                    if node.op_type == "Shape":
                        dtype = getattr(trt, "int64", trt.int32)
                outs = [Tensor(o, getattr(trt, _ONNX_TO_ALIAS.get(
                    types_.get(o, TensorProto.FLOAT), "float32"))) if plugin else Tensor(o, dtype)
                    for o in node.output]
                layer = Layer(node.name, getattr(trt.LayerType, kind), outs, node.op_type)
                layer.const_weights = len(node.input) > 1 and node.input[1] in inits
                layer.reads = [i for i in node.input if i]  # Q/DQ fusion: who reads a DQ
                if node.op_type == "Cast" and kind == "IDENTITY":
                    layer.output_types[0] = dtype  # the 8.x importer's setOutputType
                    layer.precision_is_set = False
                net.layers.append(layer)
                by_name.update({t.name: t for t in outs})
            for vi in model.graph.output:
                if vi.name in by_name:
                    tensor = by_name[vi.name]
                    tensor.shape = Dims(d.dim_value if d.HasField("dim_value") else -1
                                        for d in vi.type.tensor_type.shape.dim)
                    net.mark_output(tensor)
            return True

    class Config(object):
        def __init__(self):
            self.flags = set()
            self.int8_calibrator = None
            self.default_device_type = trt.DeviceType.GPU
            self.DLA_core = -1
            self.timing = None
            self.profiles = []
            self.calibration_profile = None
            self.profiling_verbosity = None
            # NvInfer.h: 0 bytes before 8.4 (no scratch memory: tactics needing it are
            # skipped), the device's memory from 8.4.
            self.workspace = p.get("workspace_default", "device memory")
            self.pools = {}  # set_memory_pool_limit: pool name -> bytes
            self.progress_monitor = None  # an IProgressMonitor (TensorRT >= 10.0)

        def set_flag(self, flag):
            self.flags.add(flag)

        def clear_flag(self, flag):
            self.flags.discard(flag)

        def get_flag(self, flag):
            return flag in self.flags

        def add_optimization_profile(self, prof):
            self.profiles.append(prof)
            return len(self.profiles) - 1

        def set_calibration_profile(self, prof):
            self.calibration_profile = prof

        def create_timing_cache(self, data):
            if data and not bytes(data).startswith(b"timing"):
                raise RuntimeError("Failed to deserialize the timing cache: invalid data")
            return types.SimpleNamespace(data=bytes(data), serialize=lambda: b"timing",
                                         combine=lambda other, ignore: True)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.timing = cache
            return True

        def get_timing_cache(self):
            return self.timing

        def can_run_on_DLA(self, layer):
            if layer.type == getattr(trt.LayerType, "MATRIX_MULTIPLY", None):
                return bool(getattr(layer, "const_weights", False))  # as fully connected
            if layer.type not in [getattr(trt.LayerType, t) for t in _DLA_CAPABLE
                                  if hasattr(trt.LayerType, t)]:
                return False
            return all(layer.get_output(j).dtype in (trt.float32, trt.float16)
                       for j in range(layer.num_outputs))

    if api["memory_pool"]:
        def set_memory_pool_limit(self, pool, size):
            self.pools[pool.name] = int(size)
            if pool == trt.MemoryPoolType.WORKSPACE:
                self.workspace = size

        Config.set_memory_pool_limit = set_memory_pool_limit
    if api["max_workspace_size"]:
        Config.max_workspace_size = property(
            lambda self: self.workspace if isinstance(self.workspace, int) else 0,
            lambda self, size: setattr(self, "workspace", int(size)))

    class Profile(object):
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (lo, opt, hi)

    def _flag(name):
        return getattr(trt.BuilderFlag, name, None)

    def choose(layer, config, strongly_typed, dequantized=None):
        """The precision a layer gets (see the module docstring). ``dequantized``: the
        DequantizeLinear outputs of an explicitly quantized network (None: no Q/DQ); a layer
        reading one runs in int8 (Q/DQ fusion) and no other layer does (explicit-precision
        mode: the INT8 flag quantizes nothing by itself)."""
        if layer.type == getattr(trt.LayerType, "CAST", None) or layer.op == "Cast":
            return layer.output_types.get(0, layer.get_output(0).dtype)
        out_dtype = layer.get_output(0).dtype
        if out_dtype not in (trt.float32, trt.float16):
            return out_dtype
        if dequantized is not None and layer.op not in ("QuantizeLinear", "DequantizeLinear") \
                and any(r in dequantized for r in layer.reads):
            return trt.int8
        if strongly_typed:
            return out_dtype
        constrained = any(f in config.flags for f in (
            _flag("OBEY_PRECISION_CONSTRAINTS"), _flag("PREFER_PRECISION_CONSTRAINTS"),
            _flag("STRICT_TYPES")) if f is not None)
        if constrained and layer.precision_is_set:
            return layer.precision
        if dequantized is None and _flag("INT8") in config.flags and layer.type in [
                getattr(trt.LayerType, t) for t in _INT8_CAPABLE
                if hasattr(trt.LayerType, t)]:
            return trt.int8
        if _flag("FP16") in config.flags:
            return trt.float16
        return trt.float32

    class HostMemory(bytes):
        pass

    class Builder(object):
        def __init__(self, logger):
            attach(logger)
            drv.builders_alive += 1
            self.logger = logger
            self.fail_with = None  # tests set this: the build fails with that message
            if api["num_dla_cores"]:
                self.num_DLA_cores = drv.num_dla_cores

        def __del__(self):
            drv.live -= 1
            drv.builders_alive -= 1

        def create_network(self, flags=0):
            if not (flags >> int(getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH",
                                         99)) & 1) and version_tuple(p) < (10,):
                raise AssertionError("ONNX networks need EXPLICIT_BATCH on 8.x")
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            typed_flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
            strongly_typed = typed_flag is not None and (network.flags >> int(typed_flag)) & 1
            if self.fail_with or drv.__dict__.get("fail_next"):
                emit(Severity.ERROR, self.fail_with or drv.fail_next)
                drv.fail_next = None
                return None
            qdq = [layer for layer in network.layers
                   if layer.op in ("QuantizeLinear", "DequantizeLinear")]
            dequantized = set(t.name for layer in qdq if layer.op == "DequantizeLinear"
                              for t in layer._outputs) if qdq else None
            if qdq and not strongly_typed and _flag("INT8") not in config.flags:
                # Weakly typed Q/DQ networks need the INT8 flag (NVIDIA/TensorRT issue 4021).
                emit(Severity.ERROR, "Network has Q/DQ layers but the INT8 builder flag is "
                     "not set")
                return None
            if config.int8_calibrator is not None and qdq:
                emit(Severity.WARNING, "Calibrator is ignored in explicit precision mode")
            elif config.int8_calibrator is not None:
                calib = config.int8_calibrator
                cache = calib.read_calibration_cache()
                if not cache:
                    names = [t.name for t in network.inputs]
                    while calib.get_batch(names) is not None:
                        pass
                    calib.write_calibration_cache(b"TRT-calibration-cache\n")
            if not _monitored(config, len(network.layers)):
                emit(Severity.ERROR, "Build was cancelled by the progress monitor")
                return None
            layers = []
            on_dla = config.default_device_type == trt.DeviceType.DLA
            for layer in network.layers:
                prec = choose(layer, config, strongly_typed, dequantized)
                dla = on_dla and config.can_run_on_DLA(layer)
                if on_dla and not dla and _flag("GPU_FALLBACK") not in config.flags:
                    emit(Severity.ERROR, "{} cannot run on DLA and GPU fallback is "
                         "disabled".format(layer.name))
                    return None
                layers.append({"name": layer.name, "type": str(layer.type).split(".")[-1],
                               "precision": str(prec).split(".")[-1],
                               "metadata": layer.metadata, "dla": dla,
                               "plugin": layer.op if "PLUGIN" in str(layer.type) else None})
            io = [{"name": t.name, "dtype": str(t.dtype).split(".")[-1],
                   "shape": list(t.shape), "input": True} for t in network.inputs]
            io += [{"name": t.name, "dtype": str(t.dtype).split(".")[-1],
                    "shape": list(t.shape), "input": False} for t in network.outputs]
            dla = (config.DLA_core if config.default_device_type == trt.DeviceType.DLA
                   else None)
            plan = {"version": p["version"], "layers": layers, "io": io, "dla_core": dla,
                    "flags": sorted(str(f) for f in config.flags),
                    "workspace": config.workspace, "memory_pools": dict(config.pools),
                    "profiles": [{n: [list(x) for x in v] for n, v in prof.shapes.items()}
                                 for prof in config.profiles],
                    "detailed": config.profiling_verbosity is not None}
            drv.builds.append(plan)
            return HostMemory(json.dumps(plan).encode())

    def _monitored(config, steps):
        """IProgressMonitor as TensorRT 10 drives it: a top-level phase with ``steps`` steps
        and a nested one; False (cancel) once step_complete returns False."""
        monitor = config.progress_monitor
        if monitor is None:
            return True
        monitor.phase_start("Building engine", None, steps)
        for step in range(steps):
            monitor.phase_start("Tactic selection", "Building engine", 1)
            ok = monitor.step_complete("Tactic selection", 0)
            monitor.phase_finish("Tactic selection")
            if not ok or not monitor.step_complete("Building engine", step):
                monitor.phase_finish("Building engine")
                return False
        monitor.phase_finish("Building engine")
        return True

    if version_tuple(p) >= (10, 0, 0):
        class IProgressMonitor(object):
            """NvInfer.h 10.0: phase_start / step_complete (False cancels) / phase_finish."""

            def __init__(self):
                pass

        trt.IProgressMonitor = IProgressMonitor

    if api["build_engine"]:
        Builder.build_engine = lambda self, network, config: None

    trt.Builder, trt.OnnxParser = Builder, OnnxParser
    trt.IBuilderConfig, trt.INetworkDefinition = Config, Network
