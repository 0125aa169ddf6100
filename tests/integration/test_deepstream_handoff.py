"""DeepStream as it runs, through the daemon: two model names, each with its own pipeline
(nvinfer config; one with deepstream-test5's override file), never sharing an engine path; a
name with no pipeline refused (``no_pipeline``, naming the configured ones); an on-the-fly
update to an engine with other inputs/outputs refused (``incompatible_engine``, both signatures
named) with the running files untouched. The override file starts as the regular file test5 was
started with; a watcher reacting to exactly the inotify events test5 reacts to (close-after-write
of the file, a rename onto ``..data``: deepstream_test5_app_main.c) sees every update, the first
included. No DeepStream runs on these hosts: the engines are the host backend's."""

import ctypes
import ctypes.util
import json
import os
import struct
import sys
import threading

import numpy as np
import onnxruntime as ort
import pytest

from agent.wire import protocol
from tests.integration.test_daemon_deploy import deploy_doc
from tests.integration.test_named_models import named
from tests.models import fp16_max_model, save

pytestmark = pytest.mark.slow

IN_CLOSE_WRITE, IN_MOVED_TO = 0x08, 0x80


class OverrideWatcher:
    """What deepstream-test5 does with ``-o FILE``: inotify on FILE's folder; on a close-after-
    write of FILE's name or a rename onto ``..data``, read FILE and apply its model-engine-file."""

    def __init__(self, path):
        self.path = path
        self.seen = []
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = self.libc.inotify_init()
        assert self.fd >= 0
        assert self.libc.inotify_add_watch(self.fd, os.path.dirname(path).encode(),
                                           IN_CLOSE_WRITE | IN_MOVED_TO) >= 0
        self.read_end, self.write_end = os.pipe()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        import select
        name = os.path.basename(self.path)
        while True:
            ready, _, _ = select.select([self.fd, self.read_end], [], [])
            if self.read_end in ready:
                return
            data = os.read(self.fd, 65536)
            offset = 0
            while offset < len(data):
                _wd, mask, _cookie, length = struct.unpack_from("iIII", data, offset)
                event = data[offset + 16:offset + 16 + length].rstrip(b"\0").decode()
                offset += 16 + length
                if (mask & IN_CLOSE_WRITE and event == name) or \
                        (mask & IN_MOVED_TO and event == "..data"):
                    try:
                        text = open(self.path).read()
                    except OSError:
                        continue
                    engines = [line.split("=", 1)[1] for line in text.splitlines()
                               if line.startswith("model-engine-file=")]
                    self.seen.append(engines[0] if engines else None)

    def close(self):
        os.write(self.write_end, b"x")
        self.thread.join(10)
        os.close(self.fd)


def engine_in(config):
    for line in open(config).read().splitlines():
        if line.startswith("model-engine-file="):
            return line.split("=", 1)[1]
    return None


@pytest.fixture
def other_io_files(tmp_path):
    """A model whose inputs and outputs differ from digits' (x: [1,1,4,4] -> y)."""
    model = save(fp16_max_model(4), tmp_path / "other.onnx")
    x = np.random.RandomState(0).rand(1, 1, 4, 4).astype(np.float32)  # the model's one batch
    y = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    np.savez(str(tmp_path / "inputs.npz"), x=x)
    np.savez(str(tmp_path / "goldens.npz"), y=y)
    return {"model": model, "inputs": str(tmp_path / "inputs.npz"),
            "goldens": str(tmp_path / "goldens.npz")}


def test_two_names_each_their_own_pipeline_and_the_io_check(controller, agent_factory,
                                                            digits_files, other_io_files,
                                                            tmp_path):
    app = tmp_path / "app"
    override = app / "a" / "ota" / "override.txt"
    override.parent.mkdir(parents=True)
    override.write_text("[primary-gie]\nenable=0\n")  # what test5 was started with
    (app / "b").mkdir()
    pipelines = {"det-a": {"config": str(app / "a" / "pgie.txt"), "override": str(override)},
                 "det-b": {"config": str(app / "b" / "pgie.txt")}}
    probe = [sys.executable, "-c", "pass"]  # the app's own check: always fine here
    extra = ("models:\n  probe: {}\nhandoff:\n  - type: deepstream\n"
             "    models: [det-a, det-b, det-c]\n    pipelines: {}\n").format(
                 json.dumps(probe), json.dumps(pipelines))
    watcher = OverrideWatcher(str(override))
    agent = agent_factory(extra_config=extra).start()
    try:
        controller.wait_online()
        models = os.path.join(agent.state_dir, "models")
        for i, name in enumerate(("det-a", "det-b")):
            named(controller, digits_files, "ds-{}".format(i), name, "v1")
            done = controller.wait_state("ds-{}".format(i), protocol.TERMINAL_STATES,
                                         timeout=180)
            assert done["state"] == "SUCCEEDED", (done, agent.log_tail())
        engine_a = os.path.join(models, "det-a", "v1", "model.engine")
        engine_b = os.path.join(models, "det-b", "v1", "model.engine")
        assert engine_in(pipelines["det-a"]["config"]) == engine_a
        assert engine_in(pipelines["det-b"]["config"]) == engine_b  # its own, not det-a's
        assert engine_in(str(override)) == engine_a
        controller.wait_for(lambda: engine_a in watcher.seen or None, 20,
                            "test5 to see the first update")

        named(controller, digits_files, "ds-c", "det-c", "v1")  # no pipeline for det-c
        done = controller.wait_state("ds-c", protocol.TERMINAL_STATES, timeout=180)
        assert done["state"] == "FAILED" and done["error"]["code"] == "handoff_failed", done
        assert done["error"]["details"]["cause"] == "no_pipeline"
        assert "det-a, det-b" in done["error"]["message"], done

        doc = deploy_doc(controller, other_io_files, "ds-a2", precision="fp32",
                         model_name="det-a", model_version="v2")
        doc["bench"] = {"iterations": 5, "warmup": 1}
        controller.send_job(doc)
        done = controller.wait_state("ds-a2", protocol.TERMINAL_STATES, timeout=180)
        assert done["state"] == "FAILED", (done, agent.log_tail())
        assert done["error"]["details"]["cause"] == "incompatible_engine", done
        message = done["error"]["message"]
        assert "det-a@v1: inputs input float32" in message, message  # the running engine's
        assert "inputs x float32 [1, 1, 4, 4]" in message, message  # and the refused one's
        assert engine_in(pipelines["det-a"]["config"]) == engine_a  # untouched
        assert engine_in(str(override)) == engine_a
        assert os.readlink(os.path.join(models, "det-a", "current")) == "v1"
        seen = list(watcher.seen)

        named(controller, digits_files, "ds-a3", "det-a", "v3")  # same inputs and outputs
        done = controller.wait_state("ds-a3", protocol.TERMINAL_STATES, timeout=180)
        assert done["state"] == "SUCCEEDED", (done, agent.log_tail())
        engine_a3 = os.path.join(models, "det-a", "v3", "model.engine")
        controller.wait_for(lambda: engine_a3 in watcher.seen or None, 20,
                            "test5 to see the on-the-fly update")
        assert set(watcher.seen) <= {None, engine_a, engine_a3} and engine_a3 not in seen
        assert engine_in(pipelines["det-b"]["config"]) == engine_b
        assert agent.stop() == 0
    finally:
        watcher.close()
