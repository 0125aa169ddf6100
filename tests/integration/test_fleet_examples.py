"""The bundled examples: generated deterministically, consistent with their models, and the
fp32 accuracy in examples/README.md is the one the files give."""

import os
import re
import subprocess
import sys

import numpy as np

from agent import fleet
from agent.engines.backends import onnx_model
from agent.precision import golden

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
SCRIPT = os.path.join(ROOT, "scripts", "make_examples.py")


def digests(root):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    try:
        import make_examples
    finally:
        sys.path.pop(0)
    return make_examples.tree_digests(root)


def test_generation_is_deterministic(tmp_path):
    for out in ("a", "b"):
        subprocess.run([sys.executable, SCRIPT, "--out", str(tmp_path / out)], check=True,
                       capture_output=True, cwd=ROOT, timeout=120)
    first, second = digests(str(tmp_path / "a")), digests(str(tmp_path / "b"))
    assert first == second
    assert set(first) == set(digests(EXAMPLES))  # the committed tree has the same files


def test_committed_examples_fit_their_models(tmp_path):
    files = fleet.prepare_rollout(
        os.path.join(EXAMPLES, "digits", "model.onnx"), "int8", str(tmp_path),
        calib=os.path.join(EXAMPLES, "digits", "calib"),
        inputs=os.path.join(EXAMPLES, "digits", "inputs.json"),
        goldens=os.path.join(EXAMPLES, "digits", "golden.json"),
        labels=os.path.join(EXAMPLES, "digits", "labels.npy"), min_top1=0.9)
    assert sorted(files) == ["calibration", "goldens", "inputs", "labels", "model"]
    packed = np.load(files["calibration"])
    assert packed["input"].shape == (512, 64)
    fleet.prepare_rollout(os.path.join(EXAMPLES, "fp16_max", "model.onnx"), "fp16",
                          str(tmp_path), inputs=os.path.join(EXAMPLES, "fp16_max",
                                                             "inputs.json"),
                          goldens=os.path.join(EXAMPLES, "fp16_max", "golden.json"),
                          search="minimal")
    # The fp16_max goldens are the model's fp32 outputs: y == x up to fp32 rounding at
    # FP16_MAX (an ulp of 2**-8 there).
    x = golden.load_inputs(os.path.join(EXAMPLES, "fp16_max", "inputs.json"))[0]["x"]
    y = golden.load_outputs(os.path.join(EXAMPLES, "fp16_max", "golden.json"))[0]["y"]
    assert np.allclose(x, y, rtol=0, atol=2.0 ** -8) and 1.0 <= x.min() and x.max() <= 2.0
    names = [n.name for n in onnx_model.load_model(os.path.join(EXAMPLES, "fp16_max",
                                                                "model.onnx")).graph.node]
    assert names == ["MatMul_0", "Add", "Sub", "MatMul_1"]


def test_readme_accuracy_matches_the_files():
    outputs = golden.load_outputs(os.path.join(EXAMPLES, "digits", "golden.json"))
    logits = np.concatenate([o["logits"] for o in outputs])
    labels = np.load(os.path.join(EXAMPLES, "digits", "labels.npy"))
    accuracy = float(np.mean(np.argmax(logits, axis=-1) == labels))
    with open(os.path.join(EXAMPLES, "README.md")) as f:
        text = f.read()
    shown = re.search(r"fp32 accuracy on the held-out rows: (\d+\.\d+)%", text)
    assert shown and abs(float(shown.group(1)) - 100 * accuracy) < 0.01
    assert accuracy > 0.9
