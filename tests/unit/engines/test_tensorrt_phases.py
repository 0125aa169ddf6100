"""trtexec's phase split (Enqueue / H2D / GPU Compute / D2H) on the tensorrt backend, against
the version-faithful fakes on every profile: the fake pycuda's device clock advances by a known
cost per queued copy and per execution, so the CUDA-event phases are exact numbers."""

import gc
import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from agent import cli
from agent.engines.backends import tensorrt as trt_backend
from agent.engines.backends import tensorrt_network
from agent.engines.backends.base import BuildPlan
from agent.errors import AgentError
from tests import fake_trt
from tests.models import fp16_max_model

TRTEXEC_LINES = ["Enqueue Time", "H2D Latency", "GPU Compute Time", "D2H Latency"]


@pytest.fixture(autouse=True)
def _fresh_logger(monkeypatch):
    monkeypatch.setattr(tensorrt_network, "_LOGGER", None)


def _two_in_two_out():
    """a, b: float32[2, 3] -> s = a + b, d = a - b (two input and two output copies)."""
    nodes = [helper.make_node("Add", ["a", "b"], ["s"], name="Add"),
             helper.make_node("Sub", ["a", "b"], ["d"], name="Sub")]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in "absd"]
    graph = helper.make_graph(nodes, "two_by_two", io[:2], io[2:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _engine(monkeypatch, tmp_path, profile, model=None):
    trt, cuda = fake_trt.install(monkeypatch, profile)
    path = str(tmp_path / "m.onnx")
    onnx.save(model if model is not None else fp16_max_model(), path)
    backend = trt_backend.TensorRTBackend(trt.__version__)
    result = backend.build(path, BuildPlan(precision="fp32"), str(tmp_path / "m.engine"))
    return backend, result.engine_path, cuda


def _bench(engine, *extra):
    return cli.main(["bench", engine, "--backend", "tensorrt", "--iterations", "3",
                     "--duration", "0", "--warm-up", "0"] + list(extra))


@pytest.mark.parametrize("profile", fake_trt.PROFILES)
def test_bench_reports_trtexec_phases_on_every_profile(monkeypatch, tmp_path, capsys, profile):
    _, engine, _ = _engine(monkeypatch, tmp_path, profile)
    assert _bench(engine, "--json") == 0
    phases = json.loads(capsys.readouterr().out)["benchmark"]["phases_ms"]
    assert sorted(phases) == ["compute", "d2h", "enqueue", "h2d"]
    # The fake GPU: 0.25 ms per input copy, 0.5 ms per execution, 0.25 ms per output copy.
    assert [phases[k]["median"] for k in ("h2d", "compute", "d2h")] == [0.25, 0.5, 0.25]
    assert phases["compute"]["cov"] == 0.0 and phases["enqueue"]["min"] >= 0.0

    assert _bench(engine) == 0
    names = [line.split(":")[0] for line in capsys.readouterr().out.splitlines()]
    at = names.index("Enqueue Time")
    assert names[at:at + 4] == TRTEXEC_LINES
    assert "GPU Time (H2D + compute + D2H)" not in names  # the split replaces the total


@pytest.mark.parametrize("profile", ["8.2", "10.13"])  # bindings API, tensor-name API
def test_each_copy_is_inside_its_phase(monkeypatch, tmp_path, profile):
    backend, engine, cuda = _engine(monkeypatch, tmp_path, profile, _two_in_two_out())
    cuda.cost_ms.update(htod=0.5, execute=2.0, dtoh=0.125)
    feeds = {"a": np.ones((2, 3), np.float32), "b": np.ones((2, 3), np.float32)}
    with backend.open(engine) as runner:
        rows = runner.time_phases(2, feeds)
        assert [{k: r[k] for k in ("h2d", "compute", "d2h")} for r in rows] == [
            {"h2d": 1.0, "compute": 2.0, "d2h": 0.25}] * 2
        # The split adds up to what time_inference measures around the whole inference.
        assert runner.time_inference(1) == [3.25]
        assert runner.infer(feeds)["s"].shape == (2, 3)


def test_enqueue_is_the_host_time_of_the_execute_call(monkeypatch):
    _, cuda = fake_trt.install(monkeypatch, "10.3")
    from agent.engines.backends.cuda_buffers import EventTimer

    host = [0.0]

    def clock():
        return host[0]

    def execute():
        host[0] += 0.004  # 4 ms on the host to queue it
        cuda.advance("execute")

    timer = EventTimer(cuda.Stream())
    rows = timer.time_phases(lambda: cuda.advance("htod"), execute,
                             lambda: cuda.advance("dtoh"), 2, clock=clock)
    assert rows == [{"enqueue": 4.0, "h2d": 0.25, "compute": 0.5, "d2h": 0.25}] * 2
    with pytest.raises(AgentError) as err:
        timer.time_phases(execute, execute, execute, 0)
    assert err.value.code == "bad_argument" and "found 0" in err.value.message


def test_time_phases_needs_feeds_and_an_open_runner(monkeypatch, tmp_path):
    backend, engine, cuda = _engine(monkeypatch, tmp_path, "8.6")
    runner = backend.open(engine)
    with pytest.raises(AgentError) as err:
        runner.time_phases(1)
    assert err.value.code == "bad_argument" and "time_phases needs feeds" in err.value.message
    feeds = {"x": np.ones((1, 1, 4, 4), np.float32)}
    assert len(runner.time_phases(1, feeds)) == 1
    assert len(runner.time_phases(2)) == 2  # the feeds given last
    runner.close()
    with pytest.raises(AgentError) as err:
        runner.time_phases(1, feeds)
    assert "is closed" in err.value.message
    del runner
    gc.collect()
    assert cuda.leaked == [] and cuda.live_objects == 0  # the phase events are freed too
