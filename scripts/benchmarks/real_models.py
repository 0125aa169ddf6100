"""Real pretrained models from PyPI wheels: precision searches, task metric, calibration memory.

The model is captcha-whisperer's CRNN (``captcha_whisperer/models/captcha_crnn.onnx``, shipped
inside the wheel: a 24-conv backbone and an unrolled 2-layer bidirectional LSTM, 902 ONNX
nodes, Constant-node weights, a Reshape fed by Shape). Images: scikit-learn's sample images
(``load_sample_images``: china.jpg, flower.jpg), cut into 60x160 crops. The task metric is the
agreement of the decoded text (CTC greedy decoding) with the fp32 model, per image.

Rows, each measured in this run:

- for fp16 and int8 (entropy2, host emulation), with a median 0.05 check and (fp16) a strict
  elementwise 1e-3 one: evaluations and layers kept by ``minimal`` (the default) and
  ``bisect``; the default must keep no more layers than bisect in at most
  2x bisect's evaluations + 4;
- the text agreement of emulated fp16, int8 and the searched int8 plan with fp32, and of the
  naive emulation (``JETSON_AGENT_NAIVE_EMULATION=1``) for comparison;
- calibration peak RSS and time for N and 10x N images, each in a fresh process (goal: the
  10x run within 1.1x);
- pre-flight: device-side evaluations when a device (here a second, empty engine cache)
  starts from the host's set, vs the search without it.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _searches import emulation_engines, minimal_vs_bisect  # noqa: E402 - shared rows

LABELS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ_"
SEARCH_IMAGES = 4
CALIB_IMAGES = 8
EVAL_IMAGES = 32
TOLERANCES = {"atol": 0.05, "rtol": 0.05, "check_error_stat": "median"}
# A strict check (every logit within 1e-3), where fp16 needs some layers kept.
STRICT = {"atol": 1e-3, "rtol": 1e-3}

CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from agent.engines.backends.base import BuildPlan, CalibrationSettings
from agent.engines.backends.onnxruntime import create
model, data, engine = sys.argv[2:5]
plan = BuildPlan("int8", calibration=CalibrationSettings(data=data, batch_size=8))
t = time.perf_counter()
result = create(threads=2).build(model, plan, engine)
print(json.dumps({"maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "seconds": time.perf_counter() - t,
                  "samples": result.details.get("calibration_samples")}))
"""


def model_path():
    """The CRNN inside the installed wheel (found without importing the package)."""
    spec = importlib.util.find_spec("captcha_whisperer")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "models",
                        "captcha_crnn.onnx")
    return path if os.path.isfile(path) else None


def crops(count, seed=0):
    """60x160 BGR crops (0..255, NCHW) of scikit-learn's sample photographs."""
    from sklearn.datasets import load_sample_images

    images = load_sample_images().images
    rng = np.random.RandomState(seed)
    out = []
    for i in range(count):
        img = images[i % len(images)]
        y = rng.randint(0, img.shape[0] - 120)
        x = rng.randint(0, img.shape[1] - 320)
        crop = img[y:y + 120:2, x:x + 320:2, ::-1].astype(np.float32)  # 60x160, BGR
        out.append(np.ascontiguousarray(crop.transpose(2, 0, 1))[None])
    return out


def decode(logits):
    """CTC greedy decoding of [T, N, C] or [N, T, C] logits (the time axis is the 20-long)."""
    arr = np.asarray(logits)
    if arr.ndim == 3 and arr.shape[0] != 1 and arr.shape[1] == 1:
        arr = arr.transpose(1, 0, 2)
    best = arr[0].argmax(-1)
    text, prev = [], None
    for k in best:
        if k != prev and k != len(LABELS) - 1:
            text.append(LABELS[k])
        prev = k
    return "".join(text)


def agreement(backend, engine, feeds, reference):
    """Fraction of images whose decoded text equals the fp32 text (``reference``: texts, or
    (texts, per-step argmax) to also return the per-time-step top-1 agreement)."""
    texts, steps = reference if isinstance(reference, tuple) else (reference, None)
    with backend.open(engine) as runner:
        logits = [np.asarray(list(runner.infer(f).values())[0]) for f in feeds]
    text = float(np.mean([decode(x) == t for x, t in zip(logits, texts)]))
    if steps is None:
        return text
    step = float(np.mean(np.concatenate([(x.argmax(-1) == s).ravel()
                                         for x, s in zip(logits, steps)])))
    return text, step


def run():
    path = model_path()
    if path is None:
        return [{"name": "real models (captcha-whisperer not installed)", "ours": None,
                 "baseline": None, "goal": "pip install captcha-whisperer"}]
    from agent.engines.backends.base import BuildPlan, CalibrationSettings
    from agent.engines.backends.onnxruntime import create
    from agent.engines.cache import EngineCache
    from agent.precision import golden
    from agent.precision.searcher import run_search

    work = tempfile.mkdtemp(prefix="bench-real-")
    rows = []
    try:
        backend = create(threads=2)
        feeds = [{"image": x} for x in crops(SEARCH_IMAGES)]
        goldens = golden.reference_outputs(path, feeds, backend)
        # The task metric is measured on other images than the search's goldens.
        eval_feeds = [{"image": x} for x in crops(EVAL_IMAGES, seed=3)]
        eval_gold = golden.reference_outputs(path, eval_feeds, backend)
        eval_ref = ([decode(list(g.values())[0]) for g in eval_gold],
                    [np.asarray(list(g.values())[0]).argmax(-1) for g in eval_gold])
        calib = os.path.join(work, "calib.npz")
        np.savez(calib, image=np.concatenate(crops(CALIB_IMAGES, seed=1)))
        ranges = os.path.join(work, "crnn.calib")  # one calibration for every int8 build
        plans = {"fp16": BuildPlan("fp16"),
                 "int8": BuildPlan("int8", calibration=CalibrationSettings(data=calib,
                                                                           cache=ranges))}
        for name, plan, opts in (("fp16", plans["fp16"], TOLERANCES),
                                 ("fp16 strict", plans["fp16"], STRICT),
                                 ("int8", plans["int8"], TOLERANCES)):
            found, search_rows = minimal_vs_bisect("crnn " + name, path, plan, feeds,
                                                   goldens, backend, work, opts)
            rows += search_rows
            m = found["minimal"]
            if m.passed:
                # Pre-flight: a "device" (a second, empty cache) verifies the host's set.
                device = EngineCache(os.path.join(work, "device-" + name))
                d = run_search(path, plan, feeds, goldens, backend, device, {"kind": "device"},
                               compare_options=opts, predicted=m.keep,
                               calibration_dir=os.path.join(work, "cal"))
                rows.append({"name": "crnn {}: device evaluations with vs without "
                             "pre-flight".format(name), "ours": d.evaluations,
                             "baseline": m.evaluations, "unit": "builds",
                             "goal": "prediction {}".format(
                                 "verified" if d.prediction_passed else "failed: searched")})
            if m.engine_path:
                text, step = agreement(backend, m.engine_path, eval_feeds, eval_ref)
                rows.append({"name": "crnn {}: text / per-step top-1 agreement of the searched "
                             "plan, {} images".format(name, EVAL_IMAGES), "ours": text,
                             "baseline": 1.0, "unit": "fraction",
                             "goal": "per-step top-1 {:.4f}".format(step)})
        for name, naive, engine in emulation_engines(path, plans, work):
            text, step = agreement(backend, engine, eval_feeds, eval_ref)
            rows.append({"name": "crnn {}{}: text / per-step top-1 agreement with fp32, "
                         "{} images".format(name, " naive emulation" if naive else "",
                                            EVAL_IMAGES),
                         "ours": text, "baseline": 1.0, "unit": "fraction",
                         "goal": "per-step top-1 {:.4f}".format(step)})
        rss = {}
        os.remove(ranges)
        for n in (CALIB_IMAGES, 10 * CALIB_IMAGES):
            data = os.path.join(work, "calib{}.npz".format(n))
            np.savez(data, image=np.concatenate(crops(n, seed=2)))
            proc = subprocess.run([sys.executable, "-c", CHILD, ROOT, path, data,
                                   os.path.join(work, "c{}.onnx".format(n))],
                                  check=True, capture_output=True, text=True)
            rss[n] = json.loads(proc.stdout.strip().splitlines()[-1])
        small, big = rss[CALIB_IMAGES], rss[10 * CALIB_IMAGES]
        rows.append({"name": "crnn calibration peak RSS, {} vs {} images".format(
            10 * CALIB_IMAGES, CALIB_IMAGES), "ours": big["maxrss_kb"] / 1024.0,
            "baseline": small["maxrss_kb"] / 1024.0, "unit": "MiB",
            "goal": "<= 1.1x: {}".format(
                "met" if big["maxrss_kb"] <= 1.1 * small["maxrss_kb"] else "MISSED")})
        rows.append({"name": "crnn calibration time, {} vs {} images".format(
            10 * CALIB_IMAGES, CALIB_IMAGES), "ours": big["seconds"],
            "baseline": small["seconds"], "unit": "s"})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


if __name__ == "__main__":
    for row in run():
        print(json.dumps(row))
