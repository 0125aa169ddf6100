"""agent.engines.model_check: external tensor data anywhere in a model (Constant attributes, sparse
initializers, If / Loop bodies) is inlined from allowed files or refused as bad_model, and what
is built from it is self-contained."""

import os

import numpy as np
import onnx
import pytest

from agent.engines import model_check
from agent.engines.backends import onnx_model
from agent.engines.backends.base import BuildPlan
from agent.engines.backends.onnxruntime import OnnxRuntimeBackend
from agent.errors import AgentError
from tests import bombs


@pytest.fixture(autouse=True)
def unconfined():
    model_check._allowed = None
    yield
    model_check._allowed = None


def code_of(fn):
    with pytest.raises(AgentError) as info:
        fn()
    return info.value


def test_every_external_tensor_is_inlined_and_the_engine_is_self_contained(tmp_path,
                                                                           monkeypatch):
    path, _ = bombs.external_data_model(tmp_path / "m")
    raw = onnx.load(path, load_external_data=False)
    assert len([t for t, _ in model_check.iter_tensors(raw)
                if t.data_location == onnx.TensorProto.EXTERNAL]) == 6
    model = onnx_model.load_model(path)
    assert model_check.is_self_contained(model)
    engine = str(tmp_path / "engine.onnx")
    OnnxRuntimeBackend().build(path, BuildPlan("fp32"), engine)
    os.unlink(str(tmp_path / "m" / "weights.bin"))
    monkeypatch.chdir(tmp_path)
    assert model_check.is_self_contained(onnx.load(engine, load_external_data=False))
    with OnnxRuntimeBackend().open(engine) as runner:
        x = np.arange(4, dtype=np.float32)
        np.testing.assert_array_equal(runner.infer({"x": x})["y"],
                                      x + bombs.EXTERNAL_EXPECTED_OFFSET)


@pytest.mark.parametrize("key", list("wsctbe"))
def test_a_job_model_may_not_read_the_workers_files(tmp_path, key):
    folder = tmp_path / "work"
    path, blobs = bombs.external_data_model(folder, {key: "job.json"})
    (folder / "job.json").write_bytes(blobs["job.json"])  # the right size, even
    model_check.confine_to([path, str(folder / "weights.bin")])
    err = code_of(lambda: onnx_model.load_model(path))
    assert err.code == "bad_model" and "'job.json' is not an artifact of this job" in err.message
    model_check.confine_to([path, str(folder / "weights.bin"), str(folder / "job.json")])
    assert model_check.is_self_contained(onnx_model.load_model(path))


def test_paths_out_of_the_folder_are_refused(tmp_path):
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"\0" * 64)
    for location, why in (("../secret.bin", "no '..'"), (str(outside), "no absolute path"),
                          ("link.bin", "leads outside")):
        folder = tmp_path / location.replace("/", "_").replace(".", "_")
        folder.mkdir()
        os.symlink(str(outside), str(folder / "link.bin"))
        path, _ = bombs.external_data_model(folder, {"c": location})
        err = code_of(lambda p=path: onnx_model.load_model(p))
        assert err.code == "bad_model" and why in err.message, err.message


def test_ranges_that_do_not_fit_the_tensor_are_refused(tmp_path):
    path, _ = bombs.external_data_model(tmp_path / "m")
    model = onnx.load(path, load_external_data=False)
    for t, _ in model_check.iter_tensors(model):
        if t.name == "C":
            for e in t.external_data:
                if e.key == "length":
                    e.value = "4"
                if e.key == "offset":
                    e.value = "-8"
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    err = code_of(lambda: onnx_model.load_model(path))
    assert err.code == "bad_model" and ">= 0" in err.message
    (tmp_path / "m" / "weights.bin").write_bytes(b"\0" * 8)
    model_check._allowed = None
    for t, _ in model_check.iter_tensors(model):
        for e in t.external_data:
            if e.key == "offset":
                e.value = "0"
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    err = code_of(lambda: onnx_model.load_model(path))
    assert err.code == "bad_model" and "expected 16 bytes" in err.message
