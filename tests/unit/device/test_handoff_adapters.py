"""The Triton and DeepStream hand-off adapters without a running app: the generated Triton
config against golden files written from Triton's documentation, the repository's version
folders and map, the DeepStream keys against a fixture citing DeepStream 6.4, the test5 override
swap, and config validation."""

import json
import os
import socket

import pytest

from agent.device.handoff import deepstream, triton
from agent.device.handoff.base import ModelVersion
from agent.errors import AgentError

FIXTURES = os.path.join(os.path.join(os.path.dirname(__file__), "..", ".."), "fixtures", "handoff")


def golden(name):
    with open(os.path.join(FIXTURES, "triton", name)) as f:
        return f.read()


DETECTOR = {
    "inputs": [{"name": "images", "shape": [1, 3, 640, 640], "dtype": "float16"}],
    "outputs": [{"name": "boxes", "shape": [1, 100, 4], "dtype": "float32"},
                {"name": "classes", "shape": [1, 100], "dtype": "int32"}],
}
CLASSIFIER = {
    "inputs": [{"name": "input0", "shape": [-1, 16], "dtype": "float32"},
               {"name": "input1", "shape": [None, -1, 16], "dtype": "int8"}],
    "outputs": [{"name": "output0", "shape": [-1, 16], "dtype": "float32"}],
}


def test_tensorrt_plan_configs_match_the_golden_files():
    assert triton.render_config("detector", DETECTOR, [4, 3]) == golden("detector_fixed.pbtxt")
    assert triton.render_config("classifier", CLASSIFIER, [1], max_batch_size=8,
                                instance_group=("KIND_GPU", 2)) == \
        golden("classifier_batched.pbtxt")


@pytest.mark.parametrize("meta, needle", [
    ({"inputs": [{"name": "x", "shape": [1], "dtype": "complex64"}], "outputs": []},
     "expected a dtype Triton knows"),
    ({"inputs": [], "outputs": []}, "expected a non-empty inputs list"),
    ({"inputs": [{"name": "x\"", "shape": [1], "dtype": "float32"}],
      "outputs": [{"name": "y", "shape": [1], "dtype": "float32"}]}, "expected a tensor name"),
    ({"inputs": [{"name": "x\n", "shape": [1], "dtype": "float32"}],
      "outputs": [{"name": "y", "shape": [1], "dtype": "float32"}]}, "expected a tensor name"),
    ({"inputs": [{"name": "x", "shape": [1], "dtype": "float32"}],
      "outputs": [{"name": "y\x00", "shape": [1], "dtype": "float32"}]}, "expected a tensor name"),
    ({"inputs": [{"name": "a\tb", "shape": [1], "dtype": "float32"}],
      "outputs": [{"name": "y", "shape": [1], "dtype": "float32"}]}, "expected a tensor name"),
])
def test_meta_triton_cannot_describe_is_refused(meta, needle):
    with pytest.raises(AgentError) as info:
        triton.render_config("m", meta, [1])
    code = "bad_tensor_name" if "tensor name" in needle else "handoff_failed"
    assert info.value.code == code and needle in info.value.message


def test_batched_config_needs_a_dynamic_batch_dimension():
    with pytest.raises(AgentError) as info:
        triton.render_config("detector", DETECTOR, [1], max_batch_size=4)
    assert "dynamic first (batch) dimension" in info.value.message


@pytest.mark.parametrize("section, key", [
    ({}, "repository"),
    ({"repository": "r", "url": "http://triton"}, "url"),
    ({"repository": "r", "url": "ftp://h:1"}, "url"),
    ({"repository": "r", "url": "http://h:8000/v2"}, "url"),
    ({"repository": "r", "max_batch_size": -1}, "max_batch_size"),
    ({"repository": "r", "keep_versions": 0}, "keep_versions"),
    ({"repository": "r", "loaded_versions": 0}, "loaded_versions"),
    ({"repository": "r", "keep_versions": 2, "loaded_versions": 3}, "loaded_versions"),
    ({"repository": "r", "timeout_s": "soon"}, "timeout_s"),
    ({"repository": "r", "instance_group": {"kind": "tpu"}}, "instance_group.kind"),
    ({"repository": "r", "backend": "onnx"}, "backend"),
    ({"repository": "r", "platform": "x"}, "platform"),
    ({"repository": "r", "url": "http://h:8000", "grpc_url": "h"}, "grpc_url"),
    ({"repository": "r", "url": "http://h:8000", "grpc_url": "grpc://h:8001"}, "grpc_url"),
    ({"repository": "r", "grpc_url": "h:8001"}, "url"),
])
def test_triton_config_errors_name_the_key(section, key):
    with pytest.raises(AgentError) as info:
        triton.from_config(section, "handoff[1]")
    assert info.value.code == "bad_config"
    assert info.value.message.startswith("handoff[1].{}: expected".format(key))


def version(tmp_path, name, ver, precision="fp16", dla=None, engine=b"plan"):
    path = tmp_path / "models" / name / ver
    path.mkdir(parents=True)
    (path / "model.engine").write_bytes(engine)
    meta = dict(DETECTOR, name=name, version=ver, precision=precision, model_sha256="ab" * 32,
                portability={"dla_core": dla})
    (path / "meta.json").write_text(json.dumps(meta))
    return ModelVersion(name, ver, str(path), str(path / "model.engine"), meta)


def test_repository_without_url_links_engines_and_keeps_the_previous(tmp_path):
    # loaded_versions 2: the previous version is listed (and so held by Triton) too.
    adapter = triton.from_config({"repository": str(tmp_path / "repo"), "loaded_versions": 2},
                                 "handoff[0]")
    v1, v2, v3 = (version(tmp_path, "detector", v) for v in ("v1", "v2", "v3"))
    model_dir = tmp_path / "repo" / "detector"
    adapter.prepare(v1, None)
    assert not (model_dir / "config.pbtxt").exists()  # prepare: nothing Triton would load
    adapter.switch(v1, None)
    assert adapter.confirm(v1) is None  # no url: no opinion
    plan = model_dir / "1" / "model.plan"
    assert os.stat(str(plan)).st_ino == os.stat(v1.engine).st_ino  # a hard link, no copy
    meta = json.loads((model_dir / "1" / "meta.json").read_text())
    assert meta["triton"] == {"model": "detector", "version": 1,
                              "repository": str(tmp_path / "repo")}
    adapter.commit(v1, None)
    adapter.prepare(v2, v1)
    adapter.switch(v2, v1)
    assert "versions: [ 1, 2 ]" in (model_dir / "config.pbtxt").read_text()
    adapter.commit(v2, v1)
    adapter.prepare(v3, v2)
    adapter.switch(v3, v2)
    assert "versions: [ 2, 3 ]" in (model_dir / "config.pbtxt").read_text()
    adapter.commit(v3, v2)
    assert sorted(os.listdir(str(model_dir))) == [
        "2", "3", "config.pbtxt", triton.MAP_FILE]
    assert [(e["triton"], e["version"]) for e in adapter.read_map("detector")] == [
        (2, "v2"), (3, "v3")]
    adapter.revert(v2, v3)
    assert "versions: [ 2 ]" in (model_dir / "config.pbtxt").read_text()
    assert sorted(os.listdir(str(model_dir))) == ["2", "config.pbtxt", triton.MAP_FILE]
    adapter.revert(v1, v2)  # v1's folder was pruned: placed again under a new number
    assert adapter.triton_version("detector", "v1") == 3
    assert "versions: [ 3 ]" in (model_dir / "config.pbtxt").read_text()


def test_switch_without_prepare_and_a_corrupt_map_are_handoff_failures(tmp_path):
    adapter = triton.from_config({"repository": str(tmp_path / "repo")}, "handoff[0]")
    v1 = version(tmp_path, "detector", "v1")
    with pytest.raises(AgentError) as info:
        adapter.switch(v1, None)
    assert info.value.code == "handoff_failed" and "prepared" in info.value.message
    os.makedirs(str(tmp_path / "repo" / "detector"))
    (tmp_path / "repo" / "detector" / triton.MAP_FILE).write_text("[1, 2")
    with pytest.raises(AgentError) as info:
        adapter.prepare(v1, None)
    assert info.value.code == "handoff_failed" and "version map" in info.value.message


def test_unreachable_triton_is_a_handoff_failure(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    adapter = triton.from_config({"repository": str(tmp_path / "repo"), "timeout_s": 2,
                                  "url": "http://127.0.0.1:{}".format(port)}, "h")
    v1 = version(tmp_path, "detector", "v1")
    adapter.prepare(v1, None)
    with pytest.raises(AgentError) as info:
        adapter.switch(v1, None)
    assert info.value.code == "handoff_failed" and "expected Triton to answer" in \
        info.value.message


# --- DeepStream -----------------------------------------------------------------------------

def keys_fixture():
    with open(os.path.join(FIXTURES, "deepstream", "keys.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("case", keys_fixture()["cases"], ids=lambda c: c["case"])
def test_nvinfer_property_keys_match_the_fixture(tmp_path, case):
    v = version(tmp_path, "detector", "v1", precision=case["precision"], dla=case["dla_core"])
    if case["calibration_cache"]:
        (tmp_path / "models" / "detector" / "v1" / "calibration.cache").write_text("calib")
    config = str(tmp_path / "app" / "pgie.txt")
    adapter = deepstream.from_config(dict(case["adapter"], config=config), "handoff[0]")
    adapter.prepare(v, None)
    adapter.switch(v, None)
    expected = [[k, val.format(engine=v.engine, path=v.path)] for k, val in case["property"]]
    with open(config) as f:
        lines = f.read().splitlines()
    assert lines[0] == "[property]"
    assert [line.split("=", 1) for line in lines[1:]] == expected
    assert adapter.confirm(v) is None


def test_template_keeps_the_users_keys_and_replaces_ours(tmp_path):
    template = tmp_path / "pgie_template.txt"
    template.write_text("# my detector\n[property]\ngpu-id=3\nmodel-engine-file=/old.engine\n"
                        "labelfile-path=labels.txt\nnum-detected-classes=4\n"
                        "[class-attrs-all]\npre-cluster-threshold=0.2\n")
    config = str(tmp_path / "pgie.txt")
    adapter = deepstream.from_config({"config": config, "template": str(template)}, "h")
    v = version(tmp_path, "detector", "v1")
    adapter.switch(v, None)
    text = open(config).read()
    assert text == ("# my detector\n[property]\nmodel-engine-file={}\nnetwork-mode=2\n"
                    "batch-size=1\ngpu-id=0\nlabelfile-path=labels.txt\n"
                    "num-detected-classes=4\n[class-attrs-all]\n"
                    "pre-cluster-threshold=0.2\n").format(v.engine)


def test_test5_override_is_swapped_through_data_link(tmp_path):
    fixture = keys_fixture()["override"]
    config = str(tmp_path / "app" / "pgie.txt")
    override = tmp_path / "app" / "ota" / "override.txt"
    override.parent.mkdir(parents=True)
    override.write_text("[primary-gie]\nenable=0\n")  # what the user started test5 with
    adapter = deepstream.from_config({"config": config, "override": str(override)}, "h")
    v1, v2 = version(tmp_path, "detector", "v1"), version(tmp_path, "detector", "v2")
    for v in (v1, v2):
        adapter.prepare(v, None)
        adapter.switch(v, None)
        assert os.readlink(str(override)) == os.path.join("..data", "override.txt")
        lines = override.read_text().splitlines()
        assert lines[0] == "[{}]".format(fixture["group"])
        assert [line.split("=", 1) for line in lines[1:]] == [
            [k, val.format(config=config, engine=v.engine)] for k, val in fixture["keys"]]
    hidden = [n for n in os.listdir(str(override.parent)) if n.startswith("..")
              and n != "..data"]
    assert len(hidden) == 1  # the previous update's folder is gone
    adapter.revert(v1, v2)
    assert "model-engine-file={}".format(v1.engine) in override.read_text()
    assert "model-engine-file={}\n".format(v1.engine) in open(config).read()
    adapter.revert(None, v1)
    assert not os.path.lexists(str(override)) and not os.path.exists(config)


@pytest.mark.parametrize("section, key", [
    ({}, "config"),
    ({"config": "c", "batch_size": 0}, "batch_size"),
    ({"config": "c", "onnx_file": "yes"}, "onnx_file"),
    ({"config": "c", "override": "c"}, "override"),
    ({"config": "c", "template": "/nonexistent/t.txt"}, "template"),
    ({"config": "c", "network_mode": 1}, "network_mode"),
])
def test_deepstream_config_errors_name_the_key(section, key):
    with pytest.raises(AgentError) as info:
        deepstream.from_config(section, "handoff[2]")
    assert info.value.code == "bad_config"
    assert info.value.message.startswith("handoff[2].{}: expected".format(key))


def test_unknown_precision_fails_before_any_write(tmp_path):
    config = tmp_path / "pgie.txt"
    adapter = deepstream.from_config({"config": str(config)}, "h")
    v = version(tmp_path, "detector", "v1", precision="mixed")
    with pytest.raises(AgentError) as info:
        adapter.prepare(v, None)
    assert info.value.code == "handoff_failed" and "network-mode" in info.value.message
    assert not config.exists()


def test_a_top_level_deepstream_config_is_one_names_pipeline(tmp_path):
    from agent.device import handoff
    with pytest.raises(AgentError) as info:
        handoff.parse([{"type": "deepstream", "models": ["*"], "config": "c"}])
    assert info.value.code == "bad_config" and "pipelines" in info.value.message
    with pytest.raises(AgentError) as info:
        handoff.parse([{"type": "deepstream", "config": "c",
                        "pipelines": {"a": {"config": "a"}}}])
    assert info.value.code == "bad_config" and "not both" in info.value.message
    with pytest.raises(AgentError) as info:
        handoff.parse([{"type": "deepstream", "pipelines": {"a": {"config": "x"},
                                                            "b": {"config": "x"}}}])
    assert info.value.code == "bad_config" and "of its own per name" in info.value.message
    (entry,) = handoff.parse([{"type": "deepstream", "models": ["detector"],
                               "config": str(tmp_path / "pgie.txt")}])
    with pytest.raises(AgentError) as info:
        entry.adapter.prepare(version(tmp_path, "other", "v1"), None)
    assert info.value.code == "no_pipeline" and "(detector)" in info.value.message


def test_on_the_fly_update_keeps_the_engines_io(tmp_path):
    adapter = deepstream.from_config({"pipelines": {"detector": {
        "config": str(tmp_path / "pgie.txt"), "override": str(tmp_path / "ota" / "o.txt")}}},
        "h")
    v1, v2 = version(tmp_path, "detector", "v1"), version(tmp_path, "detector", "v2")
    adapter.prepare(v2, v1)  # same inputs and outputs: fine
    meta = json.loads(json.dumps(v2.meta))
    meta["outputs"][0]["shape"] = [1, 20]
    with pytest.raises(AgentError) as info:
        adapter.prepare(ModelVersion(v2.name, v2.version, v2.path, v2.engine, meta), v1)
    assert info.value.code == "incompatible_engine"
    assert "detector@v1: inputs" in info.value.message and "[1, 20]" in info.value.message


def test_grpc_model_control_messages_are_triton_protobuf():
    from agent.device.handoff import triton_grpc
    # RepositoryModelLoadRequest{model_name: "det"}: field 2, length 3.
    assert triton_grpc.request("det") == b"\x12\x03det"
    # ... plus parameters{"config": {string_param: "{}"}}: field 3 holding a map entry.
    assert triton_grpc.request("det", "{}") == (
        b"\x12\x03det" + b"\x1a\x0e" + b"\x0a\x06config" + b"\x12\x04" + b"\x1a\x02{}")
    long = triton_grpc.request("m", "x" * 300)  # lengths above 127 take two varint bytes
    assert b"\x1a\xac\x02" in long


def test_by_default_the_previous_version_stays_on_disk_but_is_not_listed(tmp_path):
    adapter = triton.from_config({"repository": str(tmp_path / "repo")}, "handoff[0]")
    assert (adapter.keep_versions, adapter.loaded_versions) == (2, 1)
    v1, v2, v3 = (version(tmp_path, "detector", v) for v in ("v1", "v2", "v3"))
    model_dir = tmp_path / "repo" / "detector"
    for new, previous in ((v1, None), (v2, v1), (v3, v2)):
        adapter.prepare(new, previous)
        adapter.switch(new, previous)
        adapter.commit(new, previous)
    assert "versions: [ 3 ]" in (model_dir / "config.pbtxt").read_text()
    assert sorted(os.listdir(str(model_dir))) == ["2", "3", "config.pbtxt", triton.MAP_FILE]
    adapter.revert(v2, v3)  # the kept version: listed again from its folder, none added
    assert "versions: [ 2 ]" in (model_dir / "config.pbtxt").read_text()
    assert sorted(os.listdir(str(model_dir))) == ["2", "config.pbtxt", triton.MAP_FILE]


def test_a_pending_version_does_not_count_against_keep_versions(tmp_path):
    adapter = triton.from_config({"repository": str(tmp_path / "repo")}, "handoff[0]")
    v1, v2, v3, v4 = (version(tmp_path, "detector", v) for v in ("v1", "v2", "v3", "v4"))
    model_dir = tmp_path / "repo" / "detector"

    def on_disk():
        return {e["triton"]: e["version"] for e in adapter.read_map("detector")
                if (model_dir / str(e["triton"])).is_dir()}

    for new, previous in ((v1, None), (v2, v1)):
        adapter.prepare(new, previous)
        adapter.switch(new, previous)
        adapter.commit(new, previous)
    adapter.prepare(v3, v2)
    adapter.switch(v3, v2)  # pending: keep_versions (2) committed ones stay beside it
    assert on_disk() == {1: "v1", 2: "v2", 3: "v3"}
    assert "versions: [ 3 ]" in (model_dir / "config.pbtxt").read_text()
    adapter.revert(v2, v3)  # refused: both rollback targets are still there
    assert on_disk() == {1: "v1", 2: "v2"}
    assert "versions: [ 2 ]" in (model_dir / "config.pbtxt").read_text()
    adapter.prepare(v1, v2)  # the operator's rollback to v1: a fresh folder, the old one goes
    adapter.switch(v1, v2)
    assert on_disk() == {2: "v2", 3: "v1"}
    adapter.commit(v1, v2)
    adapter.prepare(v4, v1)
    adapter.switch(v4, v1)
    assert on_disk() == {2: "v2", 3: "v1", 4: "v4"}
    adapter.commit(v4, v1)  # committed: it counts now, the oldest goes
    assert on_disk() == {3: "v1", 4: "v4"}
    assert "versions: [ 4 ]" in (model_dir / "config.pbtxt").read_text()


def test_the_warmup_sample_takes_the_profiles_opt_shape():
    meta = {"inputs": [{"name": "x", "shape": [-1, 3, -1, -1], "dtype": "float32"}],
            "outputs": [{"name": "y", "shape": [-1, 10], "dtype": "float32"}],
            "profiles": [{"inputs": {"x": {"min": [1, 3, 32, 32], "opt": [4, 3, 64, 64],
                                           "max": [8, 3, 128, 128]}}}]}
    assert triton.warmup_inputs(meta) == [("x", "float32", [4, 3, 64, 64])]
    doc = triton.config_doc("m", meta, [1], max_batch_size=8)
    assert doc["model_warmup"] == [{"name": "zeros", "batch_size": 1, "inputs": {
        "x": {"data_type": "TYPE_FP32", "dims": [3, 64, 64], "zero_data": True}}}]
    body, length = triton.warmup_request(meta)
    assert len(body) - length == 4 * 3 * 64 * 64 * 4  # the request of zeros, the same shape
    too_big = dict(meta, profiles=[{"inputs": {"x": {"opt": [64, 3, 1024, 1024]}}}])
    assert triton.warmup_inputs(too_big) is None  # over 64 MiB: no sample, ready alone
    assert "model_warmup" not in triton.config_doc("m", too_big, [1], max_batch_size=8)
