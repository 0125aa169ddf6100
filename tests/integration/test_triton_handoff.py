"""The Triton hand-off against a real ``tritonserver`` (explicit model control mode).

v1 loads and is ready; v2 is prepared and loaded while v1 keeps answering (no failed request),
then v2 answers and v1 is unloaded but kept on disk; going back to v1 gets a fresh, higher
Triton version; a broken v3 fails to load and Triton keeps serving v2 (confirm() False),
revert() lists v2 alone again; revert() with no previous version unloads. The repository
holds ``backend: python`` versions whose model.py serves the host's emulated engine (ONNX)
through onnxruntime: no TensorRT backend runs here (the production ``tensorrt_plan`` config is
checked against golden files in tests/unit/device/test_handoff_adapters.py).
"""

import json
import os
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.device.handoff.base import ModelVersion
from agent.device.handoff.triton import from_config
from agent.errors import AgentError
from tests.integration.triton_server import TritonServer, unavailable

X = [1.0, 2.0, 3.0, 4.0]


def scale_model(k, width=4):
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])], "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])],
        [numpy_helper.from_array(np.array(k, dtype=np.float32), "k")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def make_version(models_dir, version, engine_bytes, input_shape=(1, 4)):
    path = models_dir / "det" / version
    path.mkdir(parents=True)
    (path / "model.engine").write_bytes(engine_bytes)
    meta = {"name": "det", "version": version,
            "inputs": [{"name": "x", "shape": list(input_shape), "dtype": "float32"}],
            "outputs": [{"name": "y", "shape": [1, 4], "dtype": "float32"}]}
    (path / "meta.json").write_text(json.dumps(meta))
    return ModelVersion("det", version, str(path), str(path / "model.engine"), meta)


@pytest.fixture
def triton(tmp_path):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    repo = tmp_path / "repo"
    repo.mkdir()
    server = TritonServer(tmp_path, repo)
    try:
        server.start()
    except RuntimeError as exc:
        if "while loading shared libraries" in str(exc) or "GLIBC" in str(exc):
            pytest.skip("tritonserver cannot run on this system: {}".format(exc))
        raise
    try:
        yield server
    finally:
        server.stop()


def infer(url):
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                                   "data": X}]}).encode()
    request = urllib.request.Request(url + "/v2/models/det/infer", data=body, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        doc = json.loads(response.read())
    y = doc["outputs"][0]["data"]
    return round(y[0] / X[0], 3), doc["model_version"]


class Load:
    """Infer requests in a loop on a thread until stopped (bounded: at most 20000)."""

    def __init__(self, url):
        self.url = url
        self.stop = threading.Event()
        self.served = []
        self.failures = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        for _ in range(20000):
            if self.stop.is_set():
                return
            try:
                self.served.append(infer(self.url)[0])
            except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
                self.failures.append(repr(exc))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join(30)


@pytest.mark.slow
def test_versions_switch_under_load_and_a_broken_one_is_refused(triton, tmp_path):
    models = tmp_path / "models"
    v1 = make_version(models, "v1", scale_model(1.0).SerializeToString())
    v2 = make_version(models, "v2", scale_model(2.0).SerializeToString())
    v3 = make_version(models, "v3", b"not an engine at all")
    adapter = from_config({"repository": triton.repository, "url": triton.url,
                           "backend": "python", "timeout_s": 30}, "handoff[0]")

    adapter.prepare(v1, None)
    adapter.switch(v1, None)
    assert adapter.confirm(v1) is True, triton.tail()
    assert infer(triton.url) == (1.0, "1")

    with Load(triton.url) as load:
        adapter.prepare(v2, v1)
        assert infer(triton.url)[0] == 1.0  # prepare touches nothing being served
        adapter.switch(v2, v1)
        assert adapter.confirm(v2) is True, triton.tail()
        assert infer(triton.url) == (2.0, "2")
    assert load.failures == []
    assert 1.0 in load.served and load.served[-1] == 2.0
    config = open(os.path.join(triton.repository, "det", "config.pbtxt")).read()
    assert "versions: [ 2 ]" in config  # Triton holds one version (loaded_versions 1) ...
    assert not adapter.ready("det", 1)
    assert "1" in os.listdir(os.path.join(triton.repository, "det"))  # ... v1 stays on disk

    # Rolling back to an older version: a fresh, higher Triton version serves it.
    adapter.prepare(v1, v2)
    adapter.switch(v1, v2)
    assert adapter.confirm(v1) is True
    assert infer(triton.url) == (1.0, "3")
    adapter.prepare(v2, v1)
    adapter.switch(v2, v1)
    assert adapter.confirm(v2) is True
    assert infer(triton.url) == (2.0, "4")
    mapping = json.load(open(os.path.join(triton.repository, "det",
                                          "jetson-agent-versions.json")))
    assert [(e["triton"], e["version"]) for e in mapping["versions"]] == [(3, "v1"), (4, "v2")]
    assert sorted(os.listdir(os.path.join(triton.repository, "det"))) == [
        "3", "4", "config.pbtxt", "jetson-agent-versions.json"]

    with Load(triton.url) as load:
        adapter.prepare(v3, v2)
        adapter.switch(v3, v2)  # Triton refuses the load ...
        with pytest.raises(AgentError) as info:
            adapter.confirm(v3)
        assert "load failed" in info.value.message or "UNAVAILABLE" in info.value.message
        assert "load failed" in adapter.last_error(v3) or "UNAVAILABLE" in adapter.last_error(v3)
        assert infer(triton.url) == (2.0, "4")  # ... and keeps serving v2
        adapter.revert(v2, v3)
        assert adapter.ready("det", 4)
        assert infer(triton.url) == (2.0, "4")
    assert load.failures == [] and set(load.served) == {2.0}
    config = open(os.path.join(triton.repository, "det", "config.pbtxt")).read()
    assert "versions: [ 4 ]" in config
    assert "5" not in os.listdir(os.path.join(triton.repository, "det"))

    adapter.revert(None, v2)  # nothing to go back to: unloaded
    assert not adapter.ready("det", 4)
    assert not os.path.exists(os.path.join(triton.repository, "det"))
