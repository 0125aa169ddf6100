#!/usr/bin/env python3
"""Generate the bundled examples under ``examples/`` (deterministic: same bytes on every run
with the same library versions).

- ``examples/fp16_max/``: the "Adding Precision Constraints" model (flip, +FP16_MAX, -FP16_MAX,
  flip) with Polygraphy-format inputs (``--val-range x:[1,2]``, seed 1) and fp32 goldens.
  In fp16 the Add overflows; keeping Add and Sub in fp32 fixes it.
- ``examples/digits/``: an MLP trained on scikit-learn's digits (1797 real 8x8 images, 70/30
  split), its calibration shards (training rows), inputs and fp32 goldens from the held-out
  rows, and the held-out labels; the fp32 accuracy goes into ``examples/README.md``.
- ``examples/digits_v2/``: a second version of the classifier (64-96-32-10, same split) and its
  fp32 goldens on the same inputs; ``examples/digits_v3_broken/``: v2 with its output classes
  rotated by one (every digit d is answered as d-1) and goldens made from itself, so it passes the
  agent's accuracy gate (top-1 agreement with its goldens) while the example app's own stored
  checks (``examples/app/checks.npz``: held-out rows with their true labels) fail on it.

Usage: ``python scripts/make_examples.py [--out DIR] [--check]``. ``--check`` regenerates into a
temporary directory and lists the files that differ from the committed ones (exit 1 if any).
"""

import argparse
import hashlib
import io
import json
import os
import shutil
import sys
import tempfile
import zipfile
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from agent.precision import golden  # noqa: E402
from tests.models import digits_classifier, fp16_max_model  # noqa: E402

FP16_MAX_RANGE = (1.0, 2.0)  # the seed's --val-range x:[1,2]
DIGITS_CALIB_SHARDS = 4
DIGITS_CALIB_ROWS = 512  # training rows used for calibration
DIGITS_ITERATION_ROWS = 54  # held-out rows per golden iteration (540 rows -> 10 iterations)
ZIP_TIME = (1980, 1, 1, 0, 0, 0)  # fixed, so .npz bytes do not depend on the clock


def save_npz(path: str, arrays: Dict[str, np.ndarray]) -> None:
    """np.savez with fixed member timestamps (numpy stamps the current time)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name in sorted(arrays):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.ascontiguousarray(arrays[name]),
                                      allow_pickle=False)
            info = zipfile.ZipInfo(name + ".npy", date_time=ZIP_TIME)
            info.external_attr = 0o644 << 16
            zf.writestr(info, member.getvalue())
    write_bytes(path, buf.getvalue())


def save_npy(path: str, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.ascontiguousarray(array), allow_pickle=False)
    write_bytes(path, buf.getvalue())


def write_bytes(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, 0o644)


def save_model(path: str, model) -> None:
    write_bytes(path, model.SerializeToString())


def fp32_outputs(model_path: str, feeds: List[Dict[str, np.ndarray]]):
    return golden.reference_outputs(model_path, feeds)


def make_fp16_max(out: str) -> Dict[str, Any]:
    from agent.engines.backends import onnx_model

    d = os.path.join(out, "fp16_max")
    model_path = os.path.join(d, "model.onnx")
    save_model(model_path, fp16_max_model())
    specs = onnx_model.input_specs(onnx_model.load_model(model_path))
    # polygraphy run needs_constraints.onnx --onnxrt --val-range x:[1,2]
    #     --save-inputs inputs.json --save-outputs golden.json
    inputs = golden.generate_inputs(specs, {"x": FP16_MAX_RANGE}, seed=golden.DEFAULT_SEED)
    golden.save_inputs(os.path.join(d, "inputs.json"), inputs)
    golden.save_outputs(os.path.join(d, "golden.json"), fp32_outputs(model_path, inputs))
    return {"iterations": len(inputs)}


APP_CHECK_ROWS = 50  # held-out rows the example app checks each new version on
V2_HIDDEN = (96, 32)


def rotate_classes(model, shift: int = 1):
    """The classifier with its output classes rotated: logit j becomes the old logit
    (j + shift) % 10, so a digit d is answered as d - shift. Same graph, same tensor names."""
    from onnx import numpy_helper

    broken = type(model)()
    broken.CopyFrom(model)
    for init in broken.graph.initializer:
        if init.name in ("fc_out.weight", "fc_out.bias"):
            arr = numpy_helper.to_array(init)
            order = (np.arange(arr.shape[-1]) + shift) % arr.shape[-1]
            init.CopyFrom(numpy_helper.from_array(
                np.ascontiguousarray(arr[..., order]).astype(np.float32), init.name))
    return broken


def make_digits_versions(out: str) -> Dict[str, Any]:
    """digits_v2 (retrained, wider) and digits_v3_broken (v2 with rotated classes), each with
    fp32 goldens on examples/digits/inputs.json; the app's stored checks."""
    model, (_x_train, _y_train, x_test, y_test) = digits_classifier(hidden=V2_HIDDEN)
    inputs = golden.load_inputs(os.path.join(out, "digits", "inputs.json"))
    info: Dict[str, Any] = {}
    for name, version in (("digits_v2", model), ("digits_v3_broken", rotate_classes(model))):
        d = os.path.join(out, name)
        model_path = os.path.join(d, "model.onnx")
        save_model(model_path, version)
        outputs = fp32_outputs(model_path, inputs)
        golden.save_outputs(os.path.join(d, "golden.json"), outputs)
        logits = np.concatenate([o["logits"] for o in outputs], axis=0)
        truth = y_test[:len(logits)]
        info[name] = {"fp32_accuracy": float(np.mean(np.argmax(logits, axis=-1) == truth))}
    save_npz(os.path.join(out, "app", "checks.npz"),
             {"input": x_test[:APP_CHECK_ROWS].astype(np.float32),
              "label": y_test[:APP_CHECK_ROWS].astype(np.int64)})
    return info


def make_digits(out: str) -> Dict[str, Any]:
    d = os.path.join(out, "digits")
    model, (x_train, _y_train, x_test, y_test) = digits_classifier()
    model_path = os.path.join(d, "model.onnx")
    save_model(model_path, model)
    calib = x_train[:DIGITS_CALIB_ROWS]
    for i, shard in enumerate(np.array_split(calib, DIGITS_CALIB_SHARDS)):
        save_npz(os.path.join(d, "calib", "shard_{:03d}.npz".format(i)), {"input": shard})
    rows = (len(x_test) // DIGITS_ITERATION_ROWS) * DIGITS_ITERATION_ROWS
    x_eval, y_eval = x_test[:rows], y_test[:rows]
    inputs = [{"input": x_eval[i:i + DIGITS_ITERATION_ROWS]}
              for i in range(0, rows, DIGITS_ITERATION_ROWS)]
    golden.save_inputs(os.path.join(d, "inputs.json"), inputs)
    outputs = fp32_outputs(model_path, inputs)
    golden.save_outputs(os.path.join(d, "golden.json"), outputs)
    save_npy(os.path.join(d, "labels.npy"), y_eval.astype(np.int64))
    labels_json = {"classes": [str(c) for c in range(10)],
                   "labels": [int(v) for v in y_eval]}
    write_bytes(os.path.join(d, "labels.json"),
                (json.dumps(labels_json, separators=(",", ":")) + "\n").encode("ascii"))
    logits = np.concatenate([o["logits"] for o in outputs], axis=0)
    accuracy = float(np.mean(np.argmax(logits, axis=-1) == y_eval))
    return {"fp32_accuracy": accuracy, "eval_rows": rows, "iterations": len(inputs),
            "calib_rows": len(calib), "train_rows": len(x_train)}


README = """# Bundled examples

Generated by `python scripts/make_examples.py` (deterministic; `--check` compares a fresh run
with these files). `./scripts/demo` rolls both out to two local agents.

## `fp16_max/`: a model that needs precision constraints

The model of Polygraphy's "Adding Precision Constraints" example: `x` (float32[1,1,4,4]) is
flipped by a MatMul, `FP16_MAX` is added and subtracted again, and it is flipped back, so in fp32
`y == x`. In fp16 the `Add` overflows to infinity for positive inputs; keeping `Add` and `Sub` in
fp32 fixes it.

| file | what |
|---|---|
| `model.onnx` | the model (nodes `MatMul_0`, `Add`, `Sub`, `MatMul_1`) |
| `inputs.json` | Polygraphy `--save-inputs` JSON: {fp16_iterations} iteration, `x:[1,2]`, seed 1 |
| `golden.json` | Polygraphy `--save-outputs` RunResults JSON: the fp32 outputs (ONNX Runtime) |

```bash
jetson-agent fleet rollout --model examples/fp16_max/model.onnx \\
    --inputs examples/fp16_max/inputs.json --golden examples/fp16_max/golden.json \\
    --precision fp16 --search minimal --check-error-stat median --all
```

## `digits/`: a real classifier for INT8

An MLP (64-64-32-10, Gemm + Relu) trained with scikit-learn on its digits dataset (1797 real
8x8 handwritten digits, scaled to [0, 1], shuffled with seed 0, 70/30 split:
{train_rows} training rows, {test_rows} held out).

| file | what |
|---|---|
| `model.onnx` | the classifier: `input` float32[N,64] -> `logits` float32[N,10] |
| `calib/shard_*.npz` | INT8 calibration: {calib_rows} training rows, {calib_shards} shards |
| `inputs.json` | {eval_rows} held-out rows: {digits_iterations} iterations of {iteration_rows} |
| `golden.json` | their fp32 logits (Polygraphy `--save-outputs` RunResults JSON) |
| `labels.npy` | the true digit of each held-out row, int64[{eval_rows}], in input order |
| `labels.json` | the class names and the same labels as JSON |

**fp32 accuracy on the held-out rows: {fp32_accuracy:.2%}** ({correct} of {eval_rows}). An INT8
deployment reports its own label accuracy next to this one and its top-1 agreement with the
fp32 goldens.

```bash
jetson-agent fleet rollout --model examples/digits/model.onnx --calib examples/digits/calib \\
    --inputs examples/digits/inputs.json --golden examples/digits/golden.json \\
    --labels examples/digits/labels.npy --precision int8 --min-top1 0.95 \\
    --atol 0.5 --rtol 0.5 --check-error-stat mean --all
```

## `digits_v2/` and `digits_v3_broken/`: later versions of the classifier for the app demo

Named versions of the same model (`--name digits`) for `./scripts/demo`'s application part:
the example inference app (`app/`, see its README) serves `digits` and checks every new version
on its own stored rows before it takes it.

| dir | what | fp32 accuracy on the held-out rows |
|---|---|---|
| `digits/` | v1 | {fp32_accuracy:.2%} |
| `digits_v2/` | v2: retrained, 64-96-32-10, same split | {v2_accuracy:.2%} |
| `digits_v3_broken/` | v3: v2 with its classes rotated (d answered d-1) | {v3_accuracy:.2%} |

Each holds `model.onnx` and `golden.json` (its own fp32 logits on `digits/inputs.json`); they use
`digits/`'s inputs, calibration and labels. v3's goldens come from v3 itself, so it passes the
agent's gate (top-1 agreement with the goldens) like any other version; `app/checks.npz`
({check_rows} held-out rows and their true labels) is what the app checks, and v3 fails there:
the app reports it unhealthy and the agent rolls the device back to v2.

```bash
jetson-agent fleet rollout --name digits --version v3 \
    --model examples/digits_v3_broken/model.onnx --calib examples/digits/calib \
    --inputs examples/digits/inputs.json --golden examples/digits_v3_broken/golden.json \
    --precision int8 --min-top1 0.95 --atol 0.5 --rtol 0.5 --check-error-stat mean --all
```
"""


def generate(out: str) -> Dict[str, Any]:
    fp16 = make_fp16_max(out)
    digits = make_digits(out)
    versions = make_digits_versions(out)
    eval_rows, accuracy = int(digits["eval_rows"]), float(digits["fp32_accuracy"])
    text = README.format(
        fp16_iterations=fp16["iterations"], train_rows=digits["train_rows"],
        test_rows=1797 - int(digits["train_rows"]), calib_rows=digits["calib_rows"],
        calib_shards=DIGITS_CALIB_SHARDS, eval_rows=eval_rows,
        digits_iterations=digits["iterations"], iteration_rows=DIGITS_ITERATION_ROWS,
        fp32_accuracy=accuracy, correct=int(round(accuracy * eval_rows)),
        v2_accuracy=versions["digits_v2"]["fp32_accuracy"],
        v3_accuracy=versions["digits_v3_broken"]["fp32_accuracy"],
        check_rows=APP_CHECK_ROWS)
    write_bytes(os.path.join(out, "README.md"), text.encode("utf-8"))
    for dirpath, _, names in os.walk(out):  # atomic writes leave 0600; these are for sharing
        for name in names:
            os.chmod(os.path.join(dirpath, name), 0o644)
    return {"fp16_max": fp16, "digits": digits, "versions": versions}


def generated(rel: str) -> bool:
    """Whether a file under examples/ is this script's (the app's code and docs are written by
    hand; compiled Python is nobody's)."""
    parts = rel.split(os.sep)
    if "__pycache__" in parts:
        return False
    return not (parts[0] == "app" and not rel.endswith(".npz"))


def tree_digests(root: str) -> Dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            if not generated(os.path.relpath(path, root)):
                continue
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "examples"),
                        help="output directory (default: examples/)")
    parser.add_argument("--check", action="store_true",
                        help="regenerate into a temporary directory and compare with --out")
    args = parser.parse_args(argv)
    if args.check:
        tmp = tempfile.mkdtemp(prefix="examples-")
        try:
            generate(tmp)
            fresh, committed = tree_digests(tmp), tree_digests(args.out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        differ = sorted(p for p in set(fresh) | set(committed)
                        if fresh.get(p) != committed.get(p))
        for path in differ:
            print("differs: {}".format(path))
        print("{} file(s) checked, {} differ".format(len(fresh), len(differ)))
        return 1 if differ else 0
    info = generate(args.out)
    print(json.dumps(info, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
