"""Accuracy on the field's own inputs (the app's donated samples,
``agent.device.models.live_samples``):

- ``live_check``: a candidate version against the running one on the same rows. Classifier-like
  outputs (float, rank >= 2, more than one class: the worker's gate uses the same rule) are
  judged by top-1 agreement; every output also gets Polygraphy's error statistic of
  |candidate - running| (``max``/``mean``/``median``). It passes when the agreement is at least
  ``min_agreement`` and, with ``max_error`` > 0, every output's error at most ``max_error``.
  The worst rows (disagreeing first, then the largest error) are named by their index.
- ``field_ranges``: for an INT8 version, per calibrated tensor the share of activations beyond
  the calibration cache's range (amax = scale * 127, TensorRT's cache format): the clipping
  rate; per input, a drift figure against the calibration set (``calibration_inputs``, kept
  in the version's meta.json at activation): mean, std, min, max, the share beyond the input's
  calibrated range, the mean's shift in the calibration set's standard deviations and the
  histogram distance (total variation over the calibration set's bins, values outside them
  in a bin of their own: 0 same distribution, 1 disjoint) with ``hist_noise``, the distance
  as many values drawn from the calibration set itself would show (sampling alone). Tensors
  clipping more than ``max_clip_rate`` are named ``stale``; inputs whose histogram distance
  exceeds ``max_drift`` beyond twice that noise (values of one row are seldom independent),
  ``drifted``: a shift in mean, spread or range moves the histogram, so values squeezed into
  a sub-range drift without clipping anything.

The runners are the backend's (ONNX Runtime here, TensorRT on a Jetson); rows go through in
chunks of the model's fixed batch, or ``CHUNK`` rows where the batch is dynamic.
"""

import math
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np

from agent.precision.metrics import error_stats

CHUNK = 32
WORST = 5
LISTED = 16  # tensors listed with their clipping rate (the worst first)
BINS = 32  # the calibration set's histogram per input
MAX_CALIBRATION_ROWS = 4096  # rows of the calibration set its statistics are taken from


def batches(feeds: Dict[str, np.ndarray], batch: Optional[int]
            ) -> Iterator[Dict[str, np.ndarray]]:
    """Chunks of the rows: ``batch`` rows each when the model's batch is fixed (a remainder
    that does not fill one is left out), else up to CHUNK."""
    rows = next(iter(feeds.values())).shape[0]
    step = batch or CHUNK
    for start in range(0, rows, step):
        if batch and start + batch > rows:
            return
        yield {k: v[start:start + step] for k, v in feeds.items()}


def run_rows(infer: Callable[[Dict[str, np.ndarray]], Dict[str, np.ndarray]],
             feeds: Dict[str, np.ndarray], batch: Optional[int]) -> Dict[str, np.ndarray]:
    parts: Dict[str, List[np.ndarray]] = {}
    for chunk in batches(feeds, batch):
        for name, value in infer(chunk).items():
            parts.setdefault(name, []).append(np.asarray(value))
    return {k: np.concatenate(v) for k, v in parts.items()}


def is_classifier(array: np.ndarray) -> bool:
    return array.ndim >= 2 and array.shape[-1] > 1 and array.dtype.kind == "f"


def compare(new: Dict[str, np.ndarray], running: Dict[str, np.ndarray], min_agreement: float,
            max_error: float, error_stat: str) -> Dict[str, Any]:
    """The figures of a candidate's outputs against the running version's, row by row."""
    names = sorted(set(new) & set(running))
    rows = min((new[n].shape[0] for n in names), default=0)
    disagree = np.zeros(rows)
    row_error = np.zeros(rows)
    outputs: Dict[str, Dict[str, Any]] = {}
    agreements, errors = [], []
    finite = True
    for name in names:
        a, b = np.asarray(new[name])[:rows], np.asarray(running[name])[:rows]
        if a.shape != b.shape:
            outputs[name] = {"shape_mismatch": [list(a.shape), list(b.shape)]}
            disagree += 1
            agreements.append(0.0)
            continue
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64)).reshape(rows, -1)
        err = error_stats(diff, 0.5)[error_stat]
        entry: Dict[str, Any] = {"error": err}
        if math.isfinite(err):
            errors.append(err)
        else:  # NaN or infinity in either: never a pass (null in JSON)
            finite = False
            entry["error"] = None
        per_row = np.nan_to_num(diff.max(axis=1) if diff.size else np.zeros(rows), nan=np.inf)
        row_error = np.maximum(row_error, per_row)
        if is_classifier(a):
            same = (np.argmax(a, axis=-1) == np.argmax(b, axis=-1)).reshape(rows, -1)
            entry["agreement"] = float(same.mean()) if same.size else 1.0
            agreements.append(entry["agreement"])
            disagree += 1.0 - same.mean(axis=1)
        outputs[name] = entry
    agreement = min(agreements) if agreements else None
    error = max(errors) if errors else 0.0
    order = sorted(range(rows), key=lambda i: (-disagree[i], -row_error[i]))
    worst = [int(i) for i in order[:WORST] if disagree[i] > 0 or row_error[i] > 0]
    passed = finite and (agreement is None or agreement >= min_agreement) and \
        (max_error <= 0 or error <= max_error)
    return {"samples": int(rows), "agreement": agreement, "error": error if finite else None,
            "error_stat": error_stat, "min_agreement": min_agreement,
            "max_error": max_error or None, "passed": bool(passed), "worst": worst,
            "outputs": outputs}


def live_check(new: Any, running: Any, samples: Dict[str, np.ndarray], batch: Optional[int],
               min_agreement: float, max_error: float, error_stat: str) -> Dict[str, Any]:
    """``new`` / ``running``: the backend's runners of the two versions."""
    rows = next(iter(samples.values())).shape[0]
    if batch and rows < batch:
        return {"skipped": "{} donated rows, fewer than the engine's batch of {}".format(
            rows, batch)}
    return compare(run_rows(new.infer, samples, batch), run_rows(running.infer, samples, batch),
                   min_agreement, max_error, error_stat)


def load_rows(paths: List[str], limit: int) -> Dict[str, np.ndarray]:
    """The newest ``limit`` rows of donation files (``paths``: newest first), input ->
    array; {} with none. Files whose inputs differ from the newest one's (an older version's)
    are left out; damaged ones too."""
    from agent.engines import safe_npz
    from agent.errors import AgentError

    parts: List[Dict[str, np.ndarray]] = []
    rows = 0
    for path in paths:
        try:
            arrays = dict(safe_npz.read_npz(path, "bad_donation"))
        except (AgentError, OSError):
            continue
        if not arrays or (parts and (set(arrays) != set(parts[0]) or any(
                arrays[k].shape[1:] != parts[0][k].shape[1:] or
                arrays[k].dtype != parts[0][k].dtype for k in arrays))):
            continue
        parts.append(arrays)
        rows += next(iter(arrays.values())).shape[0]
        if rows >= limit:
            break
    if not parts:
        return {}
    parts.reverse()
    return {k: np.concatenate([p[k] for p in parts])[-limit:] for k in parts[0]}


def input_stats(arrays: Dict[str, np.ndarray]) -> Dict[str, Dict[str, Any]]:
    """Per input: mean, std, min, max and a BINS-bin histogram (fractions) over [min, max]."""
    out = {}
    for name, value in arrays.items():
        v = np.asarray(value, dtype=np.float64).ravel()
        v = v[np.isfinite(v)]
        if not v.size:
            continue
        lo, hi = float(v.min()), float(v.max())
        counts, _ = np.histogram(v, bins=BINS, range=(lo, hi if hi > lo else lo + 1.0))
        out[name] = {"mean": float(v.mean()), "std": float(v.std()), "min": lo, "max": hi,
                     "hist": [round(float(c) / v.size, 6) for c in counts]}
    return out


def calibration_inputs(path: str) -> Optional[Dict[str, Dict[str, Any]]]:
    """``input_stats`` of a calibration set (an .npz, or a folder of .npz shards: the first
    MAX_CALIBRATION_ROWS rows); None for another format (a Polygraphy JSON set)."""
    import os

    from agent.engines import safe_npz

    files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".npz")) \
        if os.path.isdir(path) else [path]
    parts: Dict[str, List[np.ndarray]] = {}
    rows = 0
    for f in files:
        with open(f, "rb") as handle:
            if handle.read(4) != b"PK\x03\x04":
                return None
        arrays = safe_npz.read_npz(f, "bad_calibration_data")
        for name, value in arrays.items():
            parts.setdefault(name, []).append(value)
        rows += min((len(v) for v in arrays.values()), default=0)
        if rows >= MAX_CALIBRATION_ROWS:
            break
    return input_stats({k: np.concatenate(v)[:MAX_CALIBRATION_ROWS] for k, v in parts.items()})


def drift(value: np.ndarray, ref: Dict[str, Any]) -> Dict[str, Any]:
    """``value`` (the donated rows of one input) against its calibration statistics."""
    v = np.asarray(value, dtype=np.float64).ravel()
    hi = ref["max"] if ref["max"] > ref["min"] else ref["min"] + 1.0
    counts, _ = np.histogram(v, bins=len(ref["hist"]), range=(ref["min"], hi))
    inside = counts / float(max(v.size, 1))
    outside = 1.0 - float(inside.sum())
    hist = np.asarray(ref["hist"], dtype=np.float64)
    distance = 0.5 * (float(np.abs(inside - hist).sum()) + outside)
    # E|p^ - p| of a bin's share over n draws is about sqrt(2 p (1 - p) / (pi n)): what a
    # sample of the calibration set itself would show, so few values never read as drift.
    noise = 0.5 * float(np.sqrt(np.clip(hist * (1.0 - hist), 0.0, None)).sum()) * \
        math.sqrt(2.0 / (math.pi * max(v.size, 1)))
    return {"mean_shift": (float(v.mean()) - ref["mean"]) / ref["std"] if ref["std"] else None,
            "hist_distance": round(min(1.0, distance), 6), "hist_noise": round(noise, 6)}


def field_ranges(activations: Any, amax: Dict[str, float], samples: Dict[str, np.ndarray],
                 batch: Optional[int], max_clip_rate: float,
                 reference: Optional[Dict[str, Dict[str, Any]]] = None,
                 max_drift: float = 0.0) -> Dict[str, Any]:
    """``activations.run(feeds)`` -> tensor -> array (``agent.engines.activations``);
    ``reference``: the calibration set's ``input_stats`` (None: no drift figures);
    ``max_drift``: 0 names no input ``drifted``."""
    outside: Dict[str, int] = {}
    total: Dict[str, int] = {}
    rows = 0
    for chunk in batches(samples, batch):
        rows += next(iter(chunk.values())).shape[0]
        for name, value in activations.run(chunk).items():
            limit = amax.get(name)
            if limit is None or not np.issubdtype(np.asarray(value).dtype, np.floating):
                continue
            v = np.asarray(value)
            outside[name] = outside.get(name, 0) + int(np.count_nonzero(np.abs(v) > limit))
            total[name] = total.get(name, 0) + int(v.size)
    rates = {n: outside[n] / float(total[n]) for n in total if total[n]}
    worst = sorted(rates, key=lambda n: -rates[n])
    inputs: Dict[str, Dict[str, Any]] = {}
    drifted = []
    for name, value in samples.items():
        v = np.asarray(value, dtype=np.float64)
        limit = amax.get(name)
        inputs[name] = {"mean": float(v.mean()), "std": float(v.std()), "min": float(v.min()),
                        "max": float(v.max()),
                        "calibrated_amax": limit,
                        "outside": (float(np.mean(np.abs(v) > limit)) if limit else None)}
        if reference and name in reference:
            d = inputs[name]["drift"] = drift(v, reference[name])
            if max_drift > 0 and d["hist_distance"] - 2.0 * d["hist_noise"] > max_drift:
                drifted.append(name)
    return {"samples": rows, "clip_rate": {n: round(rates[n], 6) for n in worst[:LISTED]},
            "clip_max": max(rates.values()) if rates else 0.0,
            "max_clip_rate": max_clip_rate,
            "stale": [n for n in worst if rates[n] > max_clip_rate][:LISTED],
            "max_drift": max_drift, "drifted": sorted(drifted)[:LISTED], "inputs": inputs}


def field_check(onnx_path: str, cache_path: str, samples: Dict[str, np.ndarray],
                batch: Optional[int], max_clip_rate: float,
                reference: Optional[Dict[str, Dict[str, Any]]] = None,
                max_drift: float = 0.0) -> Dict[str, Any]:
    """``field_ranges`` of the fp32 model ``onnx_path`` against the calibration cache."""
    from agent.engines.activations import Activations
    from calib.cache import read_cache

    amax = read_cache(cache_path).amax
    activations = Activations(onnx_path, sorted(amax))
    try:
        return field_ranges(activations, amax, samples, batch, max_clip_rate, reference,
                            max_drift)
    finally:
        activations.close()
