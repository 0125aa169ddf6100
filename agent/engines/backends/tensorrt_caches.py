"""The caches a TensorRT build reads and writes: the persistent timing cache of one TensorRT
version on one device (merged under a file lock, written atomically), and the check that an
existing calibration cache is one TensorRT would reuse. TensorRT objects are passed in; worker
side: Python >= 3.6.
"""

import logging
import os
import re
from typing import TYPE_CHECKING, Any, List, Optional

from agent.fsio import atomic_write, file_lock, state_dir

if TYPE_CHECKING:  # the stubs (scripts/lib/trt_stubs.py): mypy checks our calls against them
    import tensorrt

log = logging.getLogger("agent.engines.backends.tensorrt")  # one name for all TensorRT messages


# -- timing cache ----------------------------------------------------------------------------

def timing_cache_path(trt_version: str, device: str, root: Optional[str] = None) -> str:
    """``<state dir>/timing/<trt version>-<device>.cache``: timing caches are valid for one
    TensorRT version on one device model only."""
    safe = re.sub(r"[^A-Za-z0-9.+-]+", "_", "{}-{}".format(trt_version, device)).strip("_")
    return os.path.join(root or state_dir(), "timing", safe + ".cache")


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


class TimingCache(object):
    """The persistent timing cache of one TensorRT version and device."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.loaded_bytes = 0
        self.errors: List[str] = []  # what went wrong with the file (the build goes on)

    def attach(self, config: "tensorrt.IBuilderConfig") -> None:
        """Load the on-disk cache (an unreadable one is reported in ``errors``, not used) and
        set it on ``config``
        (ignore_mismatch False: a cache from another device or version is not used)."""
        data = _read_bytes(self.path)
        cache = None
        if data:
            try:
                cache = config.create_timing_cache(data)
                self.loaded_bytes = len(data)
            except Exception as exc:  # noqa: BLE001 (TensorRT raises plain RuntimeError)
                self._failed("timing cache {} is unreadable, not used: {}".format(
                    self.path, exc))
        if cache is None:
            cache = config.create_timing_cache(b"")
        if config.set_timing_cache(cache, False) is False and self.loaded_bytes:
            self._failed("timing cache {} was refused by TensorRT (another TensorRT version "
                         "or device), not used".format(self.path))

    def save(self, config: "tensorrt.IBuilderConfig") -> int:
        """Merge the build's cache with what is on disk now (another build may have written
        it meanwhile) and write the result atomically, under a lock. Returns bytes written."""
        cache = config.get_timing_cache()
        if cache is None:
            return 0
        with file_lock(self.path + ".lock"):
            disk = _read_bytes(self.path)
            if disk:
                try:
                    cache.combine(config.create_timing_cache(disk), False)
                except Exception as exc:  # noqa: BLE001
                    self._failed("timing cache {} is unreadable, replaced by this build's: "
                                 "{}".format(self.path, exc))
            try:
                data = bytes(cache.serialize())
                atomic_write(self.path, data)
            except (OSError, RuntimeError) as exc:
                self._failed("timing cache {} not saved: {}".format(self.path, exc))
                return 0
        return len(data)

    def _failed(self, text: str) -> None:
        log.warning("%s", text)
        self.errors.append(text)


# -- calibration cache -----------------------------------------------------------------------

def existing_calibration_cache(path: Optional[str], algorithm: str,
                               trt_version: Optional[str]) -> Any:
    """The parsed calibration cache at ``path`` when the file exists, else None. A cache
    TensorRT would not reuse (another algorithm, or with ``trt_version`` another TensorRT
    version) is refused with ``calibration_cache_mismatch`` rather than silently recalibrated.
    ``trt_version`` None: only the algorithm must match (scales used directly, as Q/DQ or
    dynamic ranges, mean the same whichever TensorRT wrote them)."""
    from calib import cache as calib_cache

    if not path or not os.path.isfile(path):
        return None
    parsed = calib_cache.read_cache(path)
    calib_cache.check_compatible(parsed, algorithm, trt_version)
    return parsed
