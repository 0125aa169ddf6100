"""``jetson-agent selftest`` on a host (the onnxruntime backend, real models from examples/):
exit 0, a report that validates against its documented schema, the problem list; and the same
run with a failing row, an unusable backend and the emulation verdicts, through the module."""

import json
import os
import subprocess
import sys

import pytest

from agent.platform import for_row
from agent.wire.json_schema import Validator
from agent.worker import selftest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCHEMA_PATH = os.path.join(ROOT, "agent", "data", "schemas", "selftest.json")


def validate(report):
    with open(SCHEMA_PATH) as f:
        schema = json.load(f)
    assert Validator(schema, "selftest").first_violation(report, "selftest") is None


def test_selftest_json_on_a_host(tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "agent", "selftest", "--json", "--out",
                           str(out), "--no-jtop", "--bench-iterations", "5"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    validate(report)
    with open(out / "selftest.json") as f:
        assert json.load(f) == report  # the file is the report printed
    assert report["host"] and report["backend"] == "onnxruntime" and report["ok"]
    assert report["precisions"] == ["fp32", "fp16", "int8"]  # the host row, emulated
    rows = {(r["example"], r["precision"]): r for r in report["results"]}
    assert rows[("fp16_max", "int8")]["status"] == "skipped"
    for key in [k for k in rows if k != ("fp16_max", "int8")]:
        row = rows[key]
        assert row["status"] == "passed" and row["bench"]["iterations"] == 5, row
        assert "emulation" not in row  # not the emulation against itself
    assert rows[("digits", "int8")]["build"]["calibrated"]
    assert rows[("digits", "int8")]["top1"]["accuracy"] >= 0.95
    assert report["dla"]["status"] == "skipped"
    assert report["versions"]["onnxruntime"] and report["versions"]["agent"]
    assert set(report["conditions"]) == {"nvpmodel", "clocks_mhz", "temperatures_c"}
    assert all(p["fix"] for p in report["problems"])


def test_a_failing_row_is_a_problem_with_its_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(selftest.EXAMPLES["fp16_max"], "layers", {})  # Add overflows in fp16
    report, path = selftest.run_selftest(for_row("host"), str(tmp_path), bench_iterations=1)
    validate(report)
    assert not report["ok"] and report["counts"]["failed"] == 1
    (problem,) = [p for p in report["problems"] if p["where"] == "compare"]
    assert "fp16_max fp16 does not match its goldens (outputs y)" in problem["problem"]
    assert "jetson-agent compare examples/fp16_max/model.onnx --fp16" in problem["fix"]
    assert os.path.isfile(path) and not [n for n in os.listdir(str(tmp_path))
                                         if n.startswith("selftest-")]  # scratch removed


def test_an_unusable_backend_is_reported_and_the_host_backend_runs(tmp_path):
    info = for_row("orin-nano")  # a Jetson row: its backend is tensorrt, absent here
    pytest.importorskip("onnxruntime")
    try:
        import tensorrt  # noqa: F401
        pytest.skip("TensorRT is importable here")
    except ImportError:
        pass
    report, _ = selftest.run_selftest(info, str(tmp_path), bench_iterations=1)
    validate(report)
    assert report["backend"] == "onnxruntime"
    assert [p["where"] for p in report["problems"]][:1] == ["backend"]
    assert "scripts/install-jetson" in report["problems"][0]["fix"]
    # Issue 34: a Jetson on which TensorRT never ran has not passed, however the emulated
    # rows went (selftest exits 1 and says why).
    assert report["counts"]["failed"] == report["counts"]["error"] == 0
    assert not report["ok"]
    assert any("TensorRT never ran on this jetson board: every row ran on the onnxruntime "
               "backend" in p["problem"] for p in report["problems"])


def test_on_a_device_each_row_is_checked_against_the_host_emulation(tmp_path, monkeypatch):
    """The device path through the version-faithful fakes (tests/fake_trt.py, TensorRT 10.3,
    two DLA cores): every precision builds with the tensorrt backend, the same plan runs on
    the host emulation, and the verdicts are compared. The fake engine computes nothing (its
    outputs stay zero), so the device fails every comparison where the emulation passes: each
    such row is an ``emulation`` problem; the DLA rows run on core 0."""
    from agent.engines.backends import tensorrt_network
    from tests import fake_trt

    monkeypatch.setattr(tensorrt_network, "_LOGGER", None)
    fake_trt.install(monkeypatch, "10.3", num_dla_cores=2)
    info = for_row("agx-orin")
    info.tensorrt, info.jetpack = "10.3.0.30", "6.2"
    report, _ = selftest.run_selftest(info, str(tmp_path), bench_iterations=2)
    validate(report)
    assert report["backend"] == "tensorrt" and not report["host"]
    gpu = [r for r in report["results"] if r["dla_core"] is None and r["status"] != "skipped"]
    assert gpu and all(r["emulation"]["passed"] and not r["emulation"]["agrees"] for r in gpu)
    assert len([p for p in report["problems"] if p["where"] == "emulation"]) == len(gpu)
    dla = [r for r in report["results"] if r["dla_core"] == 0]
    assert [r["precision"] for r in dla] == ["fp16", "int8"] and report["dla"]["rows"] == 2
    assert not report["ok"]


def test_a_dla_row_passes_only_when_its_layers_run_on_the_dla(tmp_path, monkeypatch):
    """Issue 34: the DLA rows build with one fixed profile (DLA has no dynamic shapes) and
    check placement: the fake's DLA takes the digits MLP's Gemm (constant weights, as fully
    connected) and Relu layers; with Gemm refused, GPU fallback would move them silently and
    the row must fail naming them."""
    from agent.engines.backends import tensorrt_network
    from tests import fake_trt

    monkeypatch.setattr(tensorrt_network, "_LOGGER", None)
    trt, _ = fake_trt.install(monkeypatch, "8.5", num_dla_cores=1)
    info = for_row("agx-orin")
    info.tensorrt, info.jetpack = "8.5.2.2", "5.1.2"
    st = _dla_selftest(info, tmp_path / "a")
    row = st.row("digits", "fp16", dla_core=0)
    profiles = trt._driver.builds[-1]["profiles"]
    assert profiles == [{"input": [[54, 64], [54, 64], [54, 64]]}]
    assert row["placement"] == {"expected": ["fc0", "relu0", "fc1", "relu1", "fc_out"],
                                "on_gpu": [], "passed": True}
    original = trt.IBuilderConfig.can_run_on_DLA
    monkeypatch.setattr(trt.IBuilderConfig, "can_run_on_DLA", lambda self, layer: (
        layer.op != "Gemm" and original(self, layer)))
    st = _dla_selftest(info, tmp_path / "b")
    row = st.row("digits", "fp16", dla_core=0)
    assert row["status"] == "failed" and row["placement"]["on_gpu"] == ["fc0", "fc1", "fc_out"]
    [problem] = [p for p in st.problems if p["where"] == "dla"]
    assert "fc0, fc1, fc_out ran on the GPU" in problem["problem"]


def _dla_selftest(info, scratch):
    st = selftest.Selftest(info, str(scratch), bench_iterations=1)
    st.scratch = str(scratch)
    st._open_backends()
    st.emulation = None  # the device rows only
    return st
