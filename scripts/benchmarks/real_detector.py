"""A real pretrained detector from a PyPI wheel: searches and task metric per precision.

ddddocr 1.6.1's character detector (``ddddocr/common_det.onnx`` inside the wheel, 20 MB: a
YOLOX with 83 convolutions and SiLU activations, opset 11, fixed input 1x3x416x416; install
with ``pip install --no-deps ddddocr``, nothing is downloaded at run time). Images: crops of
scikit-learn's sample photographs (``load_sample_images``) with five handwritten digits of
scikit-learn's ``load_digits`` drawn on them (48x48 each), BGR 0-255 as the model expects.
Task metric: boxes (YOLOX decoding, score = objectness x class > 0.2, NMS at IoU 0.45)
compared with the fp32 model's boxes: a box with no fp32 box at IoU >= 0.5 is false, an fp32
box with none is missed.

Opset 11 is where the naive emulation quantized int8 weights per tensor (no DequantizeLinear
axis before opset 13); the emulation now quantizes them per output channel, as TensorRT does.
"""

import importlib.util
import json
import os
import shutil
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _searches import emulation_engines, minimal_vs_bisect  # noqa: E402 - shared rows

SIZE = 416
SEARCH_IMAGES = 3
EVAL_IMAGES = 16
CALIB_IMAGES = 8
SCORE = 0.2
TOLERANCES = {"atol": 0.05, "rtol": 0.05}  # elementwise: scores within 0.05, boxes within 5 %


def model_path():
    spec = importlib.util.find_spec("ddddocr")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "common_det.onnx")
    return path if os.path.isfile(path) else None


def images(count, seed):
    """Photograph crops, lightened, with five handwritten digits each (NCHW, BGR, 0-255)."""
    from sklearn.datasets import load_digits, load_sample_images

    photos = load_sample_images().images
    digits = load_digits().images / 16.0
    out = []
    for k in range(count):
        rng = np.random.RandomState(seed * 1000 + k)
        img = photos[k % len(photos)]
        y, x = rng.randint(0, img.shape[0] - SIZE), rng.randint(0, img.shape[1] - SIZE)
        c = img[y:y + SIZE, x:x + SIZE, ::-1].astype(np.float32) * 0.3 + 255 * 0.7
        for j in range(5):
            d = np.kron(digits[rng.randint(len(digits))], np.ones((6, 6)))[:, :, None]
            yy, xx = 184 + rng.randint(-30, 30), 10 + j * 80
            ink = rng.randint(0, 120, 3).astype(np.float32)
            c[yy:yy + 48, xx:xx + 48] = c[yy:yy + 48, xx:xx + 48] * (1 - d) + ink * d
        out.append(np.ascontiguousarray(c.transpose(2, 0, 1))[None])
    return out


def boxes(output):
    """YOLOX decoding (strides 8, 16, 32), score threshold, NMS: [k, 4] xyxy."""
    grids, strides = [], []
    for st in (8, 16, 32):
        h = SIZE // st
        yv, xv = np.meshgrid(np.arange(h), np.arange(h), indexing="ij")
        grids.append(np.stack((xv, yv), 2).reshape(-1, 2))
        strides.append(np.full((h * h, 1), st))
    grid, stride = np.concatenate(grids), np.concatenate(strides)
    o = np.asarray(output, dtype=np.float64)[0].copy()
    o[:, :2] = (o[:, :2] + grid) * stride
    o[:, 2:4] = np.exp(np.minimum(o[:, 2:4], 20)) * stride
    score = o[:, 4] * o[:, 5]
    keep = np.nonzero(score > SCORE)[0]
    keep = keep[np.argsort(-score[keep])]
    xyxy = np.concatenate([o[:, :2] - o[:, 2:4] / 2, o[:, :2] + o[:, 2:4] / 2], axis=1)
    chosen = []
    for i in keep:
        if all(iou(xyxy[i], xyxy[j]) < 0.45 for j in chosen):
            chosen.append(i)
    return xyxy[chosen]


def iou(a, b):
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def compare(found, reference):
    """(false boxes, missed boxes) of ``found`` against the fp32 ``reference`` boxes."""
    false = sum(1 for b in found if not any(iou(b, r) >= 0.5 for r in reference))
    missed = sum(1 for r in reference if not any(iou(b, r) >= 0.5 for b in found))
    return false, missed


def detect(backend, engine, feeds):
    with backend.open(engine) as runner:
        return [boxes(runner.infer(f)["output"]) for f in feeds]


def metric(backend, engine, feeds, reference):
    found = detect(backend, engine, feeds)
    pairs = [compare(f, r) for f, r in zip(found, reference)]
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def run():
    path = model_path()
    if path is None:
        return [{"name": "real detector (ddddocr not installed)", "ours": None,
                 "baseline": None, "goal": "pip install --no-deps ddddocr"}]
    from agent.engines.backends.base import BuildPlan, CalibrationSettings
    from agent.engines.backends.onnxruntime import create
    from agent.precision import golden

    work = tempfile.mkdtemp(prefix="bench-det-")
    rows = []
    try:
        backend = create(threads=2)
        feeds = [{"images": x} for x in images(SEARCH_IMAGES, seed=1)]
        goldens = golden.reference_outputs(path, feeds, backend)
        eval_feeds = [{"images": x} for x in images(EVAL_IMAGES, seed=2)]
        fp32 = backend.build(path, BuildPlan("fp32"), os.path.join(work, "fp32.onnx"))
        reference = detect(backend, fp32.engine_path, eval_feeds)
        total = sum(len(r) for r in reference)
        calib = os.path.join(work, "calib.npz")
        np.savez(calib, images=np.concatenate(images(CALIB_IMAGES, seed=3)))
        ranges = os.path.join(work, "det.calib")
        plans = {"fp16": BuildPlan("fp16"),
                 "int8": BuildPlan("int8", calibration=CalibrationSettings(
                     data=calib, batch_size=1, cache=ranges))}
        for name, plan in plans.items():
            found, search_rows = minimal_vs_bisect("detector " + name, path, plan, feeds,
                                                   goldens, backend, work, TOLERANCES)
            rows += search_rows
            m = found["minimal"]
            if m.engine_path:
                false, missed = metric(backend, m.engine_path, eval_feeds, reference)
                rows.append({"name": "detector {}: searched plan, false / missed boxes of {} "
                             "fp32 boxes".format(name, total), "ours": false,
                             "baseline": missed, "unit": "boxes"})
        for name, naive, engine in emulation_engines(path, plans, work):
            false, missed = metric(backend, engine, eval_feeds, reference)
            rows.append({"name": "detector {}{}: false / missed boxes of {} fp32 "
                         "boxes".format(name, " naive emulation" if naive else "", total),
                         "ours": false, "baseline": missed, "unit": "boxes"})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


if __name__ == "__main__":
    for row in run():
        print(json.dumps(row))
