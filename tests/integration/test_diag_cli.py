"""``python -m agent diag`` end to end, in a subprocess: this machine (a CPU host) and every
recorded Jetson tree, plus the bad inputs that must give a clear error and never a traceback."""

import json
import os
import subprocess
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "platforms")


def diag(*args, expect=0):
    proc = subprocess.run([sys.executable, "-m", "agent", "diag"] + list(args), cwd=ROOT,
                          capture_output=True, timeout=60,
                          text=True)
    assert proc.returncode == expect, proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
    return proc


def test_this_machine_json():
    report = json.loads(diag("--json").stdout)
    assert report["schema"] == "jetson-agent/diag/1"
    p = report["platform"]
    if p["kind"] != "host":
        pytest.skip("this machine has an NVIDIA GPU")
    assert p["backend"] == "onnxruntime" and report["default_backend"] == "onnxruntime"
    assert p["precisions"]["fp16"] == p["precisions"]["int8"] == "emulated"
    assert p["emulated_precisions"] == ["fp16", "int8"]
    assert report["backends"]["onnxruntime"]["importable"] is True
    assert report["backends"]["tensorrt"]["usable"] is False
    assert report["telemetry"]["source"] == "host"
    assert report["telemetry"]["sample"]["source"] == "host"
    assert isinstance(report["problems"], list)


def test_this_machine_table():
    out = diag().stdout
    report = json.loads(diag("--json").stdout)
    assert report["platform"]["board"] in out
    assert "matrix row" in out and "precision fp16" in out
    if report["platform"]["kind"] == "host":
        assert "emulated" in out


# fixture, family, L4T, JetPack
FAMILIES = [
    ("nano", "nano", "32.7.1", "4.6.1"),
    ("tx1", "tx1", "32.7.4", "4.6.4"),
    ("tx2", "tx2", "32.7.3", "4.6.3"),
    ("xavier-nx", "xavier-nx", "35.4.1", "5.1.2"),
    ("agx-xavier", "agx-xavier", "35.5.0", "5.1.3"),
    ("orin-nano", "orin-nano", "36.4.3", "6.2"),
    ("orin-nx", "orin-nx", "36.4.0", "6.1"),
    ("orin-nx-8gb", "orin-nx", "35.4.1", "5.1.2"),
    ("agx-orin", "agx-orin", "36.3.0", "6.0"),
    ("thor", "thor", "38.2.1", "7.0"),
]


@pytest.mark.parametrize("name, family, l4t, jetpack", FAMILIES)
def test_recorded_trees(name, family, l4t, jetpack):
    root = os.path.join(FIXTURES, name)
    report = json.loads(diag("--json", "--root", root).stdout)
    p = report["platform"]
    assert (p["kind"], p["family"], p["l4t"], p["jetpack"]) == ("jetson", family, l4t, jetpack)
    assert p["matrix_row"]["id"] == family
    assert report["telemetry"]["source"] == "sysfs"
    assert report["problems"] == [] and report["ok"] is True
    table = diag("--root", root).stdout
    assert p["board"] in table and jetpack in table


def test_problems_are_reported_with_exit_zero():
    report = json.loads(diag("--json", "--root", os.path.join(FIXTURES, "unknown-board")).stdout)
    assert report["ok"] is False
    assert report["problems"][0]["source"] == "platform"
    assert report["problems"][0]["fix"]
    table = diag("--root", os.path.join(FIXTURES, "unknown-board")).stdout
    assert "fix: add the board" in table


def test_corrupt_tree_is_a_clear_error():
    proc = diag("--root", os.path.join(FIXTURES, "corrupt"), expect=2)
    assert "error [bad_platform_data]" in proc.stderr
    assert os.path.join("corrupt", "proc", "device-tree", "compatible") in proc.stderr
    proc = diag("--json", "--root", os.path.join(FIXTURES, "corrupt"), expect=2)
    assert json.loads(proc.stdout)["error"]["code"] == "bad_platform_data"


def test_matrix_with_a_typo_is_a_clear_error(tmp_path):
    with open(os.path.join(ROOT, "agent", "data", "support_matrix.yaml")) as f:
        data = yaml.safe_load(f)
    data["families"]["tx2"]["precisions"]["int9"] = "native"
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = diag("--matrix", str(path), expect=2)
    assert str(path) in proc.stderr and "int9" in proc.stderr


def test_missing_root_is_a_clear_error(tmp_path):
    proc = diag("--root", str(tmp_path / "nope"), expect=2)
    assert "error [file_not_found]" in proc.stderr
