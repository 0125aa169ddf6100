"""TensorRT calibration cache text format (calib/cache.py)."""

import struct

import pytest

from agent.errors import AgentError
from calib.cache import (
    ALGORITHM_NAMES,
    algorithm_name,
    check_compatible,
    format_cache,
    parse_cache,
    read_cache,
    trt_version_tag,
    version_from_tag,
    write_cache,
)

# The shape of a cache TensorRT 8.6 writes for an ONNX classifier (entropy2).
TRT86_CACHE = """TRT-8601-EntropyCalibration2
input: 3c010a14
conv1.weight_quant: 3c8954e6
(Unnamed Layer* 3) [Shuffle]_output: 3d2d1f3c
encoder/attn: out: 3f800000
"""


@pytest.mark.parametrize("version,tag", [
    ("7.1.3", "7103"), ("8.2.1", "8201"), ("8.5.2", "8502"), ("8.6.1", "8601"),
    ("10.3.0", "100300"), ("10.12.0", "101200"), ("10.0", "100000"),
])
def test_version_tags_follow_tensorrts_two_encodings(version, tag):
    assert trt_version_tag(version) == tag
    assert version_from_tag(tag) == (version if version.count(".") == 2 else version + ".0")


def test_bad_version_is_a_clear_error():
    with pytest.raises(AgentError) as err:
        trt_version_tag("ten")
    assert err.value.code == "bad_argument" and "10.3.0" in err.value.message


def test_parse_real_layout_splits_names_on_the_last_colon():
    cache = parse_cache(TRT86_CACHE)
    assert cache.header == "TRT-8601-EntropyCalibration2"
    assert cache.algorithm == "EntropyCalibration2" and cache.algorithm_key == "entropy2"
    assert cache.version == "8601" and cache.trt_version == "8.6.1"
    assert set(cache.scales) == {"input", "conv1.weight_quant",
                                 "(Unnamed Layer* 3) [Shuffle]_output", "encoder/attn: out"}
    assert cache.scales["encoder/attn: out"] == 1.0
    assert cache.scales["input"] == struct.unpack(">f", bytes.fromhex("3c010a14"))[0]
    assert cache.amax["encoder/attn: out"] == 127.0


def test_write_then_read_round_trips_amax(tmp_path):
    amax = {"input": 1.0, "fc0.out": 12.7, "odd: name": 127.0, "zero": 0.0}
    path = str(tmp_path / "calib.cache")
    write_cache(path, amax, "minmax", "10.3.0")
    text = open(path).read()
    assert text.splitlines()[0] == "TRT-100300-MinMaxCalibration"
    assert "odd: name: 3f800000" in text.splitlines()  # scale 1.0, big-endian bits
    assert "fc0.out: 3dcccccd" in text.splitlines()  # scale 0.1
    cache = read_cache(path)
    for name, value in amax.items():
        assert cache.amax[name] == pytest.approx(value, rel=1e-6)


def test_values_can_be_scales():
    text = format_cache({"t": 0.5}, "entropy2", "8.6.1", values_are_scales=True)
    assert text == "TRT-8601-EntropyCalibration2\nt: 3f000000\n"


def test_algorithm_names():
    assert algorithm_name("entropy2") == "EntropyCalibration2"
    assert algorithm_name("minmax") == "MinMaxCalibration"
    assert algorithm_name("legacy") == "LegacyCalibration"
    assert algorithm_name("entropy") == "EntropyCalibration"
    assert algorithm_name("percentile") == "PercentileCalibration"
    assert algorithm_name("EntropyCalibration2") == "EntropyCalibration2"
    assert set(ALGORITHM_NAMES) >= {"entropy2", "minmax", "percentile", "legacy"}
    with pytest.raises(AgentError):
        algorithm_name("kl")


def test_other_algorithm_is_a_mismatch_naming_both():
    cache = parse_cache(format_cache({"x": 1.0}, "minmax", "10.3.0"))
    with pytest.raises(AgentError) as err:
        check_compatible(cache, "entropy2")
    assert err.value.code == "calibration_cache_mismatch"
    assert "MinMaxCalibration" in err.value.message
    assert "EntropyCalibration2" in err.value.message


def test_other_tensorrt_version_is_a_mismatch_only_when_checked():
    cache = parse_cache(TRT86_CACHE)
    check_compatible(cache, "entropy2", None)  # the host accepts any version
    check_compatible(cache, "entropy2", "8.6.1")
    with pytest.raises(AgentError) as err:
        check_compatible(cache, "entropy2", "10.3.0")
    assert err.value.code == "calibration_cache_mismatch"
    assert "8601" in err.value.message and "100300" in err.value.message


@pytest.mark.parametrize("text,fragment", [
    ("", "empty"),
    ("calibration\nx: 3f800000\n", "header"),
    ("TRT-abc-EntropyCalibration2\nx: 3f800000\n", "header"),
    ("TRT-8601-EntropyCalibration2\n", "none"),
    ("TRT-8601-EntropyCalibration2\nx 3f800000\n", "line 2"),
    ("TRT-8601-EntropyCalibration2\nx: zzzz\n", "line 2"),
    ("TRT-8601-EntropyCalibration2\nx: 3f8000001\n", "line 2"),
    ("TRT-8601-EntropyCalibration2\nx: 7fc00000\n", "finite"),
    ("TRT-8601-EntropyCalibration2\nx: bf800000\n", ">= 0"),
    ("TRT-8601-EntropyCalibration2\nx: 3f800000\nx: 3f800000\n", "twice"),
])
def test_malformed_caches(text, fragment):
    with pytest.raises(AgentError) as err:
        parse_cache(text, "c.cache")
    assert err.value.code == "bad_calibration_cache"
    assert fragment in err.value.message and "c.cache" in err.value.message


def test_binary_file_and_missing_file(tmp_path):
    path = tmp_path / "engine.plan"
    path.write_bytes(b"\x00\xff\xfe" * 10)
    with pytest.raises(AgentError) as err:
        read_cache(str(path))
    assert err.value.code == "bad_calibration_cache" and "binary" in err.value.message
    with pytest.raises(AgentError) as err:
        read_cache(str(tmp_path / "missing.cache"))
    assert err.value.code == "file_not_found"


def test_refuses_to_write_non_finite_ranges(tmp_path):
    with pytest.raises(AgentError) as err:
        write_cache(str(tmp_path / "c"), {"x": float("inf")}, "entropy2")
    assert err.value.code == "bad_argument"
    assert not (tmp_path / "c").exists()


def test_crlf_and_missing_trailing_newline_are_accepted():
    cache = parse_cache("TRT-100300-MinMaxCalibration\r\nx: 3f800000\r\ny: 3f000000")
    assert cache.scales == {"x": 1.0, "y": 0.5}
