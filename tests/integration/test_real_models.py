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


def _vad_path():
    path = _search_models().model_path("vad")
    if path is None:
        pytest.skip("silero-vad is not installed (requirements-models.txt)")
    return path


def _fp16_casts_inside(engine_path):
    import onnx

    from agent.engines.backends.subgraphs import nested_nodes

    model = onnx.load(engine_path)
    return sum(1 for n in nested_nodes(model.graph) if n.op_type == "Cast"
               and any(a.name == "to" and a.i == onnx.TensorProto.FLOAT16 for a in n.attribute))


def test_silero_if_branches_run_in_fp16_on_the_host(tmp_path):
    # Issue 34: the 684 nodes inside Silero's If branches ran in fp32 while the build said
    # "float16". Now their layers are rounded as TensorRT would run them, counted apart, and
    # --layer-precisions If_0:float32 keeps the whole branch in fp32 (the fp32 numbers).
    path = _vad_path()
    feed = _search_models().feeds("vad", 1, 0)[0]
    backend = create()
    runs = {}
    for label, plan in (("fp32", BuildPlan("fp32")), ("fp16", BuildPlan("fp16")),
                        ("kept", BuildPlan("fp16"))):
        if label == "kept":
            plan.layer_precisions = {"If_0": "float32"}
        result = backend.build(path, plan, str(tmp_path / (label + ".onnx")))
        with backend.open(result.engine_path) as runner:
            runs[label] = (result, runner.infer(dict(feed)), _fp16_casts_inside(
                result.engine_path))
    fp16, out16, casts16 = runs["fp16"]
    assert fp16.details["subgraph_counts"] == {"float32": 0, "float16": 210, "int8": 0}
    assert fp16.layer_precisions["If_0"] == "float16" and casts16 > 200
    kept, out_kept, casts_kept = runs["kept"]
    assert kept.details["subgraph_counts"]["float32"] == 210 and casts_kept == 0
    ref = runs["fp32"][1]["stateN"]
    assert np.array_equal(out_kept["stateN"], ref.astype(np.float16).astype(np.float32))
    assert not np.array_equal(out16["stateN"], out_kept["stateN"])


def test_silero_int8_inside_subgraphs_is_warned(tmp_path):
    # What the host cannot emulate is said: int8 needs ranges of tensors inside the
    # branches, so their Conv layers run in fp16 here, and the build says how many.
    result = create().build(_vad_path(), BuildPlan("best"), str(tmp_path / "best.onnx"))
    assert "12 Conv/Gemm/MatMul node(s) inside subgraphs run in fp16 here" in \
        result.details["warning"]


def test_default_search_on_a_real_vad_with_if_subgraphs(tmp_path):
    # Silero VAD (silero-vad's wheel): the network lives inside an If's subgraphs (which
    # run in fp16 with the If, one candidate) and its outputs pass through Identity nodes
    # that the fp16 build rounds. At 1e-4 the If must stay fp32; the nodes inside are named
    # out of reach one by one, and the default keeps fewer layers than bisect (which keeps
    # its whole prefix), proving each one needed.
    sm = _search_models()
    path = _vad_path()
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
    assert m.candidates == 3 and m.passed and m.one_minimal and m.untested_removals == []
    assert "If_0" in m.keep  # its 684 nodes ran in fp16 without it
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
