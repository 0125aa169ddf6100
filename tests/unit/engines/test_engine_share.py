"""The device side of fleet engine sharing with the real onnxruntime backend: an INT8 engine
built on one "device" (its own cache and calibration directory) is adopted by another through
the container, calibration cache included; a container for another key, a tampered one and a
malformed one make the device build, each with its reason."""

import os

import pytest

from agent.engines import share as engine_share
from agent.engines.build import build_engine
from agent.engines.cache import EngineCache
from tests.unit.engines.test_build_engine import CountingBackend, _int8, digits  # noqa: F401
from tests.unit.engines.test_engine_cache import PLATFORM


def device(tmp_path, name):
    root = tmp_path / name
    return CountingBackend(), EngineCache(str(root / "engines")), str(root / "calibration")


def offered(tmp_path, model, calib):
    backend, cache, cal_dir = device(tmp_path, "builder")
    built = build_engine(model, _int8(calib), backend, cache, PLATFORM, calibration_dir=cal_dir)
    assert built.result["calibrated"]
    path = str(tmp_path / "engine.share")
    engine_share.write_container(path, built.key, built.engine_path,
                                 dict(cache.get(built.key).meta), "builder",
                                 built.result["calibration_cache"])
    return built, path


def test_an_int8_engine_is_adopted_with_its_calibration_cache(tmp_path, digits):  # noqa: F811
    model, calib = digits
    built, container = offered(tmp_path, model, calib)
    backend, cache, cal_dir = device(tmp_path, "adopter")
    shared = {"container": container}
    got = build_engine(model, _int8(calib), backend, cache, PLATFORM, calibration_dir=cal_dir,
                       shared=shared)
    assert shared == {"container": container, "adopted": True, "reason": ""}
    assert got.key == built.key and got.result["shared"] and backend.builds == 0
    assert cache.get(got.key).meta["shared_from"] == "builder"
    assert len(os.listdir(cal_dir)) == 1  # the builder's calibration cache, now this device's


@pytest.mark.parametrize("damage, reason", [
    ("garbage", "does not load here"),
    ("other_key", "this device needs"),
    ("truncated", "parts of"),
])
def test_a_bad_shared_engine_means_a_local_build(tmp_path, digits, damage, reason):  # noqa: F811
    model, calib = digits
    built, container = offered(tmp_path, model, calib)
    if damage == "garbage":
        junk = tmp_path / "junk"
        junk.write_bytes(b"no engine" * 100)
        engine_share.write_container(container, built.key, str(junk), {}, "evil",
                                     built.result["calibration_cache"])
    elif damage == "other_key":
        engine_share.write_container(container, "f" * 64, built.engine_path, {}, "evil")
    else:
        with open(container, "r+b") as f:
            f.truncate(os.path.getsize(container) - 10)
    backend, cache, cal_dir = device(tmp_path, "adopter")
    shared = {"container": container}
    got = build_engine(model, _int8(calib), backend, cache, PLATFORM, calibration_dir=cal_dir,
                       shared=shared)
    assert not shared["adopted"] and reason in shared["reason"], shared
    assert backend.builds == 1 and not got.result.get("shared")
    assert got.result["calibrated"]  # calibrated itself: nothing of the bad container kept
