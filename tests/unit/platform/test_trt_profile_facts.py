"""The version profiles' enum values: the extractor (scripts/lib/trt_profile_facts.py) that reads
them from NVIDIA's headers, and a cross-check against a second source (tensorrt-stubs 10.13)."""

import importlib.util
import json
import os

import pytest

from tests.fake_trt import PROFILE_DIR, PROFILES, load_profile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
CROSSCHECK = os.path.join(PROFILE_DIR, "crosscheck", "tensorrt-stubs-10.13.0.35.1.json")


def _facts_module():
    path = os.path.join(ROOT, "scripts", "lib", "trt_profile_facts.py")
    spec = importlib.util.spec_from_file_location("trt_profile_facts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# NvInfer.h at v10.3.0 / v10.13.3 (BuilderFlag), trimmed.
HEADER = """
enum class BuilderFlag : int32_t
{
    kFP16 = 0,
    kINT8 = 1,
    kSTRIP_PLAN = 19,

    //! \\deprecated Deprecated in TensorRT 10.0. Superseded by kSTRIP_PLAN.
    kWEIGHTLESS TRT_DEPRECATED_ENUM = kSTRIP_PLAN,

    kREFIT_IDENTICAL = 20,
    kWEIGHT_STREAMING = 21,
    kNEXT,
};
"""


def test_an_alias_takes_the_value_of_the_member_it_names():
    """Issue 24 defect 10: ``kWEIGHTLESS = kSTRIP_PLAN`` was read as the previous value + 1."""
    members = _facts_module().enum_members([HEADER], "BuilderFlag")
    assert members["WEIGHTLESS"] == members["STRIP_PLAN"] == 19
    assert members["REFIT_IDENTICAL"] == 20 and members["NEXT"] == 22


def test_an_initializer_it_cannot_read_is_an_error_not_a_guess():
    text = HEADER.replace("= kSTRIP_PLAN", "= kSTRIP_PLAN | 1")
    with pytest.raises(ValueError, match="kSTRIP_PLAN | 1"):
        _facts_module().enum_members([text], "BuilderFlag")


@pytest.mark.parametrize("name", PROFILES)
def test_deprecated_aliases_in_the_profiles_equal_their_targets(name):
    flags = load_profile(name)["builder_flags"]
    if "WEIGHTLESS" in flags:
        assert flags["WEIGHTLESS"] == flags["STRIP_PLAN"]


def test_profile_enums_match_a_second_source():
    """The 10.13 profile (from the v10.13.3 headers) against tensorrt-stubs 10.13.0.35.1, whose
    ``__members__`` lines pybind11-stubgen wrote from a real build of the bindings."""
    with open(CROSSCHECK) as f:
        stubs = json.load(f)
    profile = load_profile("10.13")
    for enum, key in _facts_module().PROFILE_KEYS.items():
        assert profile[key] == stubs[enum], enum


def test_the_recorded_second_source_is_what_the_stubs_say():
    """Re-read the stubs when scripts/lib/trt_stubs.py has prepared them (./scripts/test does)."""
    pyi = os.path.join(ROOT, ".stubs", "tensorrt_bindings", "tensorrt.pyi")
    if not os.path.exists(pyi):
        pytest.skip("no .stubs: run python scripts/lib/trt_stubs.py .stubs")
    with open(pyi) as f, open(CROSSCHECK) as g:
        assert _facts_module().stub_enums(f.read()) == json.load(g)


def test_profiles_are_what_the_headers_say():
    """With a clone of NVIDIA/TensorRT in $TENSORRT_CHECKOUT, every profile's enums are
    regenerated and compared (how they were made: ``--update``)."""
    repo = os.environ.get("TENSORRT_CHECKOUT")
    if not repo:
        pytest.skip("set TENSORRT_CHECKOUT to a clone of github.com/NVIDIA/TensorRT")
    facts = _facts_module()
    for name in PROFILES:
        profile = load_profile(name)
        found = facts.facts(repo, profile["headers_tag"])
        for enum, key in facts.PROFILE_KEYS.items():
            assert profile[key] == found[enum], (name, enum)


def _vt(text):
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def _within(version, spec):
    """``spec`` is ``A`` or ``A-B`` (prefixes, ``32.7.x``): is ``version`` inside it?"""
    lo, _, hi = spec.partition("-")
    lo, hi = _vt(lo), _vt(hi or lo)
    return lo <= version[:len(lo)] and version[:len(hi)] <= hi


@pytest.mark.parametrize("name", PROFILES)
def test_profile_jetpack_and_l4t_agree_with_the_matrix(name):
    """Issue 24 defect 11: the 11.x profile called L4T 38.4 "JetPack 7.2" (38.4 is 7.1)."""
    import re

    from agent.platform.matrix import load_matrix

    profile = load_profile(name)
    m = re.match(r"^([\d.\-x]+) \(L4T ([\d.\-x]+)[,)]", profile["jetpack"])
    if not m:
        assert profile["jetpack"].startswith("none"), profile["jetpack"]
        return
    jetpacks, l4ts = m.group(1), m.group(2)
    releases = [r for r in load_matrix().releases if _within(_vt(r["l4t"]), l4ts)]
    assert releases, "no L4T {} in the matrix".format(l4ts)
    trt = _vt(profile["version"])[:2]
    for release in releases:
        assert _within(_vt(release["jetpack"]), jetpacks), (release, profile["jetpack"])
        if release.get("tensorrt"):
            assert _vt(release["tensorrt"])[:2] == trt, (release, profile["version"])
