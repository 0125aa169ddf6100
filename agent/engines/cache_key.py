"""The engine-cache key: what a build depends on, hashed. Pure (no I/O), so a key can be
computed and compared anywhere (build, search, fleet sharing) without touching the cache.

Worker side: Python >= 3.6.
"""

import hashlib
import json
from typing import Any, Dict, Optional

FORMAT = 1  # of the key document and of meta.json: bump to orphan every old entry
# Plan fields that name files: the key holds digests of their content instead.
_CALIBRATION_PATH_FIELDS = ("data", "cache")


def canonical_json(value: Any) -> bytes:
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
    plan_dict = json.loads(canonical_json(plan_dict).decode("utf-8"))  # a deep copy
    calibration = plan_dict.get("calibration")
    if calibration:
        for field in _CALIBRATION_PATH_FIELDS:
            calibration.pop(field, None)
    doc = {
        "format": FORMAT,
        "model": model_digest,
        "plan": plan_dict,
        "calibration": calibration_digest,
        "backend": dict(backend_fingerprint),
        "platform": dict(platform_fingerprint),
    }
    return hashlib.sha256(canonical_json(doc)).hexdigest()
