"""decide(): every matrix row x every precision x both fallback policies, plus the cases users
ask about (Nano/TX2 INT8, Orin/Thor FP8, the emulated host)."""

import pytest

from agent import platform as plat
from agent.errors import AgentError

MATRIX = plat.load_matrix()
ROWS = list(MATRIX.families) + ["host", "cc-6.1", "cc-8.6", "cc-8.9", "cc-12.0"]


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("precision", plat.PRECISIONS)
def test_every_row_and_precision(row, precision):
    info = plat.for_row(row)
    level = info.level(precision)
    strict = plat.decide(precision, info, fallback="reject")
    loose = plat.decide(precision, info, fallback="allow")
    if level != "none":
        for d in (strict, loose):
            assert (d.status, d.precision) == ("accepted", precision)
            assert d.emulated == (level == "emulated")
    else:
        assert strict.status == "rejected" and strict.precision is None
        with pytest.raises(AgentError) as err:
            strict.raise_if_rejected()
        assert err.value.code == "unsupported_precision"
        assert info.board in err.value.message and "row " + row in err.value.message
        assert "it supports fp32" in err.value.message
        # allow: falls back down the chain to something the row runs
        assert loose.status == "fell_back"
        assert loose.precision in plat.FALLBACK_CHAINS[precision]
        assert info.level(loose.precision) != "none"
        assert loose.raise_if_rejected() is loose


def test_nano_int8_falls_back_to_fp16_or_is_rejected():
    nano = plat.for_row("nano")
    d = plat.decide("int8", nano)
    assert (d.status, d.precision) == ("fell_back", "fp16")
    assert "int8 is not supported" in d.reason and "fell back to fp16" in d.reason
    rejected = plat.decide("int8", nano, fallback="reject")
    assert rejected.status == "rejected"
    with pytest.raises(AgentError) as err:
        rejected.raise_if_rejected()
    msg = err.value.message
    assert "Jetson Nano" in msg and "row nano" in msg and "fp32, fp16" in msg
    assert err.value.details["status"] == "rejected"


def test_tx2_int8_is_rejected_with_the_torch2trt_note():
    d = plat.decide("int8", plat.for_row("tx2"), fallback="reject")
    assert d.status == "rejected"
    assert "torch2trt" in d.reason and "TensorRT" in d.reason


def test_orin_fp8_rejected_thor_fp8_and_fp4_accepted():
    assert plat.decide("fp8", plat.for_row("agx-orin"), fallback="reject").status == "rejected"
    assert plat.decide("fp8", plat.for_row("orin-nano"), fallback="reject").status == "rejected"
    for precision in ("fp8", "fp4"):
        d = plat.decide(precision, plat.for_row("thor"), fallback="reject")
        assert (d.status, d.precision, d.emulated) == ("accepted", precision, False)


def test_fallback_chains_prefer_safe_formats():
    orin = plat.for_row("agx-orin")
    assert plat.decide("fp4", orin).precision == "fp16"  # fp4 -> fp8 (no) -> fp16
    assert plat.decide("bf16", plat.for_row("xavier-nx")).precision == "fp32"  # range kept


def test_host_precisions_are_emulated():
    host = plat.for_row("host")
    for precision in ("fp16", "int8"):
        d = plat.decide(precision, host)
        assert (d.status, d.emulated) == ("accepted", True)
        assert "emulated" in d.reason
    assert plat.decide("fp32", host).emulated is False
    d = plat.decide("bf16", host)
    assert (d.status, d.precision, d.emulated) == ("fell_back", "fp32", False)


def test_detected_host_emulates(tmp_path):
    info = plat.detect(str(tmp_path))  # an empty tree is a CPU host
    assert info.kind == "host"
    assert plat.decide("int8", info).emulated


@pytest.mark.parametrize("row, chosen, plan", [
    ("nano", "fp16", "fp16"),
    ("tx2", "fp16", "fp16"),
    ("xavier-nx", "int8", "best"),
    ("agx-orin", "int8", "best"),
    ("thor", "int8", "best"),
    ("cc-6.1", "int8", "int8"),  # INT8 but no fast FP16 (GP10x consumer cards)
    ("host", "int8", "best"),
])
def test_best_is_the_fastest_of_int8_fp16_fp32(row, chosen, plan):
    d = plat.decide("best", plat.for_row(row))
    assert (d.status, d.precision, d.plan_precision) == ("accepted", chosen, plan)
    assert d.emulated == (row == "host")


def test_preference_lists():
    orin, thor = plat.for_row("agx-orin"), plat.for_row("thor")
    d = plat.decide(["fp8", "int8", "fp16"], orin, fallback="reject")
    assert (d.status, d.precision) == ("fell_back", "int8")
    assert d.requested == ["fp8", "int8", "fp16"]
    assert plat.decide(["fp8", "int8"], thor).status == "accepted"
    rejected = plat.decide(["fp8", "fp4"], orin, fallback="reject")
    assert rejected.status == "rejected"
    assert "fp8 is not supported" in rejected.reason and "fp4" in rejected.reason
    d = plat.decide(["fp8", "fp4"], orin)  # allow: continue from the last preference
    assert (d.status, d.precision) == ("fell_back", "fp16")
    d = plat.decide(["int8", "best"], plat.for_row("nano"))
    assert (d.status, d.precision) == ("fell_back", "fp16")


def test_deciding_for_the_onnxruntime_backend_on_a_device():
    d = plat.decide("int8", plat.for_row("nano"), backend="onnxruntime")
    assert (d.status, d.emulated) == ("accepted", True)
    with pytest.raises(AgentError) as err:
        plat.decide("fp16", plat.for_row("host"), backend="tensorrt")
    assert err.value.code == "bad_argument"


@pytest.mark.parametrize("request_, fallback", [
    ("int4", "allow"), ([], "allow"), (["fp16", "fp12"], "allow"), ("fp16", "maybe"),
])
def test_bad_requests_are_agent_errors(request_, fallback):
    with pytest.raises(AgentError) as err:
        plat.decide(request_, plat.for_row("nano"), fallback=fallback)
    assert err.value.code == "bad_argument"
    assert "expected" in err.value.message or "must be one of" in err.value.message


def test_decision_to_dict_is_stable():
    d = plat.decide("int8", plat.for_row("nano")).to_dict()
    assert set(d) == {"status", "precision", "plan_precision", "requested", "reason", "emulated",
                      "fallback", "board", "matrix_row", "supported"}
    assert d["matrix_row"] == "nano" and d["supported"] == ["fp32", "fp16"]


@pytest.mark.parametrize("profile", ["8.0", "8.2", "8.5", "8.6", "10.3", "10.13", "11.x"])
def test_bf16_fp8_fp4_follow_the_installed_tensorrt(profile):
    """Issue 24 defect 5: the matrix rated precisions per board, not per TensorRT: bf16 was
    "native" on Orin under 8.5 / 8.6, whose DataType has no BF16. Each profile's DataType (read
    from that version's headers) decides which reduced types exist."""
    from tests.fake_trt import load_profile

    p = load_profile(profile)
    types = {"bf16": "BF16", "fp8": "FP8", "fp4": "FP4"}
    for row in ("agx-orin", "thor"):
        info = plat.for_row(row)
        info.tensorrt = p["version"]
        for precision, member in types.items():
            if info.level(precision) == "none":
                continue
            d = plat.decide(precision, info, fallback="reject")
            has_type = member in p["data_types"]
            assert d.ok == has_type, (row, precision, p["version"], d.reason)
            if not has_type:
                assert "needs TensorRT >= " in d.reason


def test_detection_drops_bf16_under_tensorrt_8_6():
    from agent.platform.versions import _check_precision_types

    info = plat.for_row("agx-orin")
    info.tensorrt = "8.6.2"
    _check_precision_types(info)
    assert info.level("bf16") == "none" and "bf16" not in info.supported_precisions
    assert "9.0" in info.matrix_row["precision_notes"]["bf16"]
    assert plat.for_row("agx-orin").level("bf16") == "native"  # the shared row is untouched


def test_a_jobs_fallback_list_never_lands_on_a_precision_the_build_refuses():
    """Issue 24 defect 5: decide accepted fp8/fp4/bf16 (from a job's fallback list) that no
    backend builds; with ``buildable`` it walks on to one it can build."""
    from agent.engines.backends.base import BUILDABLE

    thor = plat.for_row("thor")
    d = plat.decide(["fp8", "bf16", "fp16"], thor, fallback="reject", buildable=BUILDABLE)
    assert d.precision == "fp16" and d.status == "fell_back"
    assert "builds fp32, fp16, int8 engines only" in d.reason
    assert not plat.decide("fp4", thor, fallback="reject", buildable=BUILDABLE).ok
    assert plat.decide("best", thor, buildable=BUILDABLE).precision == "int8"
