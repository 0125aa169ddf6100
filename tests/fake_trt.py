"""Version-faithful fakes of the hardware boundary: a ``tensorrt`` module built from one profile
in ``tests/trt_profiles/`` (which names exist, ``nptype``, the inspector's JSON shape, DLA, the
parser's Cast import, the process-wide logger pointer), and a ``pycuda.driver`` that records
what a real driver would leak.

A profile is data with its sources cited in the file; this module only turns it into objects.
The fake builder's choice of layer precision follows NvInfer.h's rule for weakly typed
networks: a layer without a constraint runs in whatever the flags allow (modelled as the lowest
allowed precision, the worst case a device may pick).

Use ``install(monkeypatch, profile)``: it puts both fakes in ``sys.modules``.
"""

import json
import os
import sys
import types

import numpy as np
import onnx
from onnx import TensorProto, helper

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trt_profiles")
PROFILES = ("8.0", "8.2", "8.5", "8.6", "10.3", "10.13", "11.x")


def load_profile(name):
    with open(os.path.join(PROFILE_DIR, name + ".json")) as f:
        return json.load(f)


def version_tuple(profile):
    return tuple(int(p) for p in profile["version"].split(".")[:3])


class _Member(int):
    """An enum member: an int that prints like TensorRT's (``DataType.HALF``)."""

    def __new__(cls, kind, name, value):
        obj = int.__new__(cls, value)
        obj.kind, obj.name = kind, name
        return obj

    def __repr__(self):
        return "{}.{}".format(self.kind, self.name)

    __str__ = __repr__

    def __hash__(self):
        return hash((self.kind, int(self)))

    def __eq__(self, other):
        if isinstance(other, _Member):
            return self.kind == other.kind and int(self) == int(other)
        return NotImplemented

    def __ne__(self, other):
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq


def _enum(kind, members):
    """An enum from ``{name: value}`` (a profile, read from the headers) or a list of names."""
    if not isinstance(members, dict):
        members = {n: i for i, n in enumerate(members)}
    return types.SimpleNamespace(**{n: _Member(kind, n, v) for n, v in members.items()})


# TensorRT DataType member name -> module alias (trt.float16 is DataType.HALF).
_DTYPE_MEMBERS = {"float32": "FLOAT", "float16": "HALF", "int8": "INT8", "int32": "INT32",
                  "bool": "BOOL", "uint8": "UINT8", "fp8": "FP8", "bfloat16": "BF16",
                  "int64": "INT64", "int4": "INT4", "fp4": "FP4", "e8m0": "E8M0"}
_ONNX_TO_ALIAS = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16",
                  TensorProto.INT8: "int8", TensorProto.INT32: "int32",
                  TensorProto.INT64: "int64", TensorProto.BOOL: "bool",
                  TensorProto.UINT8: "uint8", TensorProto.BFLOAT16: "bfloat16"}
_OP_LAYER = {"Conv": "CONVOLUTION", "Relu": "ACTIVATION", "Sigmoid": "ACTIVATION",
             "Add": "ELEMENTWISE", "Sub": "ELEMENTWISE", "Mul": "ELEMENTWISE",
             "Div": "ELEMENTWISE", "MatMul": "MATRIX_MULTIPLY", "Gemm": "MATRIX_MULTIPLY",
             "Softmax": "SOFTMAX", "Shape": "SHAPE", "Constant": "CONSTANT",
             "Gather": "GATHER", "Identity": "IDENTITY", "Reshape": "SHUFFLE"}
_INT8_CAPABLE = ("CONVOLUTION", "MATRIX_MULTIPLY", "FULLY_CONNECTED")


class Driver(object):
    """State shared by the fake TensorRT objects of one profile (the library's globals)."""

    def __init__(self, profile, numpy_version=None):
        self.profile = profile
        self.numpy_version = numpy_version or np.__version__
        self.logger = None  # TensorRT keeps one logger pointer while a builder/runtime lives
        self.live = 0
        self.builds = []
        self.runtimes = []
        self.builders_alive = 0
        self.builders_at_deserialize = []  # builders alive at each deserialization
        self.on_execute = None  # install() points it at the fake GPU's clock

    def execute(self):
        if self.on_execute is not None:
            self.on_execute()
        return True


def make_trt(profile, numpy_version=None, num_dla_cores=0):
    """A ``tensorrt`` module for ``profile`` (a dict from ``load_profile``)."""
    p = profile
    drv = Driver(p, numpy_version)
    drv.num_dla_cores = num_dla_cores if p["dla_on_jetson"] else 0
    api = p["api"]
    trt = types.ModuleType("tensorrt")
    trt.__version__ = p["version"]
    trt._driver = drv
    trt.BuilderFlag = _enum("BuilderFlag", p["builder_flags"])
    trt.NetworkDefinitionCreationFlag = _enum("NetworkDefinitionCreationFlag", p["network_flags"])
    trt.LayerType = _enum("LayerType", p["layer_types"])
    trt.DataType = _enum("DataType", p["data_types"])
    for alias, member in _DTYPE_MEMBERS.items():
        if member in p["data_types"]:
            setattr(trt, alias, getattr(trt.DataType, member))
    trt.DeviceType = _enum("DeviceType", ["GPU", "DLA"])
    trt.TensorIOMode = _enum("TensorIOMode", ["NONE", "INPUT", "OUTPUT"])
    if api["memory_pool"]:
        trt.MemoryPoolType = _enum("MemoryPoolType", ["WORKSPACE", "DLA_MANAGED_SRAM"])
    if api["engine_inspector"]:
        trt.ProfilingVerbosity = _enum("ProfilingVerbosity", ["LAYER_NAMES_ONLY", "NONE",
                                                              "DETAILED"])
        trt.LayerInformationFormat = _enum("LayerInformationFormat", ["ONELINE", "JSON"])

    def nptype(trt_type):
        table = {}
        for alias in p["nptype"]["table"]:
            if alias == "bool":
                if p["nptype"]["bool_via_np_bool"]:
                    major_minor = tuple(int(x) for x in drv.numpy_version.split(".")[:2])
                    if (1, 24) <= major_minor < (2, 0):
                        # What the 8.x table literal does on NumPy 1.24 - 1.26.
                        raise AttributeError("module 'numpy' has no attribute 'bool'")
                table[trt.bool] = np.bool_
            else:
                table[getattr(trt, alias)] = np.dtype(alias).type
        if trt_type in table:
            return table[trt_type]
        raise TypeError("Could not resolve TensorRT datatype to an equivalent numpy datatype.")

    trt.nptype = nptype

    class Severity(object):
        INTERNAL_ERROR, ERROR, WARNING, INFO, VERBOSE = range(5)

    class ILogger(object):
        def __init__(self):
            pass

    ILogger.Severity = Severity
    trt.ILogger = ILogger

    class Dims(tuple):
        def __new__(cls, dims=()):
            return tuple.__new__(cls, tuple(int(d) for d in dims))

    trt.Dims = Dims

    def attach(logger):
        if drv.live == 0 or drv.logger is None:
            drv.logger = logger
        drv.live += 1

    def emit(severity, msg):
        if drv.logger is not None:
            drv.logger.log(severity, msg)

    trt._emit = emit
    for base in api["calibrators"]:
        setattr(trt, base, type(base, (object,), {"__init__": lambda self: None}))

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
        def __init__(self, desc):
            self._desc = desc

        def code(self):
            return "ErrorCode.UNSUPPORTED_NODE"

        def desc(self):
            return self._desc

        def node(self):
            return -1

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
            for node in model.graph.node:
                if node.op_type == "Cast":
                    kind = p["cast_layer"]
                    to = helper.get_attribute_value(
                        [a for a in node.attribute if a.name == "to"][0])
                    dtype = getattr(trt, _ONNX_TO_ALIAS[to])
                else:
                    kind = _OP_LAYER.get(node.op_type, "ELEMENTWISE")
                    dtype = getattr(trt, _ONNX_TO_ALIAS.get(types_.get(node.output[0],
                                                                       TensorProto.FLOAT),
                                                            "float32"))
                    if node.op_type == "Shape":
                        dtype = getattr(trt, "int64", trt.int32)
                outs = [Tensor(o, dtype) for o in node.output]
                layer = Layer(node.name, getattr(trt.LayerType, kind), outs, node.op_type)
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
            return types.SimpleNamespace(data=bytes(data), serialize=lambda: b"timing",
                                         combine=lambda other, ignore: True)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.timing = cache
            return True

        def get_timing_cache(self):
            return self.timing

    if api["memory_pool"]:
        Config.set_memory_pool_limit = lambda self, pool, size: None
    if api["max_workspace_size"]:
        Config.max_workspace_size = 0

    class Profile(object):
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (lo, opt, hi)

    def _flag(name):
        return getattr(trt.BuilderFlag, name, None)

    def choose(layer, config, strongly_typed):
        """The precision a layer gets (see the module docstring)."""
        if layer.type == getattr(trt.LayerType, "CAST", None) or layer.op == "Cast":
            return layer.output_types.get(0, layer.get_output(0).dtype)
        out_dtype = layer.get_output(0).dtype
        if out_dtype not in (trt.float32, trt.float16):
            return out_dtype
        if strongly_typed:
            return out_dtype
        constrained = any(f in config.flags for f in (
            _flag("OBEY_PRECISION_CONSTRAINTS"), _flag("PREFER_PRECISION_CONSTRAINTS"),
            _flag("STRICT_TYPES")) if f is not None)
        if constrained and layer.precision_is_set:
            return layer.precision
        if _flag("INT8") in config.flags and layer.type in [
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
            if config.int8_calibrator is not None:
                calib = config.int8_calibrator
                cache = calib.read_calibration_cache()
                if not cache:
                    names = [t.name for t in network.inputs]
                    while calib.get_batch(names) is not None:
                        pass
                    calib.write_calibration_cache(b"TRT-calibration-cache\n")
            layers = []
            for layer in network.layers:
                prec = choose(layer, config, strongly_typed)
                layers.append({"name": layer.name, "type": str(layer.type).split(".")[-1],
                               "precision": str(prec).split(".")[-1],
                               "metadata": layer.metadata})
            io = [{"name": t.name, "dtype": str(t.dtype).split(".")[-1],
                   "shape": list(t.shape), "input": True} for t in network.inputs]
            io += [{"name": t.name, "dtype": str(t.dtype).split(".")[-1],
                    "shape": list(t.shape), "input": False} for t in network.outputs]
            dla = (config.DLA_core if config.default_device_type == trt.DeviceType.DLA
                   else None)
            plan = {"version": p["version"], "layers": layers, "io": io, "dla_core": dla,
                    "flags": sorted(str(f) for f in config.flags),
                    "detailed": config.profiling_verbosity is not None}
            drv.builds.append(plan)
            return HostMemory(json.dumps(plan).encode())

    if api["build_engine"]:
        Builder.build_engine = lambda self, network, config: None

    class Inspector(object):
        def __init__(self, plan):
            self.plan = plan

        def get_engine_information(self, fmt):
            insp = p["inspector"]
            words = {"FLOAT": "Float", "HALF": "Half", "INT8": "Int8", "INT32": "Int32",
                     "INT64": "Int64", "BOOL": "Bool", "BF16": "BFloat16", "FP8": "FP8"}
            layers = []
            for layer in self.plan["layers"]:
                if not self.plan["detailed"]:
                    layers.append(layer["name"])
                    continue
                word = words.get(layer["precision"], layer["precision"])
                if insp["dtype_keys"] == ["Format/Datatype"]:
                    tensor = {"Name": layer["name"] + "_out",
                              "Format/Datatype": "Row major linear " + word}
                else:
                    tensor = {"Name": layer["name"] + "_out", "Format": "Row major linear",
                              "Datatype": word}
                layers.append({"Name": layer["name"], "LayerType": layer["type"],
                               "Outputs": [tensor], "Metadata": layer["metadata"]})
            return json.dumps({"Layers": layers,
                               insp["io_key"]: [t["name"] for t in self.plan["io"]]})

    class Context(object):
        def __init__(self, engine):
            self.engine = engine
            self.shapes = {}
            self.addresses = {}

        def set_input_shape(self, name, shape):
            self.shapes[name] = tuple(shape)
            return True

        def get_tensor_shape(self, name):
            return Dims(self.engine.io[name]["shape"])

        def set_tensor_address(self, name, ptr):
            self.addresses[name] = ptr
            return True

        def execute_async_v3(self, handle):
            return drv.execute()

        def set_binding_shape(self, index, shape):
            return True

        def get_binding_shape(self, index):
            return Dims(self.engine.order[index]["shape"])

        def execute_async_v2(self, bindings, handle):
            return drv.execute()

    class Engine(object):
        def __init__(self, plan, dla_core):
            self.plan = plan
            self.dla_core = dla_core  # the core it runs on (runtime.DLA_core)
            self.order = plan["io"]
            self.io = {t["name"]: t for t in plan["io"]}

        def create_execution_context(self):
            return Context(self)

        def create_engine_inspector(self):
            return Inspector(self.plan)

    if api["tensor_io"]:
        Engine.num_io_tensors = property(lambda self: len(self.order))
        Engine.get_tensor_name = lambda self, i: self.order[i]["name"]
        Engine.get_tensor_dtype = lambda self, n: _alias(self.io[n])
        Engine.get_tensor_shape = lambda self, n: Dims(self.io[n]["shape"])
        Engine.get_tensor_mode = lambda self, n: (trt.TensorIOMode.INPUT if self.io[n]["input"]
                                                  else trt.TensorIOMode.OUTPUT)
    if api["bindings"]:
        Engine.num_bindings = property(lambda self: len(self.order))
        Engine.get_binding_name = lambda self, i: self.order[i]["name"]
        Engine.get_binding_dtype = lambda self, i: _alias(self.order[i])
        Engine.get_binding_shape = lambda self, i: Dims(self.order[i]["shape"])
        Engine.binding_is_input = lambda self, i: self.order[i]["input"]
    if not api["engine_inspector"]:
        del Engine.create_engine_inspector

    def _alias(io):
        member = io["dtype"]
        for alias, name in _DTYPE_MEMBERS.items():
            if name == member:
                return getattr(trt, alias)
        raise KeyError(member)

    class Runtime(object):
        def __init__(self, logger):
            attach(logger)
            self.DLA_core = -1
            drv.runtimes.append(self)

        def __del__(self):
            drv.live -= 1

        def deserialize_cuda_engine(self, data):
            drv.builders_at_deserialize.append(drv.builders_alive)
            try:
                plan = json.loads(bytes(data).decode())
            except ValueError:
                emit(Severity.ERROR, "Serialization assertion failed: magic tag mismatch")
                return None
            if plan["version"] != p["version"]:
                emit(Severity.ERROR, "engine built with TensorRT {}".format(plan["version"]))
                return None
            core = None
            if plan["dla_core"] is not None:
                core = self.DLA_core if self.DLA_core >= 0 else 0
            return Engine(plan, core)

    trt.Builder, trt.Runtime, trt.OnnxParser = Builder, Runtime, OnnxParser
    trt.IBuilderConfig, trt.INetworkDefinition = Config, Network
    return trt


# -- pycuda --------------------------------------------------------------------------------

def make_pycuda(devices=("Orin (nvgpu)",), cc=(8, 7)):
    """``(pycuda package, pycuda.driver)``. ``driver.leaked`` lists the streams and events that
    were destroyed when their context was no longer current (pycuda then skips
    cuStreamDestroy / cuEventDestroy: a leak). Device time is a clock that each queued copy
    (and, through ``install``, each execution) advances by ``driver.cost_ms[kind]``; an event
    records it, so event timings are exact: one input, one output gives 1.0 ms per inference."""
    cuda = types.ModuleType("pycuda.driver")
    cuda.leaked = []
    cuda.stack = []
    cuda.live_objects = 0
    cuda.cost_ms = {"htod": 0.25, "execute": 0.5, "dtoh": 0.25}
    cuda.clock_ms = [0.0]

    def advance(kind):
        cuda.clock_ms[0] += cuda.cost_ms[kind]

    cuda.advance = advance

    class Error(Exception):
        pass

    class Context(object):
        def __init__(self):
            self.detached = False

        def push(self):
            cuda.stack.append(self)

        def detach(self):
            self.detached = True

        @staticmethod
        def pop():
            cuda.stack.pop()

    class Device(object):
        def __init__(self, index):
            self.index = index
            self.ctx = Context()

        @staticmethod
        def count():
            return len(devices)

        def name(self):
            return devices[self.index]

        def compute_capability(self):
            return cc

        def retain_primary_context(self):
            return self.ctx

    class _ContextDependent(object):
        kind = "object"

        def __init__(self):
            self.ctx = cuda.stack[-1] if cuda.stack else None
            cuda.live_objects += 1

        def __del__(self):
            cuda.live_objects -= 1
            if self.ctx is None or self.ctx.detached or self.ctx not in cuda.stack:
                cuda.leaked.append(self.kind)

    class Stream(_ContextDependent):
        kind = "stream"
        handle = 1234

        def synchronize(self):
            pass

    class Event(_ContextDependent):
        kind = "event"

        at = None

        def record(self, stream=None):
            self.at = cuda.clock_ms[0]

        def synchronize(self):
            if self.at is None:
                raise Error("cuEventSynchronize failed: event never recorded")

        def time_since(self, other):
            if self.at is None or other.at is None:
                raise Error("cuEventElapsedTime failed: invalid resource handle")
            return self.at - other.at

    class Allocation(object):
        count = [0]

        def __init__(self, nbytes):
            Allocation.count[0] += 1
            self.ptr = 4096 * Allocation.count[0]

        def __int__(self):
            return self.ptr

        def free(self):
            pass

    cuda.Error, cuda.Context, cuda.Device, cuda.Stream, cuda.Event = (Error, Context, Device,
                                                                        Stream, Event)
    cuda.init = lambda: None
    cuda.get_driver_version = lambda: 12020
    cuda.mem_alloc = Allocation
    cuda.pagelocked_empty = lambda shape, dtype: np.zeros(shape, dtype)
    cuda.memcpy_htod = lambda ptr, host: None
    cuda.memcpy_dtoh = lambda host, ptr: None
    cuda.memcpy_htod_async = lambda ptr, host, stream: advance("htod")
    cuda.memcpy_dtoh_async = lambda host, ptr, stream: advance("dtoh")
    pkg = types.ModuleType("pycuda")
    pkg.driver = cuda
    return pkg, cuda


def install(monkeypatch, name, numpy_version=None, num_dla_cores=0):
    """Put a fake ``tensorrt`` (profile ``name``) and a fake pycuda in sys.modules; returns
    (trt, cuda)."""
    trt = make_trt(load_profile(name), numpy_version, num_dla_cores)
    pkg, cuda = make_pycuda()
    trt._driver.on_execute = lambda: cuda.advance("execute")
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "pycuda", pkg)
    monkeypatch.setitem(sys.modules, "pycuda.driver", cuda)
    return trt, cuda
