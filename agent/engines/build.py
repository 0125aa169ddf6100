"""The one way to get an engine: through the engine cache.

``build_engine`` hashes the model, the plan, the calibration inputs, the backend and the
platform into a cache key. A hit returns the cached engine without calling the backend (no
calibration, no graph rewrite). A miss takes the key's build lock (so two processes building
the same engine build it once), looks again, builds into a staging directory and publishes it.

INT8 builds with calibration data and no calibration cache get a default cache path per
(model, dataset, calibration settings, backend): the first build calibrates and writes it, and
every later build of the same model and data with another plan (other layer precisions, as a
precision search tries) reads it and skips calibration.

The platform fingerprint is passed in (``agent.platform`` is daemon side). Worker side:
Python >= 3.6.
"""

import errno
import hashlib
import logging
import os
import time
from typing import Any, Dict, Optional, Tuple

from agent import fsio
from agent.engines.backends.base import (
    Backend,
    BuildPlan,
    CalibrationSettings,
    Progress,
    no_progress,
)
from agent.engines.cache import EngineCache
from agent.engines.cache_key import cache_key, sorted_json
from agent.errors import AgentError
from agent.fsio import sha256_file

log = logging.getLogger(__name__)


class EngineRecord(object):
    """An engine ready to open: its cache key and path, whether it came from the cache, the
    build result (``BuildResult.to_dict()``; on a hit the stored one, with ``calibrated``
    False since nothing ran) and the seconds this call took."""

    def __init__(self, key: str, engine_path: str, cache_hit: bool, result: Dict[str, Any],
                 seconds: float) -> None:
        self.key = key
        self.engine_path = engine_path
        self.cache_hit = cache_hit
        self.result = result
        self.seconds = seconds
        # The cache's budget report after publishing this engine (empty on a hit): sizes,
        # evicted keys, and the protected entries when they alone exceed the budget.
        self.budget_report = {}  # type: Dict[str, Any]

    def to_dict(self) -> Dict[str, Any]:
        return {
            "key": self.key,
            "engine": self.engine_path,
            "cache_hit": self.cache_hit,
            "seconds": round(self.seconds, 4),
            "result": self.result,
        }


def _digest_file_or_dir(path: str) -> str:
    """sha256 over the relative names and bytes of a file or a directory tree (the names
    are relative, so moving the data does not change the digest). Hidden files are skipped,
    as the dataset reader skips them."""
    digest = hashlib.sha256()
    if os.path.isdir(path):
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(n for n in filenames if not n.startswith(".")):
                full = os.path.join(dirpath, name)
                digest.update(os.path.relpath(full, path).encode("utf-8") + b"\0")
                digest.update(sha256_file(full).encode("ascii"))
    else:
        digest.update(sha256_file(path).encode("ascii"))
    return digest.hexdigest()


# Dataset digests by (path, stat signature): a precision search builds many plans from the
# same data in one process and should hash it once.
_DATA_DIGESTS: Dict[Tuple[str, Tuple[Any, ...]], str] = {}
_MODEL_DIGESTS: Dict[Tuple[str, Tuple[Any, ...]], str] = {}


def _stat_signature(path: str) -> Tuple[Any, ...]:
    entries = []
    if os.path.isdir(path):
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for name in filenames:
                st = os.stat(os.path.join(dirpath, name))
                entries.append((os.path.join(dirpath, name), st.st_size, st.st_mtime_ns))
    else:
        st = os.stat(path)
        entries.append((path, st.st_size, st.st_mtime_ns))
    return tuple(sorted(entries))


def dataset_digest(path: str) -> str:
    """Content digest of calibration data (a directory of shards or one file)."""
    if not os.path.exists(path):
        raise AgentError("file_not_found",
                         "calibration data {} does not exist (expected a directory of "
                         ".npy/.npz shards, an .npz file or a Polygraphy inputs JSON)".format(path))
    memo_key = (os.path.abspath(path), _stat_signature(path))
    if memo_key not in _DATA_DIGESTS:
        _DATA_DIGESTS[memo_key] = _digest_file_or_dir(path)
    return _DATA_DIGESTS[memo_key]


def _model_digest(path: str) -> str:
    """sha256 of the model file, read once per (path, size, mtime): a search builds many
    times from the same model."""
    memo_key = (os.path.abspath(path), _stat_signature(path))
    if memo_key not in _MODEL_DIGESTS:
        _MODEL_DIGESTS[memo_key] = sha256_file(path)
    return _MODEL_DIGESTS[memo_key]


def calibration_digest(plan: BuildPlan) -> Optional[str]:
    """What the calibration inputs contribute to the key: the data's content digest and the
    calibration cache's content digest when that file exists (TensorRT then uses it instead of
    calibrating). None when the plan does not calibrate."""
    calib = plan.calibration
    if calib is None or not plan.needs_calibration:
        return None
    parts = {
        "data": dataset_digest(calib.data) if calib.data else None,
        "cache": sha256_file(calib.cache) if calib.cache and os.path.isfile(calib.cache)
        else None,
    }
    return hashlib.sha256(sorted_json(parts)).hexdigest()


def default_calibration_cache(
    model_digest: str,
    calib: CalibrationSettings,
    backend_fingerprint: Dict[str, str],
    calibration_dir: str,
) -> str:
    """Per (model, dataset, calibration settings, backend) cache path: shared by every plan of
    the same model and data, so only the first int8 build calibrates."""
    doc = {
        "model": model_digest,
        "data": dataset_digest(calib.data) if calib.data else None,
        "algorithm": calib.algorithm,
        "batch_size": calib.batch_size,
        "shuffle_seed": calib.shuffle_seed,
        "max_samples": calib.max_samples,
        "backend": backend_fingerprint,
    }
    name = hashlib.sha256(sorted_json(doc)).hexdigest()[:32]
    return os.path.join(calibration_dir, "{}-{}.cache".format(calib.algorithm, name))


def _plan_for_build(plan: BuildPlan, model_digest: str, backend_fingerprint: Dict[str, str],
                    calibration_dir: Optional[str]) -> BuildPlan:
    """A copy of ``plan`` with the default calibration cache filled in where it applies."""
    plan = BuildPlan.from_dict(plan.to_dict())
    calib = plan.calibration
    if plan.needs_calibration and calib is not None and calib.data and not calib.cache:
        directory = calibration_dir or os.path.join(fsio.state_dir(), "calibration")
        os.makedirs(directory, exist_ok=True)
        calib.cache = default_calibration_cache(model_digest, calib, backend_fingerprint,
                                                directory)
    return plan


def _hit(key: str, entry: Any, started: float) -> EngineRecord:
    result = dict(entry.meta.get("result") or {})
    result["engine"] = entry.engine_path
    result["calibrated"] = False  # nothing was calibrated (or built) by this call
    return EngineRecord(key, entry.engine_path, True, result, time.monotonic() - started)


def _display_name(name: str) -> str:
    """A model name fit for a terminal (it may come from a job document): only shown."""
    return "".join(c if c.isprintable() else "?" for c in name)[-128:]


def build_engine(
    model_path: str,
    plan: BuildPlan,
    backend: Backend,
    cache: EngineCache,
    platform_fingerprint: Dict[str, str],
    progress: Progress = no_progress,
    calibration_dir: Optional[str] = None,
    model_label: Optional[str] = None,
    shared: Optional[Dict[str, Any]] = None,
) -> EngineRecord:
    """Return the engine for (model, plan, backend, platform) from the cache, building and
    publishing it first on a miss. ``calibration_dir`` holds default calibration caches
    (default ``<state_dir>/calibration``); ``model_label`` is what ``cache ls`` shows (default: the
    file's name; a job's model is staged as model.onnx, so the daemon passes the artifact's
    name; not a job's ``model_name``, the name a device activates the model under).
    ``shared``: {"container": path} of an engine another device of the fleet built
    (``agent.engines.share``), taken instead of building when it is this key's; "adopted" and
    "reason" (why not) are written into it."""
    started = time.monotonic()
    if not os.path.isfile(model_path):
        raise AgentError("file_not_found", "model {} does not exist or is not a file "
                         "(expected an .onnx file)".format(model_path))
    model_digest = _model_digest(model_path)
    backend_fp = backend.fingerprint()
    plan = _plan_for_build(plan, model_digest, backend_fp, calibration_dir)

    def current_key() -> str:
        return cache_key(model_digest, plan, calibration_digest(plan), backend_fp,
                         platform_fingerprint)

    key = current_key()
    entry = cache.get(key)
    if entry is not None:
        cache.counters["hits"] += 1
        return _hit(key, entry, started)
    with cache.lock(key):
        # Another process may have built it while we waited, and a calibration cache it wrote
        # may have changed the key: look again with the key recomputed.
        key = current_key()
        entry = cache.get(key)
        if entry is not None:
            cache.counters["hits"] += 1
            return _hit(key, entry, started)
        if shared and shared.get("container"):
            from agent.engines import share as engine_share

            # The builder's calibration cache is part of its key: installed first (and
            # removed again if the engine is not taken, so a bad one steers no local build).
            installed = engine_share.install_calibration(
                shared["container"], plan.calibration.cache if plan.needs_calibration and
                plan.calibration is not None else None)
            if installed:
                key = current_key()
            adopted, why = engine_share.adopt(shared["container"], key, cache, backend)
            shared["adopted"], shared["reason"] = adopted is not None, why
            if adopted is not None:
                record = _hit(key, adopted, started)
                record.result["shared"] = True
                return record
            if installed:
                os.unlink(installed)
                key = current_key()
            log.warning("shared engine not used, building: %s", why)
        cache.counters["misses"] += 1
        with cache.staging(key) as stage:
            try:
                result = backend.build(model_path, plan, stage.engine_path, progress)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise AgentError("disk_full", "no space left while building {} into "
                                     "the engine cache: {}".format(model_path, exc))
                raise
            # A calibration cache written by this build is now part of the key, so the next
            # identical build (which finds that cache) hits this entry.
            final_key = current_key()
            result_dict = result.to_dict()
            info = {
                "model": model_digest,
                "model_label": _display_name(model_label or os.path.basename(model_path)),
                "plan": plan.to_dict(),
                "calibration_digest": calibration_digest(plan),
                "result": result_dict,
                "fingerprints": {"backend": backend_fp, "platform": dict(platform_fingerprint)},
            }
            entry = cache.publish(stage, info, key=final_key)
    result_dict = dict(result_dict)
    result_dict["engine"] = entry.engine_path
    log.info("built engine %s in %.2f s", final_key[:16], time.monotonic() - started)
    record = EngineRecord(final_key, entry.engine_path, False, result_dict,
                          time.monotonic() - started)
    record.budget_report = dict(cache.budget_report)
    return record
