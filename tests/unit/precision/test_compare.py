import json
import math

import numpy as np
import pytest

from agent.errors import AgentError
from agent.precision.compare import EPSILON, compare_arrays, compare_outputs, parse_per_output
from agent.precision.metrics import cosine_similarity, error_stats, sqnr_db, top1_agreement

GOLD = np.array([1.0, 2.0, 4.0, 8.0], dtype=np.float32)


def test_elemwise_fails_only_where_both_tolerances_are_exceeded():
    out = GOLD + np.array([0.0, 0.0, 0.0, 0.5], dtype=np.float32)  # abs 0.5, rel 0.0625
    assert compare_arrays(out, GOLD, atol=0.5, rtol=0.0).passed  # abs within
    assert compare_arrays(out, GOLD, atol=0.0, rtol=0.07).passed  # rel within
    r = compare_arrays(out, GOLD, atol=0.4, rtol=0.06)
    assert not r.passed and r.mismatches == 1
    # The minimum tolerances that would have passed (one kind set alone).
    assert r.required_atol == pytest.approx(0.5)
    assert r.required_rtol == pytest.approx(0.0625)


def test_elemwise_checks_each_element_against_either_tolerance():
    # Element 0 is within atol only, element 1 within rtol only: elemwise passes, although
    # max(absdiff) > atol and max(reldiff) > rtol together (what "max" checks).
    gold = np.array([0.1, 100.0], dtype=np.float32)
    out = np.array([0.2, 101.0], dtype=np.float32)
    assert compare_arrays(out, gold, atol=0.15, rtol=0.02).passed
    assert not compare_arrays(out, gold, atol=0.15, rtol=0.02, check_error_stat="max").passed


def test_nan_in_outputs_fails_and_inf_needs_the_flag():
    out = GOLD.copy()
    out[0] = np.nan
    assert not compare_arrays(out, GOLD, atol=1e9, rtol=1e9).passed
    assert not compare_arrays(out, GOLD, atol=1e9, rtol=1e9, check_error_stat="median").passed
    gold = np.array([np.inf, -np.inf, 1.0], dtype=np.float32)
    assert not compare_arrays(gold.copy(), gold).passed  # inf - inf is NaN
    assert compare_arrays(gold.copy(), gold, infinities_compare_equal=True).passed
    # Opposite infinities never compare equal.
    flipped = np.array([-np.inf, -np.inf, 1.0], dtype=np.float32)
    assert not compare_arrays(flipped, gold, infinities_compare_equal=True).passed


def test_statistics_pass_when_either_stat_is_within_tolerance():
    out = GOLD.copy()
    out[3] += 4.0  # one large error: absdiff [0, 0, 0, 4], reldiff [0, 0, 0, 0.5]
    assert compare_arrays(out, GOLD, check_error_stat="median").passed
    assert not compare_arrays(out, GOLD, check_error_stat="mean").passed
    assert compare_arrays(out, GOLD, atol=1.0, check_error_stat="mean").passed  # mean abs 1
    assert compare_arrays(out, GOLD, rtol=0.125, check_error_stat="mean").passed
    assert not compare_arrays(out, GOLD, atol=3.9, rtol=0.49, check_error_stat="max").passed
    r = compare_arrays(out, GOLD, check_error_stat="quantile", error_quantile=0.5)
    assert r.passed and r.required_atol == 0.0
    r = compare_arrays(out, GOLD, check_error_stat="quantile", error_quantile=0.99)
    assert not r.passed
    assert r.required_atol == pytest.approx(np.quantile([0, 0, 0, 4.0], 0.99))


def test_golden_zeros_get_polygraphy_epsilon():
    gold = np.array([0.0, 1.0], dtype=np.float32)
    out = np.array([1e-3, 1.0], dtype=np.float32)
    assert not compare_arrays(out, gold, atol=0.0, rtol=1e9).passed
    r = compare_arrays(out, gold, atol=0.0, rtol=1e13)
    assert r.passed
    assert r.reldiff["max"] == pytest.approx(np.float32(1e-3) / np.float32(EPSILON), rel=1e-6)


def test_float16_is_cast_up_and_bools_compare_with_xor():
    gold = np.array([1.0, 2.0], dtype=np.float32)
    out = gold.astype(np.float16)
    assert compare_arrays(out, gold).passed
    b = np.array([True, False, True])
    r = compare_arrays(b, np.array([True, True, True]), atol=0.0, rtol=0.0)
    assert not r.passed and r.mismatches == 1


def test_shapes_must_match():
    r = compare_arrays(GOLD.reshape(2, 2), GOLD)
    assert not r.passed and "different shapes" in r.reason


def test_sqnr_and_cosine():
    out = GOLD * np.float32(1.001)
    assert sqnr_db(out, GOLD) == pytest.approx(60.0, abs=0.01)
    assert cosine_similarity(out, GOLD) == pytest.approx(1.0)
    assert cosine_similarity(-GOLD, GOLD) == pytest.approx(-1.0)
    assert math.isinf(sqnr_db(GOLD, GOLD))
    assert math.isnan(sqnr_db(np.array([np.inf]), np.array([1.0])))
    # A golden of about 0: no SQNR (it would read -160 dB on a row that passes).
    assert sqnr_db(np.full(10, 1e-8), np.full(10, 1e-16)) is None


def test_top1_agreement():
    gold = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    out = np.array([[0.2, 0.8], [0.1, 0.9], [0.3, 0.7]])
    assert top1_agreement(out, gold) == pytest.approx(2.0 / 3.0)
    with pytest.raises(AgentError) as err:
        top1_agreement(out[:2], gold)
    assert err.value.code == "golden_mismatch"


def test_per_output_tolerances():
    atol = parse_per_output(["1e-5", "out0:1e-3", "scope:out1:0.5"], "--atol")
    assert atol == {"": 1e-5, "out0": 1e-3, "scope:out1": 0.5}
    golden = {"out0": GOLD, "scope:out1": GOLD, "out2": GOLD}
    outputs = {k: v + np.float32(1e-4) for k, v in golden.items()}
    cmp = compare_outputs(outputs, golden, atol=atol, rtol=0.0)
    assert [r.passed for r in cmp.results] == [True, True, False]
    assert cmp.failed_outputs() == ["out2"]
    assert not cmp.passed
    stats = parse_per_output(["median", "out2:max"], "--check-error-stat", "stat")
    cmp = compare_outputs(outputs, golden, atol=atol, rtol=0.0, check_error_stat=stats)
    assert [r.stat for r in cmp.results] == ["median", "median", "max"]


@pytest.mark.parametrize("items,kind", [
    (["-1e-5"], "float"), (["out0:-1"], "float"), (["nan"], "float"), (["abc"], "float"),
    (["out0:"], "float"), (["worst"], "stat"), (["1.5"], "quantile"), (["-0.1"], "quantile"),
])
def test_nonsensical_tolerances_are_bad_arguments(items, kind):
    with pytest.raises(AgentError) as err:
        parse_per_output(items, "--atol", kind)
    assert err.value.code == "bad_argument"


def test_compare_outputs_validates_its_arguments():
    golden = {"y": GOLD}
    for kwargs in ({"atol": -1.0}, {"rtol": float("nan")}, {"check_error_stat": "worst"},
                   {"error_quantile": 2.0}, {"atol": {"nope": 1e-3}}):
        with pytest.raises(AgentError) as err:
            compare_outputs(golden, golden, **kwargs)
        assert err.value.code == "bad_argument", kwargs
    with pytest.raises(AgentError) as err:
        compare_outputs({"z": GOLD}, golden)
    assert err.value.code == "golden_mismatch" and "'y'" in err.value.message
    with pytest.raises(AgentError) as err:
        compare_outputs([golden, golden], [golden])
    assert err.value.code == "golden_mismatch"


def test_iterations_and_report():
    golden = [{"y": GOLD}, {"y": GOLD}]
    outputs = [{"y": GOLD}, {"y": GOLD + np.float32(1.0)}]
    cmp = compare_outputs(outputs, golden, runner="trt-runner", reference="onnxrt-runner")
    assert not cmp.passed and cmp.iterations == 2
    text = cmp.format_report()
    assert "[I] Accuracy Comparison | trt-runner vs. onnxrt-runner" in text
    assert "Tolerance: [abs=1e-05, rel=1e-05] | Checking elemwise error" in text
    assert "Minimum Required Tolerance: elemwise error | [abs=1] OR [rel=1]" in text
    assert "[I]     Iteration: 1" in text
    assert "FAILED | Output: 'y' | Difference exceeds tolerance (rel=1e-05, abs=1e-05)" in text
    assert "Passed: 1/2 iterations | Pass Rate: 50.0%" in text
    doc = cmp.to_dict()
    json.dumps(doc, allow_nan=False)  # strict JSON: non-finite values are null
    assert doc["outputs"]["y"]["required_atol"] == 1.0
    assert doc["outputs"]["y"]["passed"] is False
    assert doc["results"][0]["sqnr_db"] is None  # identical: infinite SQNR
    assert "| Stats: mean=" not in text  # the buffers' summaries: only when described
    described = compare_outputs(outputs, golden, runner="trt-runner",
                                reference="onnxrt-runner", describe=True)
    assert described.to_dict() == doc  # the same figures and verdicts either way
    text = described.format_report()
    assert "trt-runner: y | Stats: mean=" in text and "Absolute Difference | Stats:" in text


def test_nan_statistics_stay_json_safe():
    out = GOLD.copy()
    out[1] = np.nan
    doc = compare_outputs({"y": out}, {"y": GOLD}).to_dict()
    json.dumps(doc, allow_nan=False)
    assert doc["outputs"]["y"]["required_atol"] is None


def test_error_stats_are_numpys_from_one_sort():
    rng = np.random.default_rng(7)
    for n in (1, 2, 3, 10, 1001):
        for q in (0.0, 0.5, 0.9, 0.99, 1.0):
            buf = np.abs(rng.standard_normal((n, 1))).astype(np.float32)
            got = error_stats(buf, q)
            want = {"max": np.amax(buf), "mean": np.mean(buf.astype(np.float64)),
                    "median": np.median(buf), "quantile": np.quantile(buf, q)}
            for key, value in want.items():
                assert got[key] == pytest.approx(float(value), rel=1e-6), (n, q, key)
    assert error_stats(np.zeros((0,), np.float32), 0.5)["max"] == 0.0
    with_nan = error_stats(np.array([1.0, np.nan, 2.0]), 0.5)
    assert all(np.isnan(v) for v in with_nan.values())
    assert error_stats(np.array([1.0, np.inf]), 0.0)["quantile"] == 1.0  # numpy: inf * 0
