"""The issue's case through the real entry point: a device holds two active names and a
rollback target in its models directory; an unrelated ``build --cache-budget 20KiB`` evicts none
of them (and says they alone exceed the budget), ``cache purge --all`` keeps them and says who
uses each, ``--force`` removes them with a warning, and ``diag`` reports a missing or corrupt
deployed engine with its fix."""

import json
import os
import subprocess
import sys

import pytest

from tests.models_dir import add_version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIGITS = os.path.join(ROOT, "examples", "digits", "model.onnx")
FP16_MAX = os.path.join(ROOT, "examples", "fp16_max", "model.onnx")


def cli(*args, expect=0):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("JETSON_AGENT_STATE_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "agent"] + [str(a) for a in args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return proc


def build(state, *extra):
    return json.loads(cli("build", *extra, "--state-dir", state, "--json").stdout)


@pytest.fixture
def device(tmp_path):
    """detector v1 (the rollback target, a copy as across file systems) and v2 (current, a
    hard link), tiny a1 (current, a hard link), and one engine nothing uses."""
    state = tmp_path / "state"
    v1 = build(state, DIGITS)
    v2 = build(state, DIGITS, "--fp16")
    tiny = build(state, FP16_MAX)
    unused = build(state, DIGITS, "--fp16", "--precision-constraints", "obey")
    models = state / "models"
    add_version(models, "detector", "v1", v1["engine"], v1["key"], link=False)
    add_version(models, "detector", "v2", v2["engine"], v2["key"], current=True)
    add_version(models, "tiny", "a1", tiny["engine"], tiny["key"], current=True)
    return state, models, {"v1": v1["key"], "v2": v2["key"], "tiny": tiny["key"],
                           "unused": unused["key"]}


def keys_in(state):
    out = json.loads(cli("cache", "ls", "--state-dir", state, "--json").stdout)
    return {e["key"]: e["in_use_by"] for e in out["entries"]}


def test_a_small_budget_never_evicts_the_engines_of_the_models_directory(device):
    state, _models, keys = device
    proc = cli("build", FP16_MAX, "--fp16", "--cache-budget", "20KiB", "--state-dir", state,
               "--json")
    out = json.loads(proc.stdout)
    held = keys_in(state)
    assert set(held) == {keys["v1"], keys["v2"], keys["tiny"], out["key"]}
    assert held[keys["v1"]] == ["detector@v1 (kept)"]
    assert held[keys["v2"]] == ["detector@v2 (current)"]
    assert held[keys["tiny"]] == ["tiny@a1 (current)"]
    budget = out["cache_budget"]
    assert budget["evicted"] == [keys["unused"]] and budget["protected_over_budget"]
    assert budget["budget_bytes"] == 20 * 1024 and budget["protected_bytes"] > 20 * 1024
    assert "alone take" in proc.stderr and "detector@v2 (current)" in proc.stderr
    stats = cli("cache", "stats", "--state-dir", state).stdout
    assert "3 in use by the models directory" in stats and "more than the budget" not in stats


def test_purge_all_keeps_them_and_says_why_force_removes_them(device):
    state, models, keys = device
    text = cli("cache", "purge", "--all", "--state-dir", state).stdout
    assert text.startswith("removed 1 entries")
    assert "kept {} ".format(keys["v2"][:16]) in text
    assert "used by detector@v2 (current)" in text and "used by detector@v1 (kept)" in text
    assert "used by tiny@a1 (current)" in text and "--force" in text
    assert set(keys_in(state)) == {keys["v1"], keys["v2"], keys["tiny"]}
    out = json.loads(cli("cache", "purge", "--all", "--state-dir", state, "--json").stdout)
    assert out["removed"] == [] and len(out["kept_protected"]) == 3
    proc = cli("cache", "purge", "--key", keys["tiny"][:12], "--force", "--state-dir", state)
    assert "warning: removed {} although tiny@a1 (current) uses it".format(
        keys["tiny"][:16]) in proc.stdout
    proc = cli("cache", "purge", "--all", "--force", "--state-dir", state, "--json")
    assert len(json.loads(proc.stdout)["forced_protected"]) == 2
    assert "detector@v2 (current)" in proc.stderr
    assert keys_in(state) == {}
    # The deployed engines themselves survive the cache (link or copy): still whole.
    report = json.loads(cli("diag", "--no-jtop", "--models-dir", models, "--verify",
                            "--json").stdout)
    assert [p for p in report["problems"] if p["source"] == "models"] == []
    proc = cli("cache", "stats", "--force", "--state-dir", state, expect=2)
    assert "go with 'purge'" in proc.stderr


def test_diag_reports_a_missing_or_corrupt_deployed_engine_with_its_fix(device):
    _state, models, _keys = device
    os.unlink(str(models / "tiny" / "a1" / "model.engine"))
    engine = str(models / "detector" / "v1" / "model.engine")
    with open(engine, "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")  # same size, other bytes: only --verify sees it
    report = json.loads(cli("diag", "--no-jtop", "--models-dir", models, "--json").stdout)
    found = [(p["code"], p["fix"]) for p in report["problems"] if p["source"] == "models"]
    assert [c for c, _ in found] == ["engine_missing"]
    assert "jetson-agent models rollback tiny" in found[0][1]
    assert report["models"]["dir"] == str(models) and not report["ok"]
    text = cli("diag", "--no-jtop", "--models-dir", models, "--verify").stdout
    assert "[engine_missing]" in text and "[engine_sha256_mismatch]" in text
    assert "fix: the engine's bytes changed on disk: deploy detector@v1 again" in text


def test_a_corrupt_engine_in_use_is_named_by_cache_verify_and_diag(device):
    state, models, keys = device
    with open(str(models / "detector" / "v2" / "model.engine"), "r+b") as f:
        f.truncate(1000)  # a hard link: the cache entry is the same file
    text = cli("cache", "verify", "--state-dir", state, expect=1).stdout
    assert "corrupt {}".format(keys["v2"][:16]) in text
    assert "used by detector@v2 (current): deploy it again" in text
    report = json.loads(cli("diag", "--no-jtop", "--models-dir", models, "--json").stdout)
    (bad,) = [p for p in report["problems"] if p["source"] == "models"]
    assert bad["code"] == "engine_size_mismatch" and "detector@v2 has 1000 bytes" in bad["problem"]
