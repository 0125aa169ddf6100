"""The run side of the fake ``tensorrt`` (``tests/fake_trt.py``): the runtime that deserializes
the fake builder's JSON "engines", engines with the profile's I/O API (bindings or tensor
names), execution contexts, and the engine inspector's JSON in the profile's shape.
"""

import json

from tests.fake_trt import DTYPE_MEMBERS


def add_runtime(trt, p, drv):
    """Put Runtime on the fake ``trt``."""
    api = p["api"]
    Dims, Severity = trt.Dims, trt.ILogger.Severity
    attach, emit = trt._attach, trt._emit

    class Inspector(object):
        def __init__(self, plan):
            self.plan = plan

        def get_engine_information(self, fmt):
            insp = p["inspector"]
            words = {"FLOAT": "Float", "HALF": "Half", "INT8": "Int8", "INT32": "Int32",
                     "INT64": "Int64", "BOOL": "Bool", "BF16": "BFloat16", "FP8": "FP8"}
            layers = []
            run = []  # consecutive DLA layers: one {ForeignNode[first...last]} of type DLA

            def close_run():
                if run:
                    layers.append({"Name": "{{ForeignNode[{}...{}]}}".format(run[0], run[-1]),
                                   "LayerType": "DLA", "Outputs": [], "Metadata": ""})
                    del run[:]

            for layer in self.plan["layers"]:
                if not self.plan["detailed"]:
                    layers.append(layer["name"])
                    continue
                if layer.get("dla"):
                    run.append(layer["name"])
                    continue
                close_run()
                word = words.get(layer["precision"], layer["precision"])
                if insp["dtype_keys"] == ["Format/Datatype"]:
                    tensor = {"Name": layer["name"] + "_out",
                              "Format/Datatype": "Row major linear " + word}
                else:
                    tensor = {"Name": layer["name"] + "_out", "Format": "Row major linear",
                              insp["dtype_keys"][1]: word}
                layers.append({"Name": layer["name"], "LayerType": layer["type"],
                               "Outputs": [tensor], "Metadata": layer["metadata"]})
            close_run()
            return json.dumps({"Layers": layers,
                               insp["io_key"]: [t["name"] for t in self.plan["io"]]})

    class Context(object):
        """Shapes as TensorRT treats them: an input shape outside the first optimization
        profile is refused (False, an error logged) and leaves the outputs' dynamic dimensions
        unresolved (-1); an output's dynamic dimensions follow the first input's set shape."""

        def __init__(self, engine):
            self.engine = engine
            self.shapes = {}
            self.addresses = {}
            self.profiler = None  # IExecutionContext.profiler: an IProfiler, or None

        def _report(self):
            """An IProfiler set on the context hears every layer's time of each run (real
            TensorRT reports after the synchronous run; times here are the fake's)."""
            if self.profiler is not None:
                for i, layer in enumerate(self.engine.plan["layers"]):
                    self.profiler.report_layer_time(layer["name"], 0.01 * (i + 1))

        def set_input_shape(self, name, shape):
            shape = tuple(int(d) for d in shape)
            profiles = self.engine.plan.get("profiles") or [{}]
            limits = profiles[0].get(name)
            if limits is not None:
                lo, _, hi = limits
                if len(shape) != len(lo) or any(not a <= d <= b for a, d, b in
                                                zip(lo, shape, hi)):
                    emit(Severity.ERROR, "IExecutionContext::setInputShape: Error Code 3: API "
                         "Usage Error (Parameter check failed, condition: "
                         "satisfyProfile(bindingIndex, dimensions))")
                    self.shapes.pop(name, None)
                    return False
            self.shapes[name] = shape
            return True

        def _resolved(self, io):
            shape = list(io["shape"])
            if io["input"]:
                return Dims(self.shapes.get(io["name"], shape))
            first = [t for t in self.engine.order if t["input"]]
            given = self.shapes.get(first[0]["name"]) if first else None
            if given is not None and len(given) == len(shape):
                shape = [g if d < 0 else d for d, g in zip(shape, given)]
            return Dims(shape)

        def get_tensor_shape(self, name):
            return self._resolved(self.engine.io[name])

        def set_tensor_address(self, name, ptr):
            if name not in self.engine.io or not int(ptr):
                return False
            self.addresses[name] = ptr
            return True

        def execute_async_v3(self, handle):
            self._report()
            return drv.execute()

        def set_binding_shape(self, index, shape):
            return self.set_input_shape(self.engine.order[index]["name"], shape)

        def get_binding_shape(self, index):
            return self._resolved(self.engine.order[index])

        def execute_async_v2(self, bindings, handle):
            self._report()
            return drv.execute()

    class IProfiler(object):
        """TensorRT's IProfiler (every version): subclassed, ``report_layer_time(name, ms)``."""

        def __init__(self):
            pass

    trt.IProfiler = IProfiler

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
        for alias, name in DTYPE_MEMBERS.items():
            if name == member:
                return getattr(trt, alias)
        raise KeyError(member)

    class Runtime(object):
        def __init__(self, logger):
            attach(logger)
            self.DLA_core = -1
            drv.runtimes.append(self)
            if api["num_dla_cores"]:
                self.num_DLA_cores = drv.num_dla_cores

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
            for layer in plan["layers"]:
                if layer.get("plugin") and layer["plugin"] not in drv.plugins:
                    emit(Severity.ERROR, "getPluginCreator could not find plugin: {} version: "
                         "1".format(layer["plugin"]))
                    return None
            core = None
            if plan["dla_core"] is not None:
                core = self.DLA_core if self.DLA_core >= 0 else 0
            return Engine(plan, core)

    trt.Runtime = Runtime
