"""Version-faithful fakes of the hardware boundary: a ``tensorrt`` module built from one profile
in ``tests/trt_profiles/`` (which names exist, ``nptype``, the inspector's JSON shape, DLA, the
parser's Cast import, the process-wide logger pointer), and a ``pycuda.driver``
(``tests/fake_pycuda.py``) that records what a real driver would leak.

A profile is data with its sources cited in the file; this module turns it into the module's
enums, types and logger, ``tests/fake_trt_builder.py`` into the network, parser and builder,
``tests/fake_trt_runtime.py`` into the runtime, engine and inspector.

Use ``install(monkeypatch, profile)``: it puts both fakes in ``sys.modules``.
"""

import json
import os
import sys
import types

import numpy as np

from tests.fake_pycuda import make_pycuda

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "trt_profiles")
PROFILES = ("8.0", "8.2", "8.5", "8.6", "10.3", "10.13", "11.x")
# TensorRT's standard plugins (plugin/README.md), registered by init_libnvinfer_plugins.
STANDARD_PLUGINS = ("EfficientNMS_TRT", "BatchedNMS_TRT", "BatchedNMSDynamic_TRT", "NMS_TRT",
                    "ROIAlign_TRT", "PyramidROIAlign_TRT", "InstanceNormalization_TRT")


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
DTYPE_MEMBERS = {"float32": "FLOAT", "float16": "HALF", "int8": "INT8", "int32": "INT32",
                  "bool": "BOOL", "uint8": "UINT8", "fp8": "FP8", "bfloat16": "BF16",
                  "int64": "INT64", "int4": "INT4", "fp4": "FP4", "e8m0": "E8M0"}


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
        # The plugin registry: creators registered in this process (init_libnvinfer_plugins
        # adds the standard ones, load_library what a library registers: tests fill
        # ``library_plugins`` {file name: [op names]}, a fake .so registering those).
        self.plugins = set()
        self.library_plugins = {}
        self.libraries = []

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
    for alias, member in DTYPE_MEMBERS.items():
        if member in p["data_types"]:
            setattr(trt, alias, getattr(trt.DataType, member))
    trt.DeviceType = _enum("DeviceType", ["GPU", "DLA"])
    trt.TensorIOMode = _enum("TensorIOMode", ["NONE", "INPUT", "OUTPUT"])
    if api["memory_pool"]:
        pools = ["WORKSPACE", "DLA_MANAGED_SRAM"]
        if version_tuple(p) >= (8, 6, 0):  # NvInfer.h 8.6, 10.3: kTACTIC_DRAM = 4
            pools = {"WORKSPACE": 0, "DLA_MANAGED_SRAM": 1, "DLA_LOCAL_DRAM": 2,
                     "DLA_GLOBAL_DRAM": 3, "TACTIC_DRAM": 4}
        trt.MemoryPoolType = _enum("MemoryPoolType", pools)
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
    trt._attach = attach

    def init_libnvinfer_plugins(logger, namespace):
        drv.plugins.update(STANDARD_PLUGINS)
        return True

    class Registry(object):
        @property
        def plugin_creator_list(self):
            return [types.SimpleNamespace(name=n, plugin_version="1", plugin_namespace="")
                    for n in sorted(drv.plugins)]

        def get_plugin_creator(self, name, version, namespace=""):
            return (types.SimpleNamespace(name=name, plugin_version=version)
                    if name in drv.plugins else None)

    if version_tuple(p) >= (8, 6):  # IPluginRegistry::loadLibrary arrived in 8.6
        def load_library(self, path):
            drv.libraries.append(path)
            drv.plugins.update(drv.library_plugins.get(os.path.basename(path), ()))
            return types.SimpleNamespace(path=path)
        Registry.load_library = load_library

    registry = Registry()
    trt.init_libnvinfer_plugins = init_libnvinfer_plugins
    trt.get_plugin_registry = lambda: registry
    from tests.fake_trt_builder import add_builder  # they read this module's tables
    from tests.fake_trt_runtime import add_runtime

    add_builder(trt, p, drv)
    add_runtime(trt, p, drv)
    return trt


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
