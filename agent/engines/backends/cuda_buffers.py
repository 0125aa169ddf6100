"""CUDA memory for the tensorrt backend, over pycuda and nothing else.

The pieces TensorRT needs but that do not need TensorRT: a pushed CUDA context, device copies of
calibration batches (``DeviceBuffers``), pinned host + device buffers for a runner's inputs and
outputs (``IOBuffers``), and CUDA-event timing (``EventTimer``). Keeping them apart from
TensorRT lets a plain CUDA GPU test them.

pycuda is imported lazily so that importing this module never needs a GPU. Worker side:
Python >= 3.6.
"""

from time import perf_counter
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from agent.errors import AgentError


def _cuda() -> Any:
    try:
        import pycuda.driver as cuda
    except ImportError as exc:
        raise AgentError(
            "backend_unavailable",
            "the tensorrt backend needs pycuda (pip install pycuda) and a CUDA driver; "
            "importing pycuda.driver failed: {}".format(exc),
        )
    return cuda


def require_pycuda() -> None:
    """Raise ``backend_unavailable`` now (not mid-build) when pycuda cannot be imported."""
    _cuda()


def driver_version() -> str:
    """The CUDA driver's version, e.g. ``"12.2"``."""
    version = int(_cuda().get_driver_version())
    return "{}.{}".format(version // 1000, (version % 1000) // 10)


def cuda_version() -> str:
    """The CUDA version pycuda was built against (the toolkit on this device), e.g.
    ``"12.6"``."""
    version = tuple(_cuda().get_version())
    return "{}.{}".format(version[0], version[1])


class CudaContext(object):
    """Makes ``device``'s primary context current (the context the CUDA runtime, and so
    TensorRT, uses) until ``close()``. A context manager."""

    def __init__(self, device: int = 0) -> None:
        cuda = _cuda()
        try:
            cuda.init()
            count = cuda.Device.count()
        except cuda.Error as exc:
            raise AgentError("backend_unavailable",
                             "CUDA could not be initialised: {}".format(exc))
        if not 0 <= device < count:
            raise AgentError(
                "backend_unavailable",
                "CUDA device {} was asked for, found {} device(s)".format(device, count))
        self.device = cuda.Device(device)
        self._ctx = self.device.retain_primary_context()
        self._ctx.push()
        self._open = True

    def name(self) -> str:
        return str(self.device.name())

    def sm_count(self) -> int:
        """The GPU's multiprocessor count (AGX Orin 32 GB: 14, 64 GB: 16)."""
        cuda = _cuda()
        return int(self.device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT))

    def compute_capability(self) -> Tuple[int, int]:
        major, minor = self.device.compute_capability()
        return int(major), int(minor)

    def close(self) -> None:
        if self._open:
            self._open = False
            _cuda().Context.pop()
            self._ctx.detach()

    def __enter__(self) -> "CudaContext":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class DeviceMemory(object):
    """One device allocation that grows on demand (never shrinks)."""

    def __init__(self) -> None:
        self._alloc: Any = None
        self.nbytes = 0

    def ensure(self, nbytes: int) -> int:
        """Make room for ``nbytes``; returns the device pointer."""
        if self._alloc is None or nbytes > self.nbytes:
            self.free()
            self.nbytes = max(int(nbytes), 1)  # cuMemAlloc refuses 0 bytes
            self._alloc = _cuda().mem_alloc(self.nbytes)
        return self.ptr

    @property
    def ptr(self) -> int:
        if self._alloc is None:
            raise ValueError("device memory used before allocation")
        return int(self._alloc)

    def free(self) -> None:
        if self._alloc is not None:
            self._alloc.free()
            self._alloc = None
            self.nbytes = 0


class DeviceBuffers(object):
    """Device copies of named host arrays, e.g. one calibration batch at a time.

    ``upload`` copies synchronously (TensorRT reads the pointers after ``get_batch`` returns),
    reusing each name's allocation while the arrays fit."""

    def __init__(self) -> None:
        self._mem: Dict[str, DeviceMemory] = {}

    def upload(self, arrays: Dict[str, np.ndarray],
               dtypes: Optional[Dict[str, Any]] = None) -> Dict[str, int]:
        """Copy each array to the device (cast to ``dtypes[name]`` when given); returns the
        device pointer of each name."""
        cuda = _cuda()
        out: Dict[str, int] = {}
        for name, array in arrays.items():
            dtype = (dtypes or {}).get(name, np.asarray(array).dtype)
            host = np.ascontiguousarray(array, dtype=dtype)
            mem = self._mem.get(name)
            if mem is None:
                mem = self._mem[name] = DeviceMemory()
            ptr = mem.ensure(host.nbytes)
            if host.nbytes:
                cuda.memcpy_htod(ptr, host)
            out[name] = ptr
        return out

    def pointer(self, name: str) -> int:
        return self._mem[name].ptr

    def download(self, name: str, shape: Sequence[int], dtype: Any) -> np.ndarray:
        """Copy ``name`` back to a new host array (what the device really holds)."""
        host = np.empty(tuple(shape), dtype=dtype)
        if host.nbytes > self._mem[name].nbytes:
            raise ValueError("{}: {} bytes asked, {} on the device".format(
                name, host.nbytes, self._mem[name].nbytes))
        if host.nbytes:
            _cuda().memcpy_dtoh(host, self._mem[name].ptr)
        return host

    def free(self) -> None:
        for mem in self._mem.values():
            mem.free()
        self._mem.clear()


class IOBuffers(object):
    """Pinned host arrays and device memory for an engine's inputs and outputs, with
    asynchronous copies on one stream. Shapes may change between calls (dynamic shapes): the
    pinned array is replaced and the device memory grows when needed."""

    def __init__(self, stream: Any = None) -> None:
        cuda = _cuda()
        self.stream = stream if stream is not None else cuda.Stream()
        self._host: Dict[str, np.ndarray] = {}
        self._dev: Dict[str, DeviceMemory] = {}

    def ensure(self, name: str, shape: Sequence[int], dtype: Any) -> np.ndarray:
        """The pinned host array of ``name`` with this shape and dtype."""
        shape = tuple(int(d) for d in shape)
        dtype = np.dtype(dtype)
        host = self._host.get(name)
        if host is None or host.shape != shape or host.dtype != dtype:
            host = _cuda().pagelocked_empty(shape, dtype)
            self._host[name] = host
        mem = self._dev.get(name)
        if mem is None:
            mem = self._dev[name] = DeviceMemory()
        mem.ensure(host.nbytes)
        return host

    def host(self, name: str) -> np.ndarray:
        return self._host[name]

    def device_ptr(self, name: str) -> int:
        return self._dev[name].ptr

    def set_input(self, name: str, array: np.ndarray, dtype: Any) -> None:
        """Put ``array`` (cast to ``dtype``) in the pinned buffer of ``name``."""
        array = np.asarray(array)
        host = self.ensure(name, array.shape, dtype)
        np.copyto(host, array, casting="unsafe")

    def to_device(self, names: Sequence[str]) -> None:
        cuda = _cuda()
        for name in names:
            host = self._host[name]
            if host.nbytes:
                cuda.memcpy_htod_async(self._dev[name].ptr, host, self.stream)

    def to_host(self, names: Sequence[str]) -> None:
        cuda = _cuda()
        for name in names:
            host = self._host[name]
            if host.nbytes:
                cuda.memcpy_dtoh_async(host, self._dev[name].ptr, self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def free(self) -> None:
        for mem in self._dev.values():
            mem.free()
        self._dev.clear()
        self._host.clear()

    def close(self) -> None:
        """Free the memory and drop the stream now, while its context is current: pycuda
        destroys a stream when its last reference goes, and skips it (a leak) once the
        context is detached. Call ``EventTimer.close`` first: it holds the stream too."""
        if self.stream is not None:
            self.stream.synchronize()
        self.free()
        self.stream = None


class EventTimer(object):
    """Times work queued on a stream with CUDA events (device time, not host time)."""

    def __init__(self, stream: Any) -> None:
        cuda = _cuda()
        self.stream = stream
        self._start: Any = cuda.Event()
        self._end: Any = cuda.Event()
        # Between the inputs' copies and the execution, and between it and the outputs'.
        self._inputs_done: Any = cuda.Event()
        self._compute_done: Any = cuda.Event()

    def close(self) -> None:
        """Drop the events and the stream reference while the context is current (see
        ``IOBuffers.close``)."""
        self._start = self._end = self._inputs_done = self._compute_done = None
        self.stream = None

    def time(self, enqueue: Callable[[], None], iterations: int,
             warmup: int = 0) -> List[float]:
        """Milliseconds of each of ``iterations`` runs of ``enqueue`` (which queues work on
        the stream), after ``warmup`` untimed runs."""
        if iterations < 1:
            raise AgentError("bad_argument",
                             "iterations must be >= 1, found {}".format(iterations))
        for _ in range(max(0, warmup)):
            enqueue()
        self.stream.synchronize()
        times: List[float] = []
        for _ in range(iterations):
            self._start.record(self.stream)
            enqueue()
            self._end.record(self.stream)
            self._end.synchronize()
            times.append(float(self._end.time_since(self._start)))
        return times

    def time_phases(self, h2d: Callable[[], None], execute: Callable[[], None],
                    d2h: Callable[[], None], iterations: int,
                    clock: Callable[[], float] = perf_counter) -> List[Dict[str, float]]:
        """trtexec's split of each of ``iterations`` inferences, in milliseconds: ``h2d`` (the
        input copies), ``compute`` (what ``execute`` queued) and ``d2h`` (the output copies)
        between CUDA events on the stream, and ``enqueue``: the host's time in ``execute``
        (trtexec's Enqueue Time: when it exceeds compute, the host cannot keep the GPU busy).
        One stream, so each phase starts when the one before ends, as trtexec's events wait
        on each other."""
        if iterations < 1:
            raise AgentError("bad_argument",
                             "iterations must be >= 1, found {}".format(iterations))
        marks = (self._start, self._inputs_done, self._compute_done, self._end)
        stream = self.stream
        stream.synchronize()
        rows: List[Dict[str, float]] = []
        for _ in range(iterations):
            marks[0].record(stream)
            h2d()
            marks[1].record(stream)
            began = clock()
            execute()
            enqueue_s = clock() - began
            marks[2].record(stream)
            d2h()
            marks[3].record(stream)
            marks[3].synchronize()
            rows.append({"enqueue": enqueue_s * 1000.0,
                         "h2d": float(marks[1].time_since(marks[0])),
                         "compute": float(marks[2].time_since(marks[1])),
                         "d2h": float(marks[3].time_since(marks[2]))})
        return rows
