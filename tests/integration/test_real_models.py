"""A real pretrained model shipped inside a PyPI wheel, on real images.

captcha-whisperer's CRNN (``captcha_crnn.onnx`` in the wheel: 24 convolutions and an unrolled
bidirectional LSTM, weights in Constant nodes, a Reshape fed by Shape) on crops of
scikit-learn's sample photographs. The task metric is the text the CTC head decodes, compared
with the fp32 model's. The bigger measurements (searches, calibration memory) are in
``scripts/benchmarks/real_models.py``.
"""

import os
import sys

import numpy as np
import pytest

from agent.engines.backends.base import BuildPlan
from agent.engines.backends.onnxruntime import create

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts", "benchmarks"))
import real_models  # noqa: E402

MODEL = real_models.model_path()
pytestmark = pytest.mark.skipif(MODEL is None, reason="captcha-whisperer is not installed")


@pytest.fixture(scope="module")
def feeds():
    pytest.importorskip("PIL")
    return [{"image": x} for x in real_models.crops(3)]


def test_instrumented_crnn_builds_and_loads(tmp_path):
    # Every float tensor marked as an output (the instrumented phase of a search): the engine
    # is published only if our own loader takes it, and it does.
    plan = BuildPlan("fp16")
    plan.mark_outputs = ["*"]
    backend = create()
    result = backend.build(MODEL, plan, str(tmp_path / "marked.onnx"))
    with backend.open(result.engine_path) as runner:
        assert len(runner.outputs) > 500


def test_emulated_fp16_crnn_reads_the_same_text(tmp_path, feeds):
    backend = create()
    fp32 = backend.build(MODEL, BuildPlan("fp32"), str(tmp_path / "fp32.onnx")).engine_path
    with backend.open(fp32) as runner:
        reference = [real_models.decode(runner.infer(f)["logits"]) for f in feeds]
    assert any(reference)  # the photographs read as some text
    result = backend.build(MODEL, BuildPlan("fp16"), str(tmp_path / "fp16.onnx"))
    assert result.details["emulation"].startswith("trt")
    assert real_models.agreement(backend, result.engine_path, feeds, reference) == 1.0
    with backend.open(result.engine_path) as runner:
        logits = runner.infer(feeds[0])["logits"]
    assert np.isfinite(logits).all()
