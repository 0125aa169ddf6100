"""``meta.json`` of a model version in the models directory (docs/daemon.md): what an app needs
to know about the engine it loads, and whether it may load it here (the portability
record). Pure: built from the worker's result, the platform and the facts the caller measured
(the engine's sha256 and size), so anyone can check that ``model.engine`` is whole."""

from typing import Any, Dict, List, Mapping, Optional

META_KEYS = ("name", "version", "model_sha256", "engine_key", "precision", "layer_precisions",
             "inputs", "outputs", "backend", "tensorrt", "jetpack", "board", "portability",
             "gate", "throughput_qps", "job_id", "activated", "state", "engine_sha256",
             "engine_size")


def build(name: str, version: str, model_sha256: str, result: Mapping[str, Any],
          platform: Mapping[str, Any], fingerprint: Mapping[str, Any], job_id: Optional[str],
          activated: float, state: str, engine_sha256: str, engine_size: int,
          dla_core: Optional[int] = None) -> Dict[str, Any]:
    """The meta.json document. ``result``: the worker's deploy result (engine_key, precision,
    layers_kept, io, accuracy, throughput_qps, backend); ``platform``: the birth status's
    platform (board, jetpack, tensorrt); ``fingerprint``: the platform fingerprint (gpu,
    compute_capability, cuda, tensorrt)."""
    io: Dict[str, Any] = result["io"] if isinstance(result.get("io"), dict) else {}
    accuracy = result.get("accuracy") if isinstance(result.get("accuracy"), dict) else None
    gate: Dict[str, Any] = {"passed": None if accuracy is None else bool(accuracy.get("passed"))}
    for key, value in (accuracy or {}).items():
        if key != "passed" and isinstance(value, (int, float, str, bool)):
            gate[key] = value
    return {
        "name": name,
        "version": version,
        "model_sha256": model_sha256,
        "engine_key": result.get("engine_key"),
        "precision": result.get("precision"),
        "layer_precisions": dict(result.get("layers_kept") or {}),
        "inputs": _tensors(io.get("inputs")),
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
    }


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
