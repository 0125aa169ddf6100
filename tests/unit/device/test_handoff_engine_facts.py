"""Issue 34: what the Triton and DeepStream hand-offs take from an engine's meta.json: the DLA
core (DeepStream ``enable-dla`` / ``use-dla-core``, Triton's ``KIND_NVDLA`` secondary device),
plugin libraries (``custom-lib-path``), ``best`` engines, the batch size against the engine's
profile, and Triton's TensorRT against the engine's."""

import json

import pytest

from agent.device.handoff import deepstream, triton
from agent.device.handoff.base import ModelVersion
from agent.errors import AgentError

DETECTOR = {
    "inputs": [{"name": "images", "shape": [-1, 3, 64, 64], "dtype": "float16"}],
    "outputs": [{"name": "boxes", "shape": [-1, 100, 4], "dtype": "float32"}],
    "profiles": [{"inputs": {"images": {"min": [1, 3, 64, 64], "opt": [4, 3, 64, 64],
                                        "max": [8, 3, 64, 64]}}}],
}


def version(tmp_path, ver="v1", precision="fp16", dla=None, plugins=(), tensorrt="8.5.2"):
    path = tmp_path / "models" / "det" / ver
    path.mkdir(parents=True)
    (path / "model.engine").write_bytes(b"plan")
    meta = dict(DETECTOR, name="det", version=ver, precision=precision,
                portability={"dla_core": dla, "tensorrt": tensorrt},
                plugins=[{"path": p, "sha256": "ab" * 32} for p in plugins])
    (path / "meta.json").write_text(json.dumps(meta))
    return ModelVersion("det", ver, str(path), str(path / "model.engine"), meta)


def test_a_dla_engine_reaches_deepstream_and_triton(tmp_path):
    v = version(tmp_path, dla=1)
    keys = dict(deepstream.property_keys(v))
    assert (keys["enable-dla"], keys["use-dla-core"]) == ("1", "1")
    text = triton.render_config("det", v.meta, [1], max_batch_size=8)
    assert "kind: KIND_GPU\n    secondary_devices [ { kind: KIND_NVDLA device_id: 1 } ]" in text
    doc = triton.config_doc("det", v.meta, [1], max_batch_size=8)
    assert doc["instance_group"] == [{"count": 1, "kind": "KIND_GPU", "secondary_devices": [
        {"kind": "KIND_NVDLA", "device_id": 1}]}]
    gpu = version(tmp_path, "v2")
    assert "instance_group" not in triton.config_doc("det", gpu.meta, [1], max_batch_size=8)


def test_a_plugin_library_is_nvinfers_custom_lib_path(tmp_path):
    v = version(tmp_path, plugins=["/models/plugins/libnms.so"])
    assert dict(deepstream.property_keys(v))["custom-lib-path"] == "/models/plugins/libnms.so"
    two = version(tmp_path, "v2", plugins=["/m/a.so", "/m/b.so"])
    with pytest.raises(AgentError) as err:
        deepstream.property_keys(two)
    assert err.value.code == "handoff_failed" and "single custom-lib-path" in err.value.message


def test_deepstream_takes_best_engines_as_int8(tmp_path):
    v = version(tmp_path, precision="best")
    (tmp_path / "models" / "det" / "v1" / "calibration.cache").write_text("TRT-8502-x\n")
    keys = dict(deepstream.property_keys(v))
    assert keys["network-mode"] == "1" and keys["int8-calib-file"].endswith("calibration.cache")


def test_batch_sizes_above_the_engines_profile_are_refused(tmp_path):
    v = version(tmp_path)
    assert dict(deepstream.property_keys(v, batch_size=8))["batch-size"] == "8"
    with pytest.raises(AgentError) as err:
        deepstream.property_keys(v, batch_size=16)
    assert err.value.code == "batch_size_exceeds_profile"
    assert "batch-size 16" in err.value.message and "at most 8" in err.value.message
    adapter = triton.from_config({"repository": str(tmp_path / "repo"), "max_batch_size": 32},
                                 "handoff[0]")
    with pytest.raises(AgentError) as err:
        adapter.prepare(v, None)
    assert err.value.code == "batch_size_exceeds_profile" and "max_batch_size 32" in \
        err.value.message
    assert not (tmp_path / "repo").exists()  # refused before anything is written


def test_triton_must_run_the_tensorrt_the_engine_was_built_with(tmp_path):
    adapter = triton.from_config({"repository": str(tmp_path / "repo"), "tensorrt": "8.6.1"},
                                 "handoff[0]")
    with pytest.raises(AgentError) as err:
        adapter.prepare(version(tmp_path, tensorrt="8.5.2.2"), None)
    assert err.value.code == "tensorrt_version_mismatch"
    assert "built with TensorRT 8.5.2.2" in err.value.message and "runs 8.6.1" in \
        err.value.message
    adapter.prepare(version(tmp_path, "v2", tensorrt="8.6.1.6"), None)  # same release
    with pytest.raises(AgentError) as err:
        triton.from_config({"repository": "r", "tensorrt": "eight"}, "handoff[0]")
    assert err.value.code == "bad_config" and "handoff[0].tensorrt" in err.value.message
