"""The engine-cache key: what a build depends on, hashed. Pure (no I/O), so a key can be
computed and compared anywhere (build, search, fleet sharing) without touching the cache.

Worker side: Python >= 3.6.
"""

import hashlib
import json
from typing import Any, Dict, List, Optional, Tuple

from agent.version_key import version_key

# Of the key document and of meta.json: bump to orphan every old entry. 2: the backend
# fingerprint carries the SM count, the CUDA runtime and the compatibility flags, the platform
# fingerprint the module and DLA cores (issue 24). Entries of format 1 stay on disk under their
# old keys (an active engine a journal names still resolves, and runs after the platform
# check); a build computes a format-2 key, misses, and rebuilds on first use; the old entries
# age out with the cache's eviction. They are not re-keyed: format 1 never recorded the SM
# count or the CUDA runtime an engine was built with, so no key could prove them portable.
FORMAT = 2
# Plan fields that name files: the key holds digests of their content instead.
_CALIBRATION_PATH_FIELDS = ("data", "cache")


def sorted_json(value: Any) -> bytes:
    """``json.dumps`` with sorted keys, no spaces, anything else as ``str``: the cache key's
    and meta.json's bytes (not RFC 8785: that is the wire's ``signing.canonical_json``, and
    changing either output would orphan every cached engine or break every signature)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8")


def cache_key(
    model_digest: str,
    plan: Any,
    calibration_digest: Optional[str],
    backend_fingerprint: Dict[str, str],
    platform_fingerprint: Dict[str, str],
) -> str:
    """The engine-cache key: sha256 over canonical JSON of everything a build depends on.

    ``plan`` is a BuildPlan or its ``to_dict()``. Calibration file paths are left out (moving
    a dataset must not change the key); ``calibration_digest`` stands for their content.
    """
    plan_dict = plan if isinstance(plan, dict) else plan.to_dict()
    plan_dict = json.loads(sorted_json(plan_dict).decode("utf-8"))  # a deep copy
    calibration = plan_dict.get("calibration")
    if calibration:
        for field in _CALIBRATION_PATH_FIELDS:
            calibration.pop(field, None)
    # A plugin library enters by its content (moving it must not change the key).
    if plan_dict.get("plugins"):
        plan_dict["plugins"] = sorted(str(p.get("sha256")) for p in plan_dict["plugins"])
    doc = {
        "format": FORMAT,
        "model": model_digest,
        "plan": plan_dict,
        "calibration": calibration_digest,
        "backend": dict(backend_fingerprint),
        "platform": dict(platform_fingerprint),
    }
    return hashlib.sha256(sorted_json(doc)).hexdigest()


# What a serialized TensorRT engine depends on (NVIDIA: "serialized engines are not portable
# across platforms or TensorRT versions"; the same GPU model with another SM count, another
# CUDA, or a DLA core the device lacks counts as another platform). Recorded beside the engine
# at build time and compared before it is deserialized. Values are strings ("" when unknown);
# ``dla_core`` is the core a DLA engine was built for, compared with the device's
# ``dla_cores`` (its count) rather than for equality.
PLATFORM_FIELDS = ("tensorrt", "gpu", "compute_capability", "sm_count", "cuda_runtime",
                   "cuda_driver", "dla_core", "hardware_compatibility", "version_compatible")
# Fields the hardware-compatibility level of TensorRT 8.6+ (AMPERE_PLUS, SAME_COMPUTE_CAPABILITY)
# lets differ, and the one the version-compatible flag lets differ (within a major version).
_HW_COMPAT_FREE = {"ampere_plus": ("gpu", "compute_capability", "sm_count"),
                   "same_compute_capability": ("gpu", "sm_count")}


# Settings of the engine, not properties of a device: they relax the comparison above.
_ENGINE_SETTINGS = ("hardware_compatibility", "version_compatible")


def platform_mismatches(recorded: Dict[str, str], here: Dict[str, str]
                        ) -> List[Tuple[str, str, str]]:
    """(field, this device's value, the engine's value) for each field of ``PLATFORM_FIELDS``
    where an engine built on ``recorded`` cannot run ``here``. Unknown values ("") are not
    mismatches, a newer CUDA driver here is not one (drivers run older CUDA), and a
    version-compatible engine runs on a later TensorRT of the same major version.

    The compatibility settings relax only what TensorRT says they do: an ``ampere_plus``
    engine runs on Ampere and later GPUs only (compute capability >= 8.0 here); neither
    setting applies to a DLA engine (TensorRT: not supported with DLA), nor version
    compatibility before 8.6 (the flag arrived then). The CUDA runtime may differ in its minor
    version (CUDA's minor version compatibility), not in its major."""
    level = str(recorded.get("hardware_compatibility") or "")
    dla = str(recorded.get("dla_core") or "").isdigit()
    free = set() if dla else set(_HW_COMPAT_FREE.get(level, ()))
    if level == "ampere_plus" and version_key(str(here.get("compute_capability") or "0")) < (8, 0):
        free = set()
    out = []
    for field in PLATFORM_FIELDS:
        want, found = str(here.get(field) or ""), str(recorded.get(field) or "")
        if field == "dla_core":
            count = str(here.get("dla_cores") or "")
            if found.isdigit() and count.isdigit() and int(found) >= int(count):
                out.append((field, "a core below {} (this device's DLA cores)".format(count),
                            found))
            continue
        if field in free or field in _ENGINE_SETTINGS or want == found or not want or \
                not found:
            continue
        if field == "cuda_driver" and version_key(want) >= version_key(found):
            continue
        if field == "cuda_runtime" and version_key(want)[:1] == version_key(found)[:1]:
            continue
        if field == "tensorrt" and str(recorded.get("version_compatible")) == "true" and \
                not dla and version_key(found) >= (8, 6) and \
                version_key(want)[:1] == version_key(found)[:1] and \
                version_key(want) >= version_key(found):
            continue
        out.append((field, want, found or "-"))
    return out
