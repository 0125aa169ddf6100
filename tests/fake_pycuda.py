"""A fake ``pycuda.driver`` for the hardware boundary (``tests/fake_trt.py`` installs it with the
fake TensorRT): contexts, streams and events that record what a real driver would leak, and a
device clock that makes event timings exact.
"""

import types

import numpy as np


def make_pycuda(devices=("Orin (nvgpu)",), cc=(8, 7), sm_count=16, cuda_version=(12, 6, 0)):
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
    cuda.sm_count = sm_count  # tests change it to stand for another module
    cuda.device_attribute = types.SimpleNamespace(MULTIPROCESSOR_COUNT=16)
    cuda.get_version = lambda: tuple(cuda_version)

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

        def get_attribute(self, attribute):
            if attribute == cuda.device_attribute.MULTIPROCESSOR_COUNT:
                return cuda.sm_count
            raise Error("attribute {} not faked".format(attribute))

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
