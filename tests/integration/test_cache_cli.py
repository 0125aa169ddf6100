"""``jetson-agent cache`` as an operator uses it, through the real entry point: the daemon's
cache found from its config, nothing created by looking, the budget shown, real model names."""

import json
import os
import subprocess
import sys

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


def test_looking_at_a_missing_cache_creates_nothing(tmp_path):
    missing = tmp_path / "typo" / "state"
    for action in ("ls", "stats", "verify"):
        proc = cli("cache", action, "--state-dir", missing)
        assert "no engine cache at {}".format(missing / "engines") in proc.stdout
    out = json.loads(cli("cache", "ls", "--state-dir", missing, "--json").stdout)
    assert out == {"root": str(missing / "engines"), "entries": [], "exists": False}
    assert not (tmp_path / "typo").exists()


def test_the_daemons_cache_from_its_config_with_budget_and_names(tmp_path):
    cache_dir = tmp_path / "daemon-cache"
    cli("build", DIGITS, "--state-dir", cache_dir, "--json")
    cli("build", FP16_MAX, "--fp16", "--state-dir", cache_dir, "--json")
    config = tmp_path / "agent.yaml"
    config.write_text("device_id: d1\nstate_dir: {}\ncache:\n  dir: {}\n"
                      "  engine_budget_bytes: 1GiB\n".format(tmp_path / "state", cache_dir))
    text = cli("cache", "ls", "--config", config).stdout
    assert text.startswith("2 entries") and str(cache_dir / "engines") in text
    assert "digits/model.onnx" in text and "fp16_max/model.onnx" in text
    stats = cli("cache", "stats", "--config", config).stdout
    assert stats.startswith("2 entries") and "% of budget 1.0 GiB)" in stats
    out = json.loads(cli("cache", "stats", "--config", config, "--json").stdout)
    assert out["entries"] == 2 and out["budget_bytes"] == 1 << 30
    proc = cli("cache", "ls", "--config", config, "--state-dir", tmp_path, expect=2)
    assert "not allowed with argument" in proc.stderr and "usage: jetson-agent cache" in proc.stderr


def test_a_jobs_model_keeps_its_name_in_the_cache(tmp_path):
    # The daemon's worker stages every model as model.onnx and passes the artifact's name.
    from agent.engines.backends.base import BuildPlan
    from agent.engines.backends.onnxruntime import create
    from agent.engines.build import build_engine
    from agent.engines.cache import EngineCache

    cache = EngineCache(str(tmp_path / "engines"))
    record = build_engine(FP16_MAX, BuildPlan(precision="fp32"), create(), cache,
                          {"kind": "host"}, model_label="resnet50-v2\x1b[31m.onnx")
    (entry,) = cache.ls()
    assert entry.key == record.key and entry.to_dict()["model_label"] == "resnet50-v2?[31m.onnx"
