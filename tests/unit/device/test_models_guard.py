"""The models directory's protection set and health problems (agent.device.models.guard):
what the cache must keep, and each problem with its stable code and fix."""

import json
import os

import pytest

from agent.device.models import guard as models_guard
from tests.models_dir import add_version, set_current

KEY1, KEY2, KEY3 = ("{:064x}".format(i) for i in (1, 2, 3))


@pytest.fixture
def models(tmp_path):
    """detector: v1 (kept, a copy) and v2 (current, a link); tiny: a1 (current)."""
    src = tmp_path / "src"
    src.mkdir()
    for i, size in ((1, 300), (2, 400), (3, 50)):
        (src / "e{}".format(i)).write_bytes(bytes([i]) * size)
    root = tmp_path / "models"
    add_version(root, "detector", "v1", str(src / "e1"), KEY1, link=False)
    add_version(root, "detector", "v2", str(src / "e2"), KEY2, current=True)
    add_version(root, "tiny", "a1", str(src / "e3"), KEY3, current=True)
    return root


def codes(problems):
    return sorted((p["code"], p["name"], p["version"]) for p in problems)


def test_every_version_protects_its_engine_and_names_its_user(models):
    assert models_guard.protected_engine_keys(str(models)) == {KEY1, KEY2, KEY3}
    assert models_guard.protected_engines(str(models)) == {
        KEY1: ["detector@v1 (kept)"], KEY2: ["detector@v2 (current)"],
        KEY3: ["tiny@a1 (current)"]}
    # a version the daemon is still assembling (dot-named) is protected too
    add_version(models, "detector", ".v3.tmp", str(models / "tiny" / "a1" / "model.engine"),
                "f" * 64)
    assert "f" * 64 in models_guard.protected_engine_keys(str(models))
    assert models_guard.check_models(str(models)) == []  # ... but not checked


def test_no_models_directory_is_nothing_to_protect_and_no_problem(tmp_path):
    assert models_guard.protected_engine_keys(str(tmp_path / "none")) == set()
    assert models_guard.check_models(str(tmp_path / "none")) == []
    assert models_guard.protection(None)() == {}


def test_a_whole_directory_has_no_problem_even_verified(models):
    assert models_guard.check_models(str(models)) == []
    assert models_guard.check_models(str(models), verify=True) == []
    assert models_guard.health([], "detector", "v2") == "ok"


def test_missing_and_truncated_engines_are_problems_with_fixes(models):
    os.unlink(str(models / "detector" / "v2" / "model.engine"))
    with open(str(models / "tiny" / "a1" / "model.engine"), "r+b") as f:
        f.truncate(10)
    problems = models_guard.check_models(str(models))
    assert codes(problems) == [("engine_missing", "detector", "v2"),
                               ("engine_size_mismatch", "tiny", "a1")]
    missing, short = problems
    assert missing["current"] and "does not exist" in missing["problem"]
    assert "jetson-agent models rollback detector" in missing["fix"]
    assert "has 10 bytes, expected 50" in short["problem"]
    assert "deploy tiny@a1 again" in short["fix"]
    health = models_guard.health(problems, "detector", "v2")
    assert health.startswith("the engine of detector@v2") and "[engine_missing]" in health
    assert models_guard.health(problems, "detector", "v1") == "ok"


def test_same_size_other_bytes_only_with_verify(models):
    engine = str(models / "detector" / "v1" / "model.engine")
    with open(engine, "r+b") as f:
        f.write(b"\xff")
    assert models_guard.check_models(str(models)) == []  # cheap: sizes only
    (bad,) = models_guard.check_models(str(models), verify=True)
    assert bad["code"] == "engine_sha256_mismatch" and bad["version"] == "v1"
    assert not bad["current"] and "meta.json's engine_sha256" in bad["problem"]


def test_current_link_problems(models):
    link = str(models / "detector" / "current")
    os.unlink(link)
    assert codes(models_guard.check_models(str(models))) == [
        ("current_missing", "detector", "")]
    set_current(models, "detector", "v9")
    (dangling,) = models_guard.check_models(str(models))
    assert dangling["code"] == "current_dangling" and "'v9'" in dangling["problem"]
    assert models_guard.health([dangling], "detector", "v9").endswith("[current_dangling]")
    os.unlink(link)
    with open(link, "w") as f:
        f.write("v2")
    assert codes(models_guard.check_models(str(models))) == [
        ("current_not_link", "detector", "")]
    os.unlink(link)
    os.symlink("../tiny/a1", link)  # out of its name's directory
    assert codes(models_guard.check_models(str(models)))[0][0] == "current_dangling"


def test_unreadable_or_oversized_meta_is_a_problem_and_protects_nothing(models, monkeypatch):
    (models / "detector" / "v1" / "meta.json").write_text("{not json")
    problems = []
    protected = models_guard.protected_engines(str(models), problems)
    assert KEY1 not in protected and KEY2 in protected
    assert codes(problems) == [("meta_unreadable", "detector", "v1")]
    assert codes(models_guard.check_models(str(models))) == [
        ("meta_unreadable", "detector", "v1")]
    monkeypatch.setattr(models_guard, "MAX_META_BYTES", 100)
    found = codes(models_guard.check_models(str(models)))
    assert ("meta_unreadable", "tiny", "a1") in found
    text = models_guard.check_models(str(models))[0]["problem"]
    assert "expected at most 100" in text or "unreadable" in text


def test_bounded_number_of_version_directories(models, monkeypatch):
    monkeypatch.setattr(models_guard, "MAX_VERSION_DIRS", 2)
    problems = []
    assert len(models_guard.protected_engines(str(models), problems)) == 2
    assert problems[-1]["code"] == "models_too_many"
    assert "models_too_many" in [p["code"] for p in models_guard.check_models(str(models))]


def test_meta_is_parsed_once_per_file_identity(models, monkeypatch):
    models_guard.protected_engine_keys(str(models))
    meta = models / "tiny" / "a1" / "meta.json"
    doc = json.loads(meta.read_text())
    doc["job_id"] = "j-other-and-longer"
    loads = []
    real = json.loads
    monkeypatch.setattr(models_guard.json, "loads", lambda s: loads.append(1) or real(s))
    models_guard.check_models(str(models))
    assert loads == []  # nothing changed: remembered
    meta.write_text(json.dumps(doc))
    models_guard.check_models(str(models))
    assert loads == [1]
