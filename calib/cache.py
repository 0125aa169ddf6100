"""TensorRT's calibration cache text format, read and written by both backends.

The format (TensorRT 7 .. 10)::

    TRT-<version>-<Algorithm>
    <tensor name>: <big-endian IEEE-754 float32 bits of scale, hex>
    ...

``version`` is ``major*1000 + minor*100 + patch`` up to 8.x (8.6.1 -> 8601) and
``major*10000 + minor*100 + patch`` from 10.x on (10.3.0 -> 100300). ``scale = amax / 127``.
Tensor names may themselves contain ``": "``, so lines are split on the last one. TensorRT
reuses a cache only when algorithm and version match, which ``check_compatible`` mirrors.

TensorRT has no percentile calibrator: caches made on the host with ``percentile`` carry the
name ``PercentileCalibration``, which no TensorRT calibrator will accept as its own (a device
recalibrates, or uses the scales through the explicitly typed Q/DQ path).

Worker side: Python >= 3.6.
"""

import math
import os
import struct
from typing import Dict, Optional, Tuple

from agent.errors import AgentError
from agent.fsio import atomic_write_text
from agent.version_key import version_key

# The TensorRT of JetPack 6 (L4T r36): the default target of caches written on a host.
DEFAULT_TRT_VERSION = "10.3.0"

# Our algorithm names -> the names TensorRT writes in cache headers.
ALGORITHM_NAMES = {
    "entropy2": "EntropyCalibration2",
    "entropy": "EntropyCalibration",
    "minmax": "MinMaxCalibration",
    "legacy": "LegacyCalibration",
    "percentile": "PercentileCalibration",
}
_ALGORITHM_KEYS = {v: k for k, v in ALGORITHM_NAMES.items()}

INT8_MAX = 127.0


class CalibrationCache(object):
    """A parsed cache: ``header`` (first line), ``algorithm`` (TensorRT's name, e.g.
    ``EntropyCalibration2``), ``version`` (the header's integer tag as text, e.g. ``"100300"``),
    ``scales`` (tensor name -> scale)."""

    def __init__(self, header: str, algorithm: str, version: str,
                 scales: Dict[str, float]) -> None:
        self.header = header
        self.algorithm = algorithm
        self.version = version
        self.scales = dict(scales)

    @property
    def amax(self) -> Dict[str, float]:
        """Tensor name -> largest absolute value kept (scale * 127)."""
        return {name: scale * INT8_MAX for name, scale in self.scales.items()}

    @property
    def algorithm_key(self) -> Optional[str]:
        """Our short name for the algorithm (``entropy2`` ...), None when unknown."""
        return _ALGORITHM_KEYS.get(self.algorithm)

    @property
    def trt_version(self) -> str:
        """The TensorRT version the header names, e.g. ``"10.3.0"``."""
        return version_from_tag(self.version)

    def __repr__(self) -> str:
        return "CalibrationCache({!r}, {} tensors)".format(self.header, len(self.scales))


def algorithm_name(algorithm: str) -> str:
    """TensorRT's header name for ``algorithm`` (accepts ours or TensorRT's spelling)."""
    if algorithm in ALGORITHM_NAMES:
        return ALGORITHM_NAMES[algorithm]
    if algorithm in _ALGORITHM_KEYS:
        return algorithm
    raise AgentError(
        "bad_argument",
        "calibration algorithm must be one of {}, found {!r}".format(
            ", ".join(sorted(ALGORITHM_NAMES)), algorithm),
    )


def _parse_version(version: str) -> Tuple[int, int, int]:
    nums = version_key(version, 3)
    if not nums:
        raise AgentError("bad_argument",
                         "TensorRT version must look like 10.3.0, found {!r}".format(version))
    return nums[0], nums[1], nums[2]


def trt_version_tag(version: str) -> str:
    """The header's version number: ``"8.6.1" -> "8601"``, ``"10.3.0" -> "100300"``."""
    major, minor, patch = _parse_version(version)
    if major >= 10:
        return str(major * 10000 + minor * 100 + patch)
    return str(major * 1000 + minor * 100 + patch)


def version_from_tag(tag: str) -> str:
    """Inverse of ``trt_version_tag``: ``"100300" -> "10.3.0"``, ``"8601" -> "8.6.1"``."""
    n = int(tag)
    if n >= 100000:
        return "{}.{}.{}".format(n // 10000, (n // 100) % 100, n % 100)
    return "{}.{}.{}".format(n // 1000, (n // 100) % 10, n % 100)


def scale_to_hex(scale: float) -> str:
    return struct.pack(">f", scale).hex()


def hex_to_scale(text: str) -> float:
    return float(struct.unpack(">f", bytes.fromhex(text.rjust(8, "0")))[0])


def format_cache(values: Dict[str, float], algorithm: str, trt_version: str,
                 values_are_scales: bool = False) -> str:
    """The cache text for ``values`` (amax per tensor unless ``values_are_scales``).

    Non-finite or negative values are refused (TensorRT would read them back as garbage)."""
    lines = ["TRT-{}-{}".format(trt_version_tag(trt_version), algorithm_name(algorithm))]
    for name in sorted(values):
        value = float(values[name])
        if not math.isfinite(value) or value < 0:
            raise AgentError(
                "bad_argument",
                "calibration range of tensor {!r} must be finite and >= 0, found {}".format(
                    name, value))
        scale = value if values_are_scales else value / INT8_MAX
        if "\n" in name:
            raise AgentError("bad_argument",
                             "tensor name {!r} cannot be written to a cache".format(name))
        lines.append("{}: {}".format(name, scale_to_hex(scale)))
    return "\n".join(lines) + "\n"


def parse_cache(text: str, source: str = "calibration cache") -> CalibrationCache:
    """Parse cache text; ``source`` names the file in error messages."""
    lines = [line.rstrip("\r") for line in text.split("\n")]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise AgentError("bad_calibration_cache",
                         "{}: expected a 'TRT-<version>-<Algorithm>' header, found an empty "
                         "file".format(source))
    header = lines[0].strip()
    parts = header.split("-", 2)
    if len(parts) != 3 or parts[0] != "TRT" or not parts[1].isdigit() or not parts[2]:
        raise AgentError("bad_calibration_cache",
                         "{}: expected a 'TRT-<version>-<Algorithm>' header, found {!r}".format(
                             source, header[:80]))
    scales: Dict[str, float] = {}
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        name, sep, value = line.rpartition(": ")
        value = value.strip()
        ok = bool(sep and name) and 0 < len(value) <= 8
        if ok:
            try:
                scale = hex_to_scale(value)
            except ValueError:
                ok = False
        if not ok:
            raise AgentError("bad_calibration_cache",
                             "{} line {}: expected '<tensor name>: <8 hex digits>', found "
                             "{!r}".format(source, number, line[:80]))
        if not math.isfinite(scale) or scale < 0:
            raise AgentError("bad_calibration_cache",
                             "{} line {}: expected a finite scale >= 0 for {!r}, found {}".format(
                                 source, number, name, scale))
        if name in scales:
            raise AgentError("bad_calibration_cache",
                             "{} line {}: tensor {!r} appears twice".format(source, number, name))
        scales[name] = scale
    if not scales:
        raise AgentError("bad_calibration_cache",
                         "{}: expected at least one '<tensor name>: <scale>' line after the "
                         "header, found none".format(source))
    return CalibrationCache(header, parts[2], parts[1], scales)


def read_cache(path: str) -> CalibrationCache:
    """Read and parse a cache file (``file_not_found`` / ``bad_calibration_cache``)."""
    if not os.path.isfile(path):
        raise AgentError("file_not_found", "calibration cache {} does not exist".format(path))
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise AgentError("bad_calibration_cache",
                         "{}: expected TensorRT's text calibration cache, found binary "
                         "data".format(path))
    return parse_cache(text, path)


def write_cache(path: str, scales_or_amax: Dict[str, float], algorithm: str,
                trt_version: str = DEFAULT_TRT_VERSION, values_are_scales: bool = False) -> None:
    """Write a cache atomically. Values are amax per tensor (``values_are_scales=False``, what
    ``calib.ranges`` produces) or scales."""
    atomic_write_text(path, format_cache(scales_or_amax, algorithm, trt_version,
                                         values_are_scales))


def check_compatible(cache: CalibrationCache, algorithm: str,
                     trt_version: Optional[str] = None) -> None:
    """Refuse a cache TensorRT would not reuse: another algorithm, or (when ``trt_version`` is
    given) another TensorRT version. The host's emulation passes ``trt_version=None``: the
    scales mean the same whatever TensorRT wrote them."""
    expected = algorithm_name(algorithm)
    if cache.algorithm != expected:
        raise AgentError(
            "calibration_cache_mismatch",
            "calibration cache was made with {} but {} was asked for (expected header "
            "'TRT-<version>-{}', found {!r})".format(cache.algorithm, expected, expected,
                                                    cache.header),
            {"expected_algorithm": expected, "found_algorithm": cache.algorithm},
        )
    if trt_version is not None:
        tag = trt_version_tag(trt_version)
        if cache.version != tag:
            raise AgentError(
                "calibration_cache_mismatch",
                "calibration cache was made by TensorRT {} (tag {}) but this is TensorRT {} "
                "(tag {})".format(version_from_tag(cache.version), cache.version, trt_version,
                                  tag),
                {"expected_version": tag, "found_version": cache.version},
            )
