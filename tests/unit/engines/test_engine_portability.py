"""Engine portability (issue 24 defects 3 and 8): what an engine depends on is in its cache key
and in the platform record beside it; an engine of another platform is refused by name; a DLA
engine adopted from the fleet keeps its core; the fleet's sharing class separates modules and
releases. TensorRT and pycuda are the version-faithful fakes (``tests/fake_trt.py``)."""

import os

import pytest

from agent.engines import share as engine_share
from agent.engines.backends import tensorrt as trt_backend
from agent.engines.backends import tensorrt_network
from agent.engines.backends.base import BuildPlan
from agent.engines.build import build_engine
from agent.engines.cache import EngineCache
from agent.engines.cache_key import FORMAT, cache_key, platform_mismatches
from agent.errors import AgentError
from agent.fleet.transfer.sharing import device_class
from agent.platform import for_row
from tests import fake_trt
from tests.trt_builds import save
from tests.unit.engines.test_engine_cache import PLATFORM


@pytest.fixture(autouse=True)
def _fresh_logger(monkeypatch):
    monkeypatch.setattr(tensorrt_network, "_LOGGER", None)


def _backend(monkeypatch, profile, sm_count=16, num_dla_cores=0):
    trt, cuda = fake_trt.install(monkeypatch, profile, num_dla_cores=num_dla_cores)
    cuda.sm_count = sm_count
    return trt_backend.TensorRTBackend(trt.__version__), trt, cuda


@pytest.mark.parametrize("profile", fake_trt.PROFILES)
def test_the_key_depends_on_the_sm_count_cuda_and_compatibility(monkeypatch, profile):
    """Defect 3: AGX Orin 32 GB (14 SMs) and 64 GB (16 SMs) computed the same key."""
    backend, _, cuda = _backend(monkeypatch, profile, sm_count=16)
    fp16 = backend.fingerprint()
    cuda.sm_count = 14
    fp14 = backend.fingerprint()
    assert fp16["sm_count"] == "16" and fp14["sm_count"] == "14"
    for field in ("cuda_runtime", "cuda_driver", "hardware_compatibility",
                  "version_compatible", "version", "device", "compute_capability"):
        assert fp16[field], field
    plan = BuildPlan(precision="fp16")
    assert cache_key("m" * 64, plan, None, fp16, PLATFORM) != \
        cache_key("m" * 64, plan, None, fp14, PLATFORM)
    assert FORMAT == 2  # format-1 entries are rebuilt on first use (docs/tensorrt.md)


@pytest.mark.parametrize("profile", ["8.2", "10.3", "11.x"])
def test_an_engine_of_another_platform_is_refused_by_name(monkeypatch, tmp_path, profile):
    backend, _, cuda = _backend(monkeypatch, profile, sm_count=16)
    engine = str(tmp_path / "e.engine")
    backend.build(save(fake_trt_model(), tmp_path), BuildPlan(precision="fp32"), engine)
    assert os.path.isfile(engine + ".platform.json")
    backend.open(engine).close()
    cuda.sm_count = 14
    with pytest.raises(AgentError) as err:
        backend.open(engine)
    assert err.value.code == "engine_platform_mismatch"
    assert "sm_count: expected 14 (this device), found 16 (the engine's)" in str(err.value)
    assert err.value.details["mismatches"] == [
        {"field": "sm_count", "expected": "14", "found": "16"}]


def fake_trt_model():
    from tests.models import fp16_max_model

    return fp16_max_model()


def test_platform_mismatches_rules():
    here = {"tensorrt": "10.3.0", "gpu": "Orin", "compute_capability": "8.7", "sm_count": "16",
            "cuda_runtime": "12.6", "cuda_driver": "12.6", "dla_cores": "2",
            "hardware_compatibility": "none", "version_compatible": "false"}
    assert platform_mismatches(dict(here, dla_core="1"), here) == []
    assert platform_mismatches(dict(here, cuda_driver="12.2"), here) == []  # older driver
    assert [m[0] for m in platform_mismatches(dict(here, cuda_driver="12.8"), here)] == \
        ["cuda_driver"]
    assert [m[0] for m in platform_mismatches(dict(here, dla_core="2"), here)] == ["dla_core"]
    assert [m[0] for m in platform_mismatches(dict(here, tensorrt="10.3.1"), here)] == \
        ["tensorrt"]
    ampere_plus = dict(here, gpu="A100", compute_capability="8.0", sm_count="108",
                       hardware_compatibility="ampere_plus")
    assert platform_mismatches(ampere_plus, here) == []
    compatible = dict(here, tensorrt="10.1.0", version_compatible="true")
    assert platform_mismatches(compatible, here) == []


def _dla_build(monkeypatch, tmp_path, name, profile, num_dla_cores):
    backend, trt, _ = _backend(monkeypatch, profile, num_dla_cores=num_dla_cores)
    cache = EngineCache(str(tmp_path / name / "engines"))
    return backend, trt, cache


@pytest.mark.parametrize("profile", ["8.5", "10.3"])
def test_a_dla_engine_adopted_from_the_fleet_runs_on_its_core(monkeypatch, tmp_path, profile):
    """Defect 8: the container carried the engine bytes only, so the adopter's entry had no
    ``.dla-core`` and the engine opened on the runtime's default core."""
    model = save(fake_trt_model(), tmp_path)
    plan = BuildPlan(precision="fp16", dla_core=1)
    backend, trt, cache = _dla_build(monkeypatch, tmp_path, "builder", profile, 2)
    built = build_engine(model, plan, backend, cache, PLATFORM)
    container = str(tmp_path / "engine.share")
    engine_share.write_container(container, built.key, built.engine_path,
                                 dict(cache.get(built.key).meta), "builder")

    backend, trt, cache = _dla_build(monkeypatch, tmp_path, "adopter", profile, 2)
    shared = {"container": container}
    got = build_engine(model, plan, backend, cache, PLATFORM, shared=shared)
    assert shared["adopted"], shared
    assert got.key == built.key and not trt._driver.builds
    assert tensorrt_network.read_dla_core(got.engine_path) == 1
    with backend.open(got.engine_path):
        assert trt._driver.runtimes[-1].DLA_core == 1


def test_a_dla_engine_for_a_core_the_adopter_lacks_is_refused_by_name(monkeypatch, tmp_path):
    """Adopting skipped the DLA-core check a local build makes (Orin NX 8 GB has one DLA)."""
    model = save(fake_trt_model(), tmp_path)
    plan = BuildPlan(precision="fp16", dla_core=1)
    backend, _, cache = _dla_build(monkeypatch, tmp_path, "builder", "8.5", 2)
    built = build_engine(model, plan, backend, cache, PLATFORM)
    container = str(tmp_path / "engine.share")
    engine_share.write_container(container, built.key, built.engine_path,
                                 dict(cache.get(built.key).meta), "builder")
    backend, _, cache = _dla_build(monkeypatch, tmp_path, "adopter", "8.5", 1)
    entry, why = engine_share.adopt(container, built.key, cache, backend)
    assert entry is None
    assert "[engine_platform_mismatch]" in why and "dla_core" in why


def _status(row, module, tensorrt="10.3.0", engine_class=True):
    info = for_row(row)
    info.module, info.jetpack, info.tensorrt, info.cuda = module, "6.2", tensorrt, "12.6"
    platform = {"board": info.board, "jetpack": info.jetpack, "tensorrt": info.tensorrt,
                "backend": "tensorrt"}
    if engine_class:
        platform["engine_class"] = info.engine_class("tensorrt")
    return {"platform": platform}


def test_the_sharing_class_separates_modules_and_releases():
    """Defect 3: the class was board | JetPack | TensorRT | backend, so AGX Orin 32 GB and
    64 GB, Orin NX 8 GB (1 DLA) and 16 GB (2) shared engines."""
    assert device_class(_status("agx-orin", "Jetson AGX Orin 32GB")) != \
        device_class(_status("agx-orin", "Jetson AGX Orin 64GB"))
    nx8, nx16 = _status("orin-nx", "Jetson Orin NX 8GB"), _status("orin-nx", "Jetson Orin NX 16GB")
    nx8["platform"]["engine_class"]["dla_cores"] = "1"
    assert device_class(nx8) != device_class(nx16)
    assert device_class(_status("agx-orin", "Jetson AGX Orin 64GB")) == \
        device_class(_status("agx-orin", "Jetson AGX Orin 64GB"))
    old = device_class(_status("agx-orin", "Jetson AGX Orin 64GB", engine_class=False))
    new = device_class(_status("agx-orin", "Jetson AGX Orin 64GB"))
    assert old.startswith("v1|") and new.startswith("v2|") and old != new


def test_compatibility_settings_relax_only_what_tensorrt_allows_and_cuda_minors_pass():
    """Issue 34: an ampere_plus engine needs an Ampere+ GPU here; neither setting covers a DLA
    engine, nor version compatibility before 8.6; a CUDA runtime of another minor version of
    the same major runs the engine (CUDA minor version compatibility), another major does
    not."""
    here = {"tensorrt": "10.3.0", "gpu": "Orin", "compute_capability": "8.7", "sm_count": "16",
            "cuda_runtime": "12.6", "cuda_driver": "12.6", "dla_cores": "2",
            "hardware_compatibility": "none", "version_compatible": "false"}
    volta = dict(here, gpu="Xavier", compute_capability="7.2", sm_count="8")
    ampere_plus = dict(here, gpu="A100", compute_capability="8.0", sm_count="108",
                       hardware_compatibility="ampere_plus")
    assert [m[0] for m in platform_mismatches(ampere_plus, volta)] == [
        "gpu", "compute_capability", "sm_count"]
    dla_plus = dict(ampere_plus, dla_core="0")
    assert [m[0] for m in platform_mismatches(dla_plus, here)] == [
        "gpu", "compute_capability", "sm_count"]
    dla_compatible = dict(here, tensorrt="10.1.0", version_compatible="true", dla_core="0")
    assert [m[0] for m in platform_mismatches(dla_compatible, here)] == ["tensorrt"]
    old = dict(here, tensorrt="8.5.2", version_compatible="true")
    assert [m[0] for m in platform_mismatches(old, dict(here, tensorrt="8.6.1"))] == [
        "tensorrt"]
    assert platform_mismatches(dict(here, cuda_runtime="12.2"), here) == []
    assert platform_mismatches(dict(here, cuda_runtime="12.8"), here) == []
    assert [m[0] for m in platform_mismatches(dict(here, cuda_runtime="11.4"), here)] == [
        "cuda_runtime"]
