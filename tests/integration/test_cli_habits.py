"""What a Polygraphy / trtexec user types, through the real entry point (``python -m agent``):
no prefix matching, the subcommand's usage on a bad flag, ``-v`` anywhere, Polygraphy's
constraints default and short precision names, trtexec's bench loop and its report."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP16_MAX = os.path.join(ROOT, "examples", "fp16_max", "model.onnx")
DIGITS = os.path.join(ROOT, "examples", "digits", "model.onnx")


def cli(args, state, expect=0):
    env = dict(os.environ, JETSON_AGENT_STATE_DIR=str(state), PYTHONPATH=ROOT)
    env.pop("JOURNAL_STREAM", None)
    proc = subprocess.run([sys.executable, "-m", "agent"] + [str(a) for a in args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return proc


def test_no_prefix_matching_and_the_subcommands_usage(tmp_path):
    # `--precision fp16` must not be taken for --precision-constraints.
    proc = cli(["build", FP16_MAX, "--precision", "fp16"], tmp_path, expect=2)
    assert "usage: jetson-agent build" in proc.stderr
    assert "unrecognized arguments: --precision fp16" in proc.stderr
    proc = cli(["cache", "ls", "--bogus"], tmp_path, expect=2)
    assert "usage: jetson-agent cache" in proc.stderr and "--bogus" in proc.stderr
    proc = cli(["fleet", "devices", "--nope"], tmp_path, expect=2)
    assert "usage: jetson-agent fleet devices" in proc.stderr


def test_verbose_before_or_after_the_subcommand(tmp_path):
    for args in (["-v", "cache", "stats"], ["cache", "stats", "-v"], ["cache", "-vv", "stats"]):
        proc = cli(args, tmp_path)
        assert "engine cache" in proc.stdout, args


@pytest.mark.parametrize("command", ["build", "bench", "compare", "search"])
def test_one_constraints_default_stated_in_help(tmp_path, command):
    text = " ".join(cli([command, "--help"], tmp_path).stdout.split())
    assert "--precision-constraints" in text
    assert "(default: none, as in Polygraphy;" in text


def test_build_and_compare_build_the_same_engine_with_short_names(tmp_path):
    layers = ["--layer-precisions", "Add:fp32", "Sub:float32"]
    proc = cli(["build", FP16_MAX, "--fp16"] + layers + ["--json"], tmp_path)
    built = json.loads(proc.stdout)
    assert built["layer_precisions"]["Add"] == "float32"
    assert built["layer_precisions"]["Sub"] == "float32"
    assert "--precision-constraints obey" in proc.stderr  # the default is said out loud
    compared = json.loads(cli(["compare", FP16_MAX, "--fp16"] + layers + ["--json"],
                              tmp_path).stdout)
    assert compared["engine"]["key"] == built["key"] and compared["engine"]["cache_hit"]
    obeyed = json.loads(cli(["build", FP16_MAX, "--fp16"] + layers + [
        "--precision-constraints", "obey", "--json"], tmp_path).stdout)
    assert obeyed["key"] != built["key"]


def test_bench_text_says_emulated_and_follows_trtexec_defaults(tmp_path):
    text = " ".join(cli(["bench", "--help"], tmp_path).stdout.split())
    assert "--warm-up S" in text and "default 0.2" in text and "default 3" in text
    proc = cli(["bench", FP16_MAX, "--fp16", "--duration", "0.05", "--warm-up", "0.01"],
               tmp_path)
    assert "emulated" in proc.stdout.splitlines()[0]
    assert "=== Performance summary ===" in proc.stdout
    out = json.loads(cli(["bench", FP16_MAX, "--fp16", "--duration", "0.05", "--warm-up",
                          "0.01", "--json"], tmp_path).stdout)
    assert out["target"]["emulated"] is True
    b = out["benchmark"]
    assert b["wall_seconds"] >= 0.05 and b["warmup_seconds"] >= 0.01
    assert b["iterations"] >= 10 and "cov" in b["latency_ms"]
    assert isinstance(b["warnings"], list)


def test_bench_batch_is_honoured_or_refused(tmp_path):
    out = json.loads(cli(["bench", DIGITS, "--batch", "8", "--duration", "0", "--json"],
                         tmp_path).stdout)
    assert out["benchmark"]["batch"] == 8
    assert out["target"]["emulated"] is False  # fp32 on onnxruntime is the real thing
    proc = cli(["bench", FP16_MAX, "--batch", "8", "--duration", "0"], tmp_path, expect=2)
    assert ("--batch 8 cannot apply: no input has a dynamic leading dimension "
            "(x [1, 1, 4, 4])") in proc.stderr


def test_bench_builds_a_tensorrt_engine_for_the_batch_it_measures():
    # trtexec's --shapes=input:8x64: a profile of exactly the measured batch, unless given.
    from agent.cli.bench import batch_shapes

    assert batch_shapes(DIGITS, 8, []) == ["input:8x64"]
    assert batch_shapes(DIGITS, 8, ["input:1x64,8x64,32x64"]) == []
    assert batch_shapes(FP16_MAX, 8, []) == []  # static: nothing to choose
