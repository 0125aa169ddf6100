"""TensorRT INT8 calibrators (TensorRT 8.x .. 10.x implicit quantization) over pycuda buffers.

TensorRT pulls calibration batches through ``get_batch(names)``, which must return one device
pointer per network input (or None when the data is exhausted). ``BatchFeeder`` does that part
with no TensorRT at all: it takes batches from a stream (``calib.dataset.CalibrationDataset``
or any iterable of ``{input name: ndarray}``), copies each to the device with
``DeviceBuffers`` and hands back the pointers, which stay valid until the next batch.

The calibrator classes themselves must subclass TensorRT's base classes (and call their
``__init__``), so ``make_calibrator`` builds them when called, importing TensorRT then:
importing this module needs neither TensorRT nor pycuda.

``percentile`` has no TensorRT calibrator: the backend runs the data through an fp32 engine,
computes the ranges with ``calib.ranges`` and hands them to TensorRT directly. Worker side:
Python >= 3.6.
"""

import os
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence

import numpy as np

from agent.engines.backends.base import Progress, no_progress
from agent.errors import AgentError
from agent.fsio import atomic_write

# Our algorithm name -> TensorRT's calibrator base class.
CALIBRATOR_BASES = {
    "entropy2": "IInt8EntropyCalibrator2",
    "minmax": "IInt8MinMaxCalibrator",
    "legacy": "IInt8LegacyCalibrator",
}
# The legacy calibrator's knobs; the same defaults as calib.ranges' host version.
LEGACY_QUANTILE = 0.9999
LEGACY_REGRESSION_CUTOFF = 0.5


# Inputs TensorRT reads in their own type during calibration (index inputs); every other input
# (float16, uint8, int8, ...) is read as float32 (Polygraphy's calibrator: "TensorRT requires
# non-index calibration inputs to be provided in float32", for all but FLOAT32, INT32, INT64
# and BOOL).
INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.bool_))


def calibration_dtypes(inputs: Sequence[Any]) -> Dict[str, Any]:
    """The dtype each network input is fed in during calibration: the input's own type for
    index inputs (int32, int64, bool), float32 for every other (a uint8 image input too: fed
    in its own type, TensorRT would read four times its bytes as floats). ``inputs`` are
    ``TensorSpec``s."""
    out: Dict[str, Any] = {}
    for spec in inputs:
        dtype = np.dtype(spec.dtype)
        out[spec.name] = dtype.type if dtype in INDEX_DTYPES else np.float32
    return out


def read_cache_bytes(path: Optional[str]) -> Optional[bytes]:
    """The calibration cache's bytes when the file exists (TensorRT then skips calibration),
    else None."""
    if not path or not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        data = f.read()
    return data or None


def write_cache_bytes(path: Optional[str], data: Any) -> None:
    """Write what TensorRT hands ``write_calibration_cache`` (a buffer) atomically."""
    if path:
        atomic_write(path, bytes(data))


class BatchFeeder(object):
    """Calibrator-style batch delivery without TensorRT.

    ``get_batch(names)`` takes the next batch, checks it holds every name with the expected
    batch size (and, when ``shapes`` is given, exactly those shapes: TensorRT reads as many
    bytes as the calibration profile says), copies it to the device and returns the pointers in
    ``names`` order; None once the stream is exhausted. ``batches_fed`` counts what was
    delivered."""

    def __init__(
        self,
        batches: Iterable[Dict[str, np.ndarray]],
        batch_size: int,
        dtypes: Optional[Dict[str, Any]] = None,
        buffers: Any = None,
        progress: Progress = no_progress,
        total: int = 0,
        shapes: Optional[Mapping[str, Sequence[int]]] = None,
    ) -> None:
        self._batches = batches
        self._iter: Optional[Iterator[Dict[str, np.ndarray]]] = None
        self.batch_size = int(batch_size)
        self.dtypes = dict(dtypes or {})
        self.shapes = {n: tuple(int(d) for d in s) for n, s in (shapes or {}).items()}
        if buffers is None:
            from agent.engines.backends.cuda_buffers import DeviceBuffers

            buffers = DeviceBuffers()
        self.buffers = buffers
        self.progress = progress
        self.total = int(total)
        self.batches_fed = 0
        self.done = False

    def get_batch(self, names: Sequence[str]) -> Optional[List[int]]:
        if self.done:
            return None
        if self._iter is None:
            self._iter = iter(self._batches)
        try:
            batch = next(self._iter)
        except StopIteration:
            self.done = True
            return None
        missing = [n for n in names if n not in batch]
        if missing:
            raise AgentError(
                "bad_calibration_data",
                "calibration batch {}: expected arrays for inputs {}, found {}".format(
                    self.batches_fed + 1, ", ".join(names), ", ".join(sorted(batch))))
        for name in names:
            found = np.shape(batch[name])[:1]
            if found != (self.batch_size,):
                raise AgentError(
                    "bad_calibration_data",
                    "calibration batch {}: input {!r}: expected {} samples, found {}".format(
                        self.batches_fed + 1, name, self.batch_size,
                        found[0] if found else "a scalar"))
            want = self.shapes.get(name)
            if want is not None and tuple(np.shape(batch[name])) != want:
                raise AgentError(
                    "bad_calibration_data",
                    "calibration batch {}: input {!r}: expected shape {} (the calibration "
                    "profile), found {}".format(self.batches_fed + 1, name, list(want),
                                                list(np.shape(batch[name]))))
        pointers = self.buffers.upload({n: batch[n] for n in names}, self.dtypes)
        self.batches_fed += 1
        self.progress("calibrating", self.batches_fed, self.total)
        return [pointers[n] for n in names]

    def close(self) -> None:
        self.buffers.free()


def _calibrator_base(algorithm: str) -> Any:
    """TensorRT's base class for ``algorithm``; TensorRT 11 has none (explicit types only)."""
    import tensorrt as trt

    name = CALIBRATOR_BASES.get(algorithm)
    if name is None:
        raise AgentError(
            "bad_argument",
            "TensorRT has calibrators for {}, found {!r} (percentile ranges are computed on "
            "the host)".format(", ".join(sorted(CALIBRATOR_BASES)), algorithm))
    base = getattr(trt, name, None)
    if base is None:
        raise AgentError(
            "unsupported_precision",
            "TensorRT {} has no {}: implicit INT8 calibration is gone; the explicitly typed "
            "path (TensorRT >= 10.12) is needed".format(trt.__version__, name))
    return base


if TYPE_CHECKING:  # mypy checks that the base classes named above exist in the stubs
    import tensorrt

    _BASES = (tensorrt.IInt8EntropyCalibrator2, tensorrt.IInt8MinMaxCalibrator,
              tensorrt.IInt8LegacyCalibrator)


def make_calibrator(
    algorithm: str,
    feeder: Optional[BatchFeeder],
    batch_size: int,
    cache_path: Optional[str],
    cache_bytes: Optional[bytes] = None,
    explicit_batch: bool = True,
) -> Any:
    """A TensorRT calibrator for ``algorithm`` (entropy2 / minmax / legacy).

    ``cache_bytes`` (a compatible cache read beforehand) is what ``read_calibration_cache``
    returns, so TensorRT skips calibration; ``feeder`` may then be None. The cache TensorRT
    produces is written atomically to ``cache_path``.

    ``get_batch_size`` answers 1 for explicit-batch networks (every ONNX network): the batch is
    the calibration profile's leading dimension, as in Polygraphy's calibrator (whose
    ``batch_size`` defaults to 1 and is deprecated); TensorRT deprecates the call in 10.1."""
    base = _calibrator_base(algorithm)
    if feeder is None and cache_bytes is None:
        raise AgentError("bad_argument",
                         "INT8 calibration needs calibration data or a calibration cache")

    class Calibrator(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            base.__init__(self)  # TensorRT's trampoline must be initialised explicitly
            self.feeder = feeder
            self.cache_path = cache_path
            self.cache_bytes = cache_bytes
            # An exception must not cross TensorRT's C++ frames: it is kept here, calibration
            # ends, and the backend raises it after the build returns.
            self.error: Optional[BaseException] = None

        def get_batch_size(self) -> int:
            return 1 if explicit_batch else int(batch_size)

        def get_batch(self, names: List[str], *unused: Any) -> Optional[List[int]]:
            if self.feeder is None or self.error is not None:
                return None
            try:
                return self.feeder.get_batch(names)
            except Exception as exc:  # noqa: BLE001 (re-raised by the backend)
                self.error = exc
                return None

        def read_calibration_cache(self, *unused: Any) -> Optional[bytes]:
            return self.cache_bytes

        def write_calibration_cache(self, cache: Any, *unused: Any) -> None:
            self.cache_bytes = bytes(cache)
            try:
                write_cache_bytes(self.cache_path, self.cache_bytes)
            except Exception as exc:  # noqa: BLE001 (re-raised by the backend)
                self.error = exc

        # Only the legacy calibrator asks for these.
        def get_quantile(self) -> float:
            return LEGACY_QUANTILE

        def get_regression_cutoff(self) -> float:
            return LEGACY_REGRESSION_CUTOFF

        def read_histogram_cache(self, *unused: Any) -> None:
            return None

        def write_histogram_cache(self, *unused: Any) -> None:
            return None

    Calibrator.__name__ = "{}Calibrator".format(algorithm.capitalize())
    return Calibrator()
