"""The smaller rough edges a newcomer hit, each through the real entry point: what a message
names, what --json leaves out, labelled progress, a search answer printed once, key file
modes, a TLS hint, telemetry with units."""

import io
import json
import os
import stat
import subprocess
import sys

import pytest

from agent.cli import telemetry_view
from agent.progress import ProgressBar

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP16_MAX = os.path.join(ROOT, "examples", "fp16_max")
AGX_ORIN = os.path.join(ROOT, "tests", "fixtures", "platforms", "agx-orin")


def cli(*args, expect=0, state=None):
    env = dict(os.environ, PYTHONPATH=ROOT)
    if state is not None:
        env["JETSON_AGENT_STATE_DIR"] = str(state)
    proc = subprocess.run([sys.executable, "-m", "agent"] + [str(a) for a in args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return proc


def test_messages_name_the_file_as_the_user_named_it(tmp_path):
    model = os.path.join(FP16_MAX, "model.onnx")
    proc = cli("compare", model, "--fp16", "--load-inputs", tmp_path / "nosuch.json", expect=2,
               state=tmp_path)
    assert "inputs file {} does not exist".format(tmp_path / "nosuch.json") in proc.stderr
    assert "golden" not in proc.stderr
    for command in (["build"], ["bench"], ["compare"], ["search", "--fp16"]):
        proc = cli(*(command[:1] + [FP16_MAX] + command[1:]), expect=2, state=tmp_path)
        assert "{} is a directory".format(FP16_MAX) in proc.stderr, command


def test_compare_json_draws_no_bar(tmp_path):
    model = os.path.join(FP16_MAX, "model.onnx")
    proc = cli("compare", model, "--fp16", "--json", expect=1, state=tmp_path)
    assert json.loads(proc.stdout)["passed"] is False  # FP16_MAX overflows in fp16
    assert "building" not in proc.stderr and "inferring" not in proc.stderr
    text = cli("compare", model, "--fp16", expect=1, state=tmp_path)
    assert "inferring" in text.stderr  # without --json the progress is there


def test_progress_labels_each_pass_and_draws_a_finished_bar_once():
    out = io.StringIO()
    bar = ProgressBar(out, min_interval=0)
    for done in (0, 4, 4):  # the onnxruntime calibration reports "finished" twice
        bar("calibrating", done, 4)
    for done in (0, 4):  # TensorRT's entropy calibration reads the data a second time
        bar("calibrating", done, 4)
    bar("building", 1, 1)
    assert out.getvalue().splitlines() == [
        "calibrating: 0/4", "calibrating: 4/4", "calibrating (pass 2): 0/4",
        "calibrating (pass 2): 4/4", "building: 1/1"]


def test_search_prints_its_answer_once(tmp_path):
    proc = cli("search", os.path.join(FP16_MAX, "model.onnx"), "--fp16", "--mode", "linear",
               "--load-inputs", os.path.join(FP16_MAX, "inputs.json"), "--load-outputs",
               os.path.join(FP16_MAX, "golden.json"), state=tmp_path)
    assert proc.stdout.count("--layer-precisions") == 1, proc.stdout
    from agent.cli.search import format_result

    stopped = {"mode": "linear", "direction": "forward", "precision": "fp16", "candidates": 4,
               "keep_precision": "float32", "evaluations": 2, "builds": 2, "cache_hits": 0,
               "seconds": 1.0, "iterations": [], "passed": True, "keep": ["Add", "Sub"],
               "layer_precisions": "Add:float32 Sub:float32",
               "message": "stopped: keep 2 of 4 layer(s) in float32 (2 evaluations): "
                          "--layer-precisions Add:float32 Sub:float32"}
    text = format_result(stopped)  # what Ctrl-C prints
    assert text.count("Add:float32 Sub:float32") == 1 and "[I] stopped: keep 2 of 4" in text


def test_keygen_public_key_is_world_readable(tmp_path):
    cli("fleet", "keygen", "--out", tmp_path, "--name", "ctl")
    assert stat.S_IMODE(os.stat(str(tmp_path / "ctl.pub")).st_mode) == 0o644
    assert stat.S_IMODE(os.stat(str(tmp_path / "ctl.key")).st_mode) == 0o600


def test_mqtts_to_a_plain_port_says_so(mosquitto):
    proc = cli("fleet", "devices", "--broker", "mqtts://{}:{}".format(
        mosquitto.host, mosquitto.port), "--connect-timeout", "10", expect=2)
    assert "error [broker_unreachable]" in proc.stderr
    assert "is port {} a TLS listener?".format(mosquitto.port) in proc.stderr


def test_telemetry_has_units_and_a_table():
    sample = {"source": "sysfs", "cpu_percent": 12.5, "ram_fraction": 0.4321,
              "temp_gpu_c": 47.25, "power_total_mw": 7391, "power_vdd_cpu_cv_mw": 794,
              "nvpmodel": "MAXN", "jetson_clocks": None}
    assert telemetry_view.rows(sample) == [
        ("CPU", "12.5 %"), ("RAM used", "43.2 %"), ("temp gpu", "47.2 °C"),
        ("power total", "7.39 W"), ("power vdd_cpu_cv", "794 mW"), ("power mode", "MAXN")]
    assert telemetry_view.rows(dict(sample, jetson_clocks=True))[-1][0] == "jetson_clocks"
    text = cli("diag", "--root", AGX_ORIN, "--no-jtop").stdout
    assert "=None" not in text and "ram_fraction" not in text
    assert "telemetry sample (sysfs):" in text and "°C" in text and " W" in text


@pytest.mark.parametrize("metrics", [{}, {"cpu_percent": 1.0, "odd_new_key": 3}])
def test_fleet_telemetry_prints_a_table(capsys, metrics):
    from agent.cli.fleet_commands import _print_telemetry

    _print_telemetry({"device": "nano-1", "ts": 0, "source": "jtop", "metrics": metrics}, False)
    out = capsys.readouterr().out.splitlines()
    assert "nano-1 (jtop)" in out[0]
    assert out[1:] == (["  (no metrics)"] if not metrics else
                       ["  CPU          1.0 %", "  odd_new_key  3"])


def test_fleet_devices_column_uses_the_keys_the_daemon_sends():
    from agent.cli.fleet_registry import telemetry_summary

    metrics = {"cpu_percent": 3.0, "gpu_percent": 50.0, "ram_fraction": 0.5,
               "temp_gpu_c": 40.0, "power_total_mw": 5000, "jetson_clocks": None}
    assert telemetry_summary(metrics) == "CPU 3.0 %, GPU 50.0 %, RAM used 50.0 %, temp gpu 40.0 °C"
    assert telemetry_summary(None) == "-"
