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


def _search_models():
    import search_models
    return search_models


def test_default_search_on_a_real_vad_with_if_subgraphs(tmp_path):
    # Silero VAD (silero-vad's wheel): the network lives inside an If's subgraphs and its
    # outputs pass through Identity nodes that the fp16 build rounds. They are the
    # candidates, the If is named out of reach, and the default keeps fewer layers than
    # bisect (which keeps its whole prefix), proving each one needed.
    sm = _search_models()
    path = sm.model_path("vad")
    if path is None:
        pytest.skip("silero-vad is not installed (requirements-models.txt)")
    from agent.engines.cache import EngineCache
    from agent.precision import golden
    from agent.precision.searcher import run_search

    backend = create()
    feeds = sm.feeds("vad", 4, 0)
    goldens = golden.reference_outputs(path, feeds, backend)
    found = {}
    for mode in ("minimal", "bisect", "worst-first"):
        found[mode] = run_search(path, BuildPlan("fp16"), feeds, goldens, backend,
                                 EngineCache(str(tmp_path / mode)), {"kind": "host"}, mode=mode,
                                 compare_options={"atol": 1e-4, "rtol": 1e-4},
                                 calibration_dir=str(tmp_path / "cal"), report=lambda x: None)
    m, b, w = found["minimal"], found["bisect"], found["worst-first"]
    assert m.candidates == 2 and m.passed and m.one_minimal and m.untested_removals == []
    assert len(m.keep) <= min(len(b.keep), len(w.keep)) and len(m.keep) < len(b.keep)
    assert m.evaluations <= 3 * b.evaluations + 4
    assert not b.one_minimal and b.untested_removals  # honest: bisect's prefix is not proven
    assert m.out_of_reach and m.out_of_reach[0]["op"] == "If" and "If_0" in m.message


def test_a_real_model_that_passes_as_asked_takes_one_evaluation(tmp_path, feeds):
    # The CRNN passes fp16 with a median 0.05 check: one evaluation, no instrumented build.
    from agent.engines.cache import EngineCache
    from agent.precision import golden
    from agent.precision.searcher import run_search

    backend = create()
    goldens = golden.reference_outputs(MODEL, feeds, backend)
    r = run_search(MODEL, BuildPlan("fp16"), feeds, goldens, backend,
                   EngineCache(str(tmp_path / "engines")), {"kind": "host"},
                   compare_options={"atol": 0.05, "rtol": 0.05, "check_error_stat": "median"},
                   calibration_dir=str(tmp_path / "cal"), report=lambda x: None)
    assert r.keep == [] and r.evaluations == 1 and r.one_minimal
    # The check, then the final lookup of the same engine (a cache hit); no instrumented build.
    assert r.builds == 2 and r.cache_hits == 1 and not r.ranking
