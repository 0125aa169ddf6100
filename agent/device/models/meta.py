"""``meta.json`` of a model version in the models directory (docs/daemon.md): what an app needs
to know about the engine it loads, and whether it may load it here (the portability
record). Pure: built from the worker's result, the platform and the facts the caller measured
(the engine's sha256 and size), so anyone can check that ``model.engine`` is whole.

Its JSON Schema is ``agent/data/schemas/model_meta.json`` (``SCHEMA``); ``schema_version``
grows when a key changes meaning or goes away (new keys alone keep it: readers ignore keys they
do not know). A meta.json without ``schema_version`` was written before the key existed (0)."""

import os
from typing import Any, Dict, List, Mapping, Optional

SCHEMA_VERSION = 1
SCHEMA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data",
                      "schemas", "model_meta.json")
MAX_PROFILE_INPUTS = 64  # as many as a job's plan.shapes may name

META_KEYS = ("schema_version", "name", "version", "model_sha256", "engine_key", "precision",
             "layer_precisions", "inputs", "outputs", "backend", "tensorrt", "jetpack", "board",
             "portability", "gate", "throughput_qps", "job_id", "activated", "state",
             "engine_sha256", "engine_size", "profiles", "built_by", "plugins",
             "quantization")


def build(name: str, version: str, model_sha256: str, result: Mapping[str, Any],
          platform: Mapping[str, Any], fingerprint: Mapping[str, Any], job_id: Optional[str],
          activated: float, state: str, engine_sha256: str, engine_size: int,
          dla_core: Optional[int] = None, shapes: Optional[Mapping[str, Any]] = None,
          built_by: Optional[Mapping[str, Any]] = None,
          plugins: Optional[List[Mapping[str, Any]]] = None) -> Dict[str, Any]:
    """The meta.json document. ``result``: the worker's deploy result (engine_key, precision,
    layers_kept, io, accuracy, throughput_qps, backend); ``platform``: the birth status's
    platform (board, jetpack, tensorrt); ``fingerprint``: the platform fingerprint (gpu,
    compute_capability, cuda, tensorrt, sm_count); ``dla_core``: the job's plan's (None: GPU);
    ``shapes``: the plan's optimisation profile, input -> [min, opt, max]; ``plugins``: the
    plan's TensorRT plugin libraries ({path, sha256}), which the app must load too."""
    io: Dict[str, Any] = result["io"] if isinstance(result.get("io"), dict) else {}
    accuracy = result.get("accuracy") if isinstance(result.get("accuracy"), dict) else None
    gate: Dict[str, Any] = {"passed": None if accuracy is None else bool(accuracy.get("passed"))}
    for key, value in (accuracy or {}).items():
        if key != "passed" and isinstance(value, (int, float, str, bool)):
            gate[key] = value
    inputs = _tensors(io.get("inputs"))
    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "version": version,
        "model_sha256": model_sha256,
        "engine_key": result.get("engine_key"),
        "precision": result.get("precision"),
        # explicit / mixed: a Q/DQ model (precision "int8 (explicit)"); None: not recorded.
        "quantization": result.get("quantization"),
        "layer_precisions": dict(result.get("layers_kept") or {}),
        "inputs": inputs,
        "outputs": _tensors(io.get("outputs")),
        "backend": result.get("backend") or fingerprint.get("backend"),
        "tensorrt": platform.get("tensorrt"),
        "jetpack": platform.get("jetpack"),
        "board": platform.get("board"),
        "portability": {
            "tensorrt": fingerprint.get("tensorrt") or None,
            "gpu": fingerprint.get("gpu") or None,
            "sm_count": _int(fingerprint.get("sm_count")),
            "compute_capability": fingerprint.get("compute_capability") or None,
            "dla_core": dla_core,
            "cuda": fingerprint.get("cuda") or None,
        },
        "gate": gate,
        "throughput_qps": result.get("throughput_qps"),
        "job_id": job_id,
        "activated": activated,
        "state": state,
        "engine_sha256": engine_sha256,
        "engine_size": int(engine_size),
        "profiles": profiles(inputs, shapes),
        # An engine adopted from the fleet: who built it and the signature that binds it to
        # them (None: built on this device).
        "built_by": dict(built_by) if built_by else None,
        "plugins": [{"path": str(p.get("path") or "")[:4096],
                     "sha256": str(p.get("sha256") or "")[:64]}
                    for p in (plugins or [])[:8] if isinstance(p, Mapping)],
    }


def profiles(inputs: List[Dict[str, Any]],
             shapes: Optional[Mapping[str, Any]]) -> List[Dict[str, Any]]:
    """The engine's optimisation profiles (one: the plan's), each input -> {min, opt, max}: the
    plan's shapes where it gave them, else the input's shape where every dimension is fixed
    (min = opt = max). An input with a dynamic dimension and no plan shape is left out (no
    profile fixes it); no inputs at all: no profile."""
    profile: Dict[str, Dict[str, List[int]]] = {}
    given = shapes if isinstance(shapes, Mapping) else {}
    for t in inputs[:MAX_PROFILE_INPUTS]:
        triple = given.get(t["name"])
        dims = [_dims(d) for d in triple] if isinstance(triple, (list, tuple)) and \
            len(triple) == 3 else []
        fixed = _dims(t["shape"])
        if dims and all(d is not None for d in dims):
            profile[t["name"]] = dict(zip(("min", "opt", "max"), dims))  # type: ignore[arg-type]
        elif fixed is not None:
            profile[t["name"]] = {"min": fixed, "opt": fixed, "max": fixed}
    return [{"inputs": profile}] if profile else []


def _dims(shape: Any) -> Optional[List[int]]:
    """``shape`` as a list of positive ints, or None (dynamic, or not a shape)."""
    if not isinstance(shape, (list, tuple)) or len(shape) > 16:
        return None
    out = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
            return None
        out.append(d)
    return out


def provenance(doc: Mapping[str, Any], result: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The builder of an engine adopted from the fleet (``result.share.mode == "adopted"``):
    its device id, key id, the signature over {device, job_id, sha256, size, engine_class}
    and the shared container's sha256, from the job document's ``engine`` artifact (the daemon
    verified that signature before the worker saw the container). None for an engine built
    here."""
    from agent.wire.signing import key_id

    share = result.get("share")
    if not isinstance(share, dict) or share.get("mode") != "adopted":
        return None
    ref = ((doc.get("artifacts") or {}).get("engine") or {})
    builder = ref.get("builder") if isinstance(ref.get("builder"), dict) else {}
    if not builder:
        return None
    import base64
    import binascii

    try:
        kid: Optional[str] = key_id(base64.b64decode(str(builder.get("public_key")),
                                                     validate=True))
    except (binascii.Error, ValueError):
        kid = None
    return {"device": str(builder.get("device") or "")[:128], "key_id": kid,
            "job_id": str(builder.get("job_id") or "")[:128],
            "sig": str(builder.get("sig") or "")[:256],
            "shared_sha256": str(ref.get("sha256") or "")[:64]}


def _tensors(items: Any) -> List[Dict[str, Any]]:
    out = []
    for t in items if isinstance(items, list) else []:
        if isinstance(t, dict) and isinstance(t.get("name"), str):
            out.append({"name": t["name"], "shape": list(t.get("shape") or []),
                        "dtype": str(t.get("dtype"))})
    return out


def _int(value: Any) -> Optional[int]:
    try:
        return int(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None
