"""The per-layer view on a device, through the version-faithful fake TensorRT
(``tests/fake_trt.py``): ``inspect`` of an engine reads the engine inspector, ``bench
--profile`` TensorRT's ``IProfiler``, in trtexec's ``--exportProfile`` shape (issue 34)."""

import numpy as np
import pytest

from agent.cli.inspect import engine_view
from agent.engines import layer_view
from agent.engines.backends import tensorrt_network
from agent.engines.backends.base import BuildPlan
from tests.trt_builds import build


@pytest.fixture(autouse=True)
def _fresh_logger(monkeypatch):
    monkeypatch.setattr(tensorrt_network, "_LOGGER", None)


@pytest.mark.parametrize("profile", ["8.6", "10.3", "11.x"])
def test_engine_inspector_rows_and_iprofiler_times(monkeypatch, tmp_path, profile):
    backend, result, trt, _ = build(monkeypatch, tmp_path, profile, BuildPlan("fp16"))
    rows, about = engine_view(result.engine_path)
    assert about["kind"] == "engine" and not about["emulated"]
    names = [layer["name"] for layer in trt._driver.builds[-1]["layers"]]
    assert [r["name"] for r in rows] == names
    assert all(r["placement"] == "GPU" and r["precision"] in ("float16", "float32")
               for r in rows)
    with backend.open(result.engine_path) as runner:
        feeds = {"x": np.ones((1, 1, 4, 4), np.float32)}
        times = runner.layer_times(feeds, 3)
    assert list(times) == names and all(len(v) == 3 for v in times.values())
    doc = layer_view.export_profile(times, 3, {"backend": "tensorrt", "emulated": False})
    assert doc[0] == {"count": 3, "backend": "tensorrt", "emulated": False}
    assert doc[1]["name"] == names[0] and doc[1]["averageMs"] == pytest.approx(0.01)
    assert sum(r["percentage"] for r in doc[1:]) == pytest.approx(100.0)


def test_engine_rows_read_tactics_and_dla_from_inspector_json():
    info = ('{"Layers": [{"Name": "conv", "LayerType": "CaskConvolution", "TacticName": '
            '"sm80_xmma_fprop", "Outputs": [{"Format/Datatype": "Row major linear FP16"}]}, '
            '{"Name": "{ForeignNode[relu]}", "LayerType": "DLA", "Outputs": '
            '[{"Format/Datatype": "Channel major FP16 format"}]}, "bare_name"]}')
    rows = layer_view.engine_rows(info)
    assert [(r["name"], r["placement"], r["tactic"]) for r in rows] == [
        ("conv", "GPU", "sm80_xmma_fprop"), ("{ForeignNode[relu]}", "DLA", None),
        ("bare_name", "-", None)]
    assert layer_view.summary(rows)["placements"] == {"-": 1, "DLA": 1, "GPU": 1}
