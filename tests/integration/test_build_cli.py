"""``jetson-agent build / bench / cache`` end to end: real processes, real onnxruntime, real
models (the seeds' FP16_MAX example and an MLP trained on scikit-learn's digits)."""

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

from agent.engines.backends.onnxruntime import create as create_ort
from tests import models

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(args, state, expect=0):
    env = dict(os.environ, JETSON_AGENT_STATE_DIR=str(state), PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "agent"] + [str(a) for a in args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return proc


def cli_json(args, state, expect=0):
    proc = cli(list(args) + ["--json"], state, expect)
    return json.loads(proc.stdout)


def run_engine(path, feeds):
    with create_ort().open(path) as runner:
        return runner.infer(feeds)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("build_cli")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        digits, (x_train, _, x_test, y_test) = models.digits_classifier(hidden=(32,))
    calib = root / "calib"
    calib.mkdir()
    np.save(str(calib / "input.npy"), x_train[:256])
    return {
        "root": root,
        "fp16max": models.save(models.fp16_max_model(), root / "fp16max.onnx"),
        "digits": models.save(digits, root / "digits.onnx"),
        "calib": str(calib),
        "x_test": x_test,
        "y_test": y_test,
    }


def test_fp16_max_needs_add_and_sub_in_fp32(work, tmp_path):
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    plain = cli_json(["build", work["fp16max"], "--fp16"], tmp_path)
    assert plain["precision"] == "fp16" and not plain["cache_hit"]
    wrong = run_engine(plain["engine"], {"x": x})["y"]
    assert not np.allclose(wrong, x, atol=1e-3)  # x + 65504 overflows in fp16
    fixed = cli_json(["build", work["fp16max"], "--fp16", "--layer-precisions", "Add:float32",
                      "Sub:float32"], tmp_path)
    assert fixed["layer_precisions"]["Add"] == "float32"
    assert fixed["layer_precisions"]["MatMul_0"] == "float16"
    assert fixed["mismatches"] == []
    right = run_engine(fixed["engine"], {"x": x})["y"]
    assert np.allclose(right, x, atol=1e-3)
    assert fixed["engine"] != plain["engine"]


def test_digits_int8_calibrates_once(work, tmp_path):
    args = ["build", work["digits"], "--int8", "--calib", work["calib"],
            "--calib-batch-size", "32"]
    first = cli_json(args, tmp_path)
    assert not first["cache_hit"] and first["calibrated"] and first["precision"] == "int8"
    assert first["decision"]["status"] == "accepted"
    cal_cache = first["calibration_cache"]
    assert os.path.isfile(cal_cache) and cal_cache.startswith(str(tmp_path))
    with open(cal_cache) as f:
        assert f.readline().startswith("TRT-")

    second = cli_json(args, tmp_path)
    assert second["cache_hit"] and not second["calibrated"]
    assert second["engine"] == first["engine"] and second["key"] == first["key"]

    other = cli_json(args + ["--layer-precisions", "fc0:float32"], tmp_path)
    assert not other["cache_hit"] and not other["calibrated"]
    assert other["calibration_cache"] == cal_cache
    assert other["layer_precisions"]["fc0"] == "float32"

    # the int8 engine still classifies the held-out digits
    logits = run_engine(first["engine"], {"input": work["x_test"]})["logits"]
    accuracy = float(np.mean(np.argmax(logits, axis=1) == work["y_test"]))
    assert accuracy > 0.85

    # an explicit calibration cache is read by the next build (no calibration)
    explicit = cli_json(["build", work["digits"], "--int8", "--calibration-cache", cal_cache,
                         "--layer-precisions", "fc_out:float32"], tmp_path)
    assert not explicit["calibrated"] and explicit["calibration_cache"] == cal_cache


def test_human_output_and_progress_lines(work, tmp_path):
    proc = cli(["build", work["digits"], "--int8", "--calib", work["calib"]], tmp_path)
    assert "cache:       miss" in proc.stdout
    assert "calibrated now" in proc.stdout
    assert "calibrating:" in proc.stderr  # plain progress lines when not a terminal
    again = cli(["build", work["digits"], "--int8", "--calib", work["calib"]], tmp_path)
    assert "cache:       hit" in again.stdout and again.stderr.strip() == ""


def test_bench_model_and_cached_engine(work, tmp_path):
    out = cli_json(["bench", work["digits"], "--batch", "16", "--iterations", "30",
                    "--warm-up", "0.01", "--duration", "0"], tmp_path)
    bench = out["benchmark"]
    assert bench["iterations"] == 30 and bench["batch"] == 16
    lat = bench["latency_ms"]
    assert 0 < lat["min"] <= lat["median"] <= lat["p90"] <= lat["p99"] <= lat["max"]
    assert bench["throughput"]["samples_per_second"] == pytest.approx(
        16 * bench["throughput"]["inferences_per_second"], rel=1e-3)
    engine = out["target"]["engine"]
    text = cli(["bench", engine, "--iterations", "20", "--duration", "0"], tmp_path).stdout
    assert "=== Performance summary ===" in text and "percentile(99%)" in text
    assert "Throughput:" in text
    # fp32 on onnxruntime is real fp32 (test_cli_habits checks the "emulated" marker).
    assert "onnxruntime, fp32" in text.splitlines()[0]


def test_cache_ls_verify_purge(work, tmp_path):
    a = cli_json(["build", work["fp16max"], "--fp16"], tmp_path)
    b = cli_json(["build", work["fp16max"]], tmp_path)
    listed = cli_json(["cache", "ls"], tmp_path)
    assert {e["key"] for e in listed["entries"]} == {a["key"], b["key"]}
    assert "fp16max.onnx" in cli(["cache", "ls"], tmp_path).stdout
    with open(a["engine"], "ab") as f:
        f.write(b"garbage")
    report = cli_json(["cache", "verify"], tmp_path, expect=1)
    assert report["dropped"] == 1 and report["corrupt"][0]["key"] == a["key"]
    rebuilt = cli_json(["build", work["fp16max"], "--fp16"], tmp_path)
    assert not rebuilt["cache_hit"] and rebuilt["key"] == a["key"]
    purged = cli_json(["cache", "purge", "--key", b["key"][:12]], tmp_path)
    assert purged["removed"] == [b["key"]]
    assert cli_json(["cache", "purge", "--all"], tmp_path)["removed"] == [a["key"]]
    assert cli_json(["cache", "ls"], tmp_path)["entries"] == []


@pytest.mark.parametrize("args,code", [
    (["build", "{root}/missing.onnx"], "file_not_found"),
    (["build", "{root}/garbage.onnx"], "bad_model"),
    (["build", "{digits}", "--int8"], "bad_argument"),
    (["build", "{digits}", "--int8", "--calib", "{root}/no-such-dir"], "file_not_found"),
    (["build", "{digits}", "--fp16", "--layer-precisions", "Add"], "bad_argument"),
    (["build", "{digits}", "--shapes", "input:1xA"], "bad_argument"),
    # a plugin library runs inside the worker: only from the models directory (issue 34)
    (["build", "{digits}", "--plugin", "{root}/libnms.so"], "plugin_path_refused"),
    (["cache", "purge"], "bad_argument"),
    (["bench", "{digits}", "--iterations", "0"], "bad_argument"),
])
def test_bad_input_gives_a_clear_error(work, tmp_path, args, code):
    garbage = work["root"] / "garbage.onnx"
    garbage.write_bytes(b"this is not an ONNX model")
    args = [a.format(root=work["root"], digits=work["digits"]) for a in args]
    out = cli_json(args, tmp_path, expect=2)
    assert out["error"]["code"] == code, out
    assert cli_json(["cache", "ls"], tmp_path)["entries"] == []  # nothing partial published


def test_save_engine_writes_engine_and_meta(work, tmp_path):
    target = tmp_path / "out" / "digits.engine"
    target.parent.mkdir()
    out = cli_json(["build", work["digits"], "--fp16", "--save-engine", target], tmp_path)
    assert out["saved_engine"] == str(target) and out["saved_meta"] == str(target) + ".json"
    with open(out["engine"], "rb") as a, open(str(target), "rb") as b:
        assert a.read() == b.read()
    meta = json.loads((tmp_path / "out" / "digits.engine.json").read_text())
    assert meta["engine_key"] == out["key"] and meta["precision"] == "fp16"
    assert meta["engine_size"] == target.stat().st_size and meta["inputs"][0]["name"] == "input"
    assert meta["name"] == "digits" and len(meta["version"]) == 12
    assert sorted(os.listdir(str(tmp_path / "out"))) == ["digits.engine", "digits.engine.json"]
    y = run_engine(str(target), {"input": work["x_test"][:4]})
    assert y["logits"].shape == (4, 10)
    proc = cli(["build", work["digits"], "--save-engine", tmp_path / "nowhere" / "x"],
               tmp_path, expect=2)
    assert "expected an existing directory" in proc.stderr
