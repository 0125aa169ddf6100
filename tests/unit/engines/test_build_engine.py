"""build_engine through the engine cache with the real onnxruntime backend: hits without
building, INT8 calibration once, moved and changed datasets, corrupt engines, a full disk,
two processes building once."""

import multiprocessing
import os
import shutil
import time
import warnings

import numpy as np
import pytest

from agent.engines.backends.base import BuildPlan, CalibrationSettings, no_progress
from agent.engines.backends.onnxruntime import OnnxRuntimeBackend
from agent.engines.build import build_engine
from agent.engines.cache import EngineCache
from agent.errors import AgentError
from tests import models
from tests.unit.engines.test_engine_cache import PLATFORM, _fail_writes_after
from tests.unit.engines.test_engine_cache_locks import in_two_processes

# --- build_engine with the real onnxruntime backend ----------------------------------------


class CountingBackend(OnnxRuntimeBackend):
    """The real backend, counting its builds (and optionally slowed down, so that two
    processes overlap)."""

    def __init__(self, delay=0.0, marker_dir=None):
        super(CountingBackend, self).__init__()
        self.builds = 0
        self.delay = delay
        self.marker_dir = marker_dir

    def build(self, model_path, plan, engine_path, progress=no_progress):
        self.builds += 1
        if self.marker_dir:
            open(os.path.join(self.marker_dir, "build-{}".format(os.getpid())), "w").close()
        time.sleep(self.delay)
        return super(CountingBackend, self).build(model_path, plan, engine_path, progress)


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The digits MLP and 256 real calibration samples in a directory of .npy shards."""
    root = tmp_path_factory.mktemp("digits")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sklearn's ConvergenceWarning: accuracy is enough
        model, split = models.digits_classifier(hidden=(32,))
    path = models.save(model, root / "digits.onnx")
    calib = root / "calib"
    calib.mkdir()
    np.save(str(calib / "input_0.npy"), split[0][:128])
    np.save(str(calib / "input_1.npy"), split[0][128:256])
    return path, str(calib)


@pytest.fixture
def fp16_model(tmp_path):
    return models.save(models.fp16_max_model(), tmp_path / "fp16max.onnx")


def _int8(calib, **kw):
    return BuildPlan("int8", calibration=CalibrationSettings(data=calib, batch_size=32), **kw)


def test_second_identical_build_is_a_hit_without_building(tmp_path, fp16_model):
    backend, cache = CountingBackend(), EngineCache(str(tmp_path / "engines"))
    plan = BuildPlan("fp16", layer_precisions={"Add": "float32", "Sub": "float32"},
                     precision_constraints="obey")
    first = build_engine(fp16_model, plan, backend, cache, PLATFORM)
    second = build_engine(fp16_model, plan, backend, cache, PLATFORM)
    assert (first.cache_hit, second.cache_hit) == (False, True)
    assert backend.builds == 1
    assert second.key == first.key and second.engine_path == first.engine_path
    assert second.result["layer_precisions"] == first.result["layer_precisions"]
    assert cache.stats()["hits"] == 1 and cache.stats()["misses"] == 1
    with backend.open(second.engine_path) as runner:
        out = runner.infer({"x": np.ones((1, 1, 4, 4), np.float32)})["y"]
    assert np.allclose(out, 1.0, atol=1e-3)
    # another platform fingerprint is another engine
    assert not build_engine(fp16_model, plan, backend, cache, {"soc": "other"}).cache_hit


def test_int8_calibrates_once_then_hits_and_other_plans_skip_calibration(tmp_path, digits):
    model, calib = digits
    backend = CountingBackend()
    cache = EngineCache(str(tmp_path / "engines"))
    cal_dir = str(tmp_path / "calibration")
    first = build_engine(model, _int8(calib), backend, cache, PLATFORM, calibration_dir=cal_dir)
    assert not first.cache_hit and first.result["calibrated"]
    cal_cache = first.result["calibration_cache"]
    assert cal_cache.startswith(cal_dir) and open(cal_cache).readline().startswith("TRT-")
    again = build_engine(model, _int8(calib), backend, cache, PLATFORM, calibration_dir=cal_dir)
    assert again.cache_hit and not again.result["calibrated"] and backend.builds == 1
    assert again.key == first.key
    other = build_engine(model, _int8(calib).with_layers(["fc0"]), backend, cache, PLATFORM,
                         calibration_dir=cal_dir)
    assert not other.cache_hit and backend.builds == 2
    assert not other.result["calibrated"]  # read the calibration cache instead
    assert other.result["calibration_cache"] == cal_cache
    assert other.result["layer_precisions"]["fc0"] == "float32"


def test_moved_dataset_hits_changed_dataset_rebuilds(tmp_path, digits):
    model, calib = digits
    backend, cache = CountingBackend(), EngineCache(str(tmp_path / "engines"))
    cal_dir = str(tmp_path / "calibration")
    first = build_engine(model, _int8(calib), backend, cache, PLATFORM, calibration_dir=cal_dir)
    moved = str(tmp_path / "moved")
    shutil.copytree(calib, moved)
    assert build_engine(model, _int8(moved), backend, cache, PLATFORM,
                        calibration_dir=cal_dir).key == first.key
    arr = np.load(os.path.join(moved, "input_1.npy"))
    np.save(os.path.join(moved, "input_1.npy"), arr[:64])
    changed = build_engine(model, _int8(moved), backend, cache, PLATFORM,
                           calibration_dir=cal_dir)
    assert not changed.cache_hit and changed.result["calibrated"]
    assert changed.result["calibration_cache"] != first.result["calibration_cache"]
    assert backend.builds == 2


def test_corrupt_engine_is_rebuilt(tmp_path, fp16_model):
    backend, cache = CountingBackend(), EngineCache(str(tmp_path / "engines"))
    plan = BuildPlan("fp16")
    first = build_engine(fp16_model, plan, backend, cache, PLATFORM)
    with open(first.engine_path, "r+b") as f:
        f.seek(20)
        f.write(b"\xff\xff")
    second = build_engine(fp16_model, plan, backend, cache, PLATFORM)
    assert not second.cache_hit and backend.builds == 2
    assert cache.stats()["corrupt"] == 1
    assert cache.get(second.key) is not None


def test_full_disk_while_publishing_a_build(tmp_path, fp16_model, monkeypatch):
    backend, cache = CountingBackend(), EngineCache(str(tmp_path / "engines"))
    _fail_writes_after(monkeypatch, 0)  # the engine (fsio) is written; meta.json is not
    with pytest.raises(AgentError) as err:
        build_engine(fp16_model, BuildPlan("fp16"), backend, cache, PLATFORM)
    monkeypatch.undo()
    assert err.value.code == "disk_full"
    assert cache.ls() == [] and os.listdir(os.path.join(cache.root, "tmp")) == []
    assert not build_engine(fp16_model, BuildPlan("fp16"), backend, cache, PLATFORM).cache_hit


def test_missing_model_is_file_not_found(tmp_path):
    with pytest.raises(AgentError) as err:
        build_engine(str(tmp_path / "nope.onnx"), BuildPlan(), CountingBackend(),
                     EngineCache(str(tmp_path)), PLATFORM)
    assert err.value.code == "file_not_found"


def _build_in_child(model, root, markers, barrier):
    barrier.wait()
    record = build_engine(model, BuildPlan("fp16"), CountingBackend(0.5, markers),
                          EngineCache(root), PLATFORM)
    return record.key


def test_two_processes_build_engine_once(tmp_path, fp16_model):
    root, markers = str(tmp_path / "engines"), tmp_path / "markers"
    markers.mkdir()
    # spawn: no fork after onnxruntime made threads
    in_two_processes(multiprocessing.get_context("spawn"), _build_in_child,
                     (fp16_model, root, str(markers)), 60)
    assert len(os.listdir(str(markers))) == 1
    assert len(EngineCache(root).ls()) == 1
