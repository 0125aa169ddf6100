"""Issue 34, items 2 and 3: models with TensorRT plugin ops (a real ``EfficientNMS_TRT``
export written with onnx-graphsurgeon on a wheel detector's outputs) and DLA builds that say
where their layers run, under the fake TensorRT profiles (``tests/fake_trt.py``)."""

import os

import pytest

from agent.engines import plugins
from agent.engines.backends import tensorrt_network
from agent.engines.backends.base import BuildPlan
from agent.engines.backends.onnxruntime import create as create_host
from agent.engines.cache_key import cache_key
from agent.errors import AgentError
from tests import fake_trt
from tests.models import efficientnms_detector
from tests.trt_builds import build as _build


@pytest.fixture(autouse=True)
def _fresh_logger(monkeypatch):
    monkeypatch.setattr(tensorrt_network, "_LOGGER", None)


@pytest.fixture(scope="module")
def nms_model(tmp_path_factory):
    path = efficientnms_detector(tmp_path_factory.mktemp("nms") / "det_nms.onnx")
    if path is None:
        pytest.skip("ddddocr (requirements-models.txt) or onnx-graphsurgeon is not installed")
    return path


def _build_file(monkeypatch, tmp_path, profile, plan, model_path, num_dla_cores=0):
    trt, cuda = fake_trt.install(monkeypatch, profile, num_dla_cores=num_dla_cores)
    from agent.engines.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend(trt.__version__)
    return backend, backend.build(model_path, plan, str(tmp_path / "e.engine")), trt


# -- plugins -----------------------------------------------------------------------------------

def test_the_host_backend_names_the_plugin_op_and_leaves_it_to_the_device(nms_model, tmp_path):
    with pytest.raises(AgentError) as err:
        create_host().build(nms_model, BuildPlan("fp32"), str(tmp_path / "e.onnx"))
    assert err.value.code == "plugin_op_on_host"
    assert "nms (EfficientNMS_TRT)" in err.value.message and "device" in err.value.message
    assert err.value.details["plugin_ops"] == [{"node": "nms", "op": "EfficientNMS_TRT",
                                                "domain": ""}]


@pytest.mark.parametrize("profile", fake_trt.PROFILES)
def test_an_efficientnms_model_builds_with_the_standard_plugins(monkeypatch, tmp_path,
                                                                nms_model, profile):
    backend, result, trt = _build_file(monkeypatch, tmp_path, profile, BuildPlan("fp32"),
                                       nms_model)
    layers = trt._driver.builds[-1]["layers"]
    assert [la["plugin"] for la in layers if la["plugin"]] == ["EfficientNMS_TRT"]
    # A fresh process (nothing registered yet) deserializes it: the runner registers first.
    trt._driver.plugins.clear()
    tensorrt_network._LOGGER.plugins_ready = False
    with backend.open(result.engine_path) as runner:
        assert [o.name for o in runner.outputs][:1] == ["num_detections"]
    assert "EfficientNMS_TRT" in trt._driver.plugins


def test_a_shipped_plugin_library_is_pinned_loaded_and_keyed(monkeypatch, tmp_path,
                                                            nms_model):
    import onnx

    models_dir = tmp_path / "models"
    models_dir.mkdir()
    lib = models_dir / "libmynms.so"
    lib.write_bytes(b"\x7fELF fake plugin")
    model = onnx.load(nms_model)
    [node] = [n for n in model.graph.node if n.op_type == "EfficientNMS_TRT"]
    node.op_type = "MyNMS_TRT"  # not in TensorRT's standard library
    path = str(tmp_path / "custom.onnx")
    onnx.save(model, path)
    entry = plugins.check_library(str(lib), str(models_dir))
    trt, _ = fake_trt.install(monkeypatch, "10.3")
    trt._driver.library_plugins["libmynms.so"] = ["MyNMS_TRT"]
    from agent.engines.backends.tensorrt import TensorRTBackend

    backend = TensorRTBackend(trt.__version__)
    with pytest.raises(AgentError) as err:  # without the library: the parser names the op
        backend.build(path, BuildPlan("fp16"), str(tmp_path / "a.engine"))
    assert err.value.code == "unsupported_model" and "MyNMS_TRT" in err.value.message
    plan = BuildPlan("fp16", plugins=[entry])
    result = backend.build(path, plan, str(tmp_path / "b.engine"))
    assert trt._driver.libraries == [str(lib)]
    assert result.details["plugins"] == [entry]
    assert tensorrt_network.read_plugins(result.engine_path) == [entry]
    # The key follows the library's content, not where it lies.
    moved = BuildPlan("fp16", plugins=[dict(entry, path="/elsewhere/libmynms.so")])
    other = BuildPlan("fp16", plugins=[dict(entry, sha256="0" * 64)])
    keys = [cache_key("m", p, None, {}, {}) for p in (plan, moved, other)]
    assert keys[0] == keys[1] != keys[2]
    assert cache_key("m", BuildPlan("fp16"), None, {}, {}) == cache_key(
        "m", BuildPlan.from_dict(BuildPlan("fp16").to_dict()), None, {}, {})
    lib.write_bytes(b"\x7fELF changed")  # the pinned digest no longer holds
    trt._driver.plugins.clear()
    tensorrt_network._LOGGER.plugin_libraries.clear()
    with pytest.raises(AgentError) as err:
        backend.open(result.engine_path)
    assert err.value.code == "plugin_digest_mismatch"


def test_a_plugin_library_outside_the_models_directory_is_refused(tmp_path):
    models_dir = tmp_path / "models"
    models_dir.mkdir()
    outside = tmp_path / "libevil.so"
    outside.write_bytes(b"x")
    link = models_dir / "libevil.so"
    os.symlink(str(outside), str(link))
    for path in (outside, link):  # a symlink out counts as outside
        with pytest.raises(AgentError) as err:
            plugins.check_library(str(path), str(models_dir))
        assert err.value.code == "plugin_path_refused"
        assert str(models_dir) in err.value.message


# -- DLA -----------------------------------------------------------------------------------------

def _conv_model(batch="N"):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Gather", ["r", "idx"], ["y"], name="gather", axis=1)]
    idx = numpy_helper.from_array(np.array([0, 1], np.int64), "idx")
    graph = helper.make_graph(nodes, "dla",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [batch, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                             [batch, 2, 8, 8])], [w, idx])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


FIXED = {"x": ((1, 3, 8, 8), (1, 3, 8, 8), (1, 3, 8, 8))}


@pytest.mark.parametrize("profile", ["8.2", "8.5", "10.3"])
def test_a_dla_build_reports_where_each_layer_runs(monkeypatch, tmp_path, profile):
    _, result, trt, _ = _build(monkeypatch, tmp_path, profile,
                               BuildPlan("fp16", dla_core=0, shapes=FIXED),
                               model=_conv_model(), num_dla_cores=2)
    placement = result.details["dla_placement"]
    assert placement["dla"] == ["conv", "relu"] and placement["gpu"] == ["gather"]
    assert placement["engine_dla"] == ["conv", "relu"]  # the inspector agrees


@pytest.mark.parametrize("profile", ["8.0", "8.6", "10.3"])
def test_a_dla_build_with_a_dynamic_profile_is_refused_with_the_reason(monkeypatch, tmp_path,
                                                                      profile):
    dynamic = {"x": ((1, 3, 8, 8), (4, 3, 8, 8), (8, 3, 8, 8))}
    with pytest.raises(AgentError) as err:
        _build(monkeypatch, tmp_path, profile, BuildPlan("fp16", dla_core=0, shapes=dynamic),
               model=_conv_model(), num_dla_cores=1)
    assert err.value.code == "dla_dynamic_shape"
    assert "min [1, 3, 8, 8], opt [4, 3, 8, 8], max [8, 3, 8, 8]" in err.value.message
    assert "--shapes x:4x3x8x8" in err.value.message


def test_no_gpu_fallback_names_the_layers_dla_cannot_run(monkeypatch, tmp_path):
    with pytest.raises(AgentError) as err:
        _build(monkeypatch, tmp_path, "8.5",
               BuildPlan("fp16", dla_core=0, shapes=FIXED, dla_gpu_fallback=False),
               model=_conv_model(), num_dla_cores=1)
    assert err.value.code == "dla_layers_on_gpu" and "gather" in err.value.message
    _, result, trt, _ = _build(monkeypatch, tmp_path, "8.5",
                               BuildPlan("fp16", dla_core=0, shapes=FIXED,
                                         dla_gpu_fallback=False),
                               model=_dla_only(), num_dla_cores=1)
    assert "GPU_FALLBACK" not in " ".join(trt._driver.builds[-1]["flags"])
    assert result.details["dla_placement"]["gpu"] == []


def _dla_only():
    model = _conv_model(batch=1)
    del model.graph.node[2]
    model.graph.output[0].name = "r"
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 4
    del model.graph.initializer[1]
    return model


def test_opening_a_dla_engine_creates_no_builder(monkeypatch, tmp_path):
    backend, result, trt, _ = _build(monkeypatch, tmp_path, "8.5",
                                     BuildPlan("fp16", dla_core=1, shapes=FIXED),
                                     model=_conv_model(), num_dla_cores=2)
    created = []
    real = trt.Builder
    monkeypatch.setattr(trt, "Builder", lambda logger: created.append(1) or real(logger))
    with backend.open(result.engine_path) as runner:
        assert runner.engine.dla_core == 1
    assert created == []


def test_a_jobs_plugins_are_files_of_the_models_plugins_folder_pinned_by_the_job(tmp_path):
    import json
    import types

    from agent.device.jobs.scheduler import JobScheduler
    from agent.wire import protocol
    from agent.wire.device import job_semantics
    from tests.unit.wire_samples import job_doc

    folder = tmp_path / "models" / "plugins"
    folder.mkdir(parents=True)
    (folder / "libnms.so").write_bytes(b"\x7fELF nms")
    sha = plugins.sha256_of(str(folder / "libnms.so"))
    doc = job_doc(plan={"precision": "fp16", "dla_core": 0, "dla_gpu_fallback": False,
                        "plugins": [{"file": "libnms.so", "sha256": sha}]})
    protocol.decode("job", json.dumps(doc).encode())  # the schema takes them
    for bad in ({"file": "../libnms.so", "sha256": sha}, {"file": "libnms.so", "sha256": "x"}):
        with pytest.raises(AgentError):
            protocol.decode("job", json.dumps(job_doc(plan={"plugins": [bad]})).encode())
    plan = job_semantics.plan_dict(doc)
    assert plan["dla_gpu_fallback"] is False
    scheduler = types.SimpleNamespace(cfg=types.SimpleNamespace(
        models_dir=str(tmp_path / "models")))
    resolved = JobScheduler._plugins(scheduler, plan["plugins"])
    assert resolved == [{"path": str(folder / "libnms.so"), "sha256": sha}]
    built = BuildPlan.from_dict(dict(plan, plugins=resolved))
    assert (built.plugins, built.dla_gpu_fallback) == (resolved, False)
    with pytest.raises(AgentError) as err:
        JobScheduler._plugins(scheduler, [{"file": "libnms.so", "sha256": "0" * 64}])
    assert err.value.code == "plugin_digest_mismatch"
    # Without either, the plan reads as it did before (same keys, same engine-cache key).
    assert "plugins" not in job_semantics.plan_dict(job_doc(plan={"precision": "fp16"}))
    # A job may ask for our calibration as Q/DQ (explicit INT8, TensorRT >= 10.1) too.
    doc = job_doc(plan={"precision": "int8", "explicit_int8": True})
    protocol.decode("job", json.dumps(doc).encode())
    assert BuildPlan.from_dict(job_semantics.plan_dict(doc)).explicit_int8
    assert "explicit_int8" not in job_semantics.plan_dict(job_doc(plan={"precision": "int8"}))


def test_the_11_profile_is_the_tensorrt_jetpack_ships_with_dla_on_agx_orin(monkeypatch,
                                                                          tmp_path):
    """Issue 34: JetPack's TensorRT 11 starts at 11.4.1 (JetPack 7.2.2), where DLA is back
    on AGX Orin for strongly typed networks: the 11.x profile is 11.4.1 and builds for DLA."""
    from agent.engines.backends.tensorrt_plan import Features, parse_version
    from agent.platform.matrix import load_matrix

    profile = fake_trt.load_profile("11.x")
    version = parse_version(profile["version"])
    [release] = [r for r in load_matrix().releases if r["l4t"] == "39.2.2"]
    assert version >= parse_version(release["tensorrt"]) >= (11, 4, 1)
    assert Features(version).dla and Features(version).strongly_typed
    _, result, trt, _ = _build(monkeypatch, tmp_path, "11.x",
                               BuildPlan("fp16", dla_core=0, shapes=FIXED),
                               model=_conv_model(), num_dla_cores=2)
    assert result.details["strongly_typed"]
    assert result.details["dla_placement"]["dla"] == ["conv", "relu"]


def test_the_11_inspector_key_is_DataType(monkeypatch, tmp_path):
    import json

    from agent.engines.backends.tensorrt_inspect import parse_engine_information

    doc = {"Layers": [{"Name": "Add", "Outputs": [{"Format": "Row major linear",
                                                   "DataType": "Half"}]}]}
    assert [la.precision for la in parse_engine_information(json.dumps(doc))] == ["float16"]
    assert fake_trt.load_profile("11.x")["inspector"]["dtype_keys"] == ["Format", "DataType"]
    _, result, _, _ = _build(monkeypatch, tmp_path, "11.x", BuildPlan("fp32"))
    assert set(result.layer_precisions.values()) == {"float32"}  # read back through DataType


@pytest.mark.parametrize("profile", ["8.5", "10.3"])
def test_timing_cache_failures_are_reported_not_ignored(monkeypatch, tmp_path, profile):
    from agent.engines.backends import tensorrt_caches

    monkeypatch.setattr(tensorrt_caches, "state_dir", lambda: str(tmp_path / "state"))
    _, first, _, _ = _build(monkeypatch, tmp_path, profile, BuildPlan("fp16"))
    path = first.details["timing_cache"]["path"]
    assert "errors" not in first.details["timing_cache"]
    with open(path, "wb") as f:
        f.write(b"garbage, not a timing cache")
    _, result, _, _ = _build(monkeypatch, tmp_path, profile, BuildPlan("fp16"),
                             engine="f.engine")
    errors = result.details["timing_cache"]["errors"]
    assert [e.split(" is unreadable, ")[1].split(":")[0] for e in errors] == [
        "not used", "replaced by this build's"]
    assert all(path in e for e in errors) and errors[0] in result.details["notes"]


def test_a_dla_engines_sidecars_reach_the_version_folder(monkeypatch, tmp_path):
    """The app opens ``<models>/<name>/<version>/model.engine``: its DLA core, platform record
    and plugin list travel with it (they stayed in the engine cache before)."""
    from agent.device.models.directory import ModelsDir

    _, result, _, _ = _build(monkeypatch, tmp_path, "8.5",
                             BuildPlan("fp16", dla_core=1, shapes=FIXED),
                             model=_conv_model(), num_dla_cores=2)
    models = ModelsDir(str(tmp_path / "models"))
    path = models.write_version("det", "v1", result.engine_path, None,
                                lambda sha, size: {"engine_sha256": sha, "engine_size": size})
    assert sorted(os.listdir(path)) == ["meta.json", "model.engine", "model.engine.dla-core",
                                        "model.engine.platform.json"]
    assert tensorrt_network.read_dla_core(os.path.join(path, "model.engine")) == 1
