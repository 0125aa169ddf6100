"""Cancel and timeout stop a running precision search cleanly (the worker is gone, the state is
CANCELED / TIMED_OUT with a stable code); cancelling a queued job, an unknown job and a finished
job answer as documented. The search runs on a deep MLP (40 Gemm+Tanh layers) whose linear
search takes ~10 s, so it is surely running when the cancel arrives."""

import os
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from agent.wire import protocol


def deep_mlp(layers=40, width=128, seed=0):
    rng = np.random.RandomState(seed)
    nodes, inits, prev = [], [], "input"
    for i in range(layers):
        w = (rng.randn(width, width) / np.sqrt(width)).astype(np.float32)
        b = (rng.randn(width) * 0.1).astype(np.float32)
        wname, bname = "w{}".format(i), "b{}".format(i)
        inits += [numpy_helper.from_array(w, wname), numpy_helper.from_array(b, bname)]
        nodes.append(helper.make_node("Gemm", [prev, wname, bname], ["g{}".format(i)],
                                      name="fc{}".format(i)))
        prev = "g{}".format(i)
        if i < layers - 1:
            nodes.append(helper.make_node("Tanh", [prev], ["t{}".format(i)],
                                          name="act{}".format(i)))
            prev = "t{}".format(i)
    graph = helper.make_graph(
        nodes, "deep",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", width])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


@pytest.fixture(scope="module")
def deep_files(tmp_path_factory):
    import onnxruntime as ort

    d = tmp_path_factory.mktemp("deep")
    model = deep_mlp()
    onnx.save(model, str(d / "deep.onnx"))
    x = np.random.RandomState(1).rand(2048, 128).astype(np.float32)
    np.savez(str(d / "calib.npz"), input=x[:256])
    np.savez(str(d / "inputs.npz"), input=x)
    sess = ort.InferenceSession(str(d / "deep.onnx"), providers=["CPUExecutionProvider"])
    out = sess.run(None, {"input": x})[0]
    np.savez(str(d / "goldens.npz"), **{model.graph.output[0].name: out})
    return {"model": str(d / "deep.onnx"), "calibration": str(d / "calib.npz"),
            "inputs": str(d / "inputs.npz"), "goldens": str(d / "goldens.npz")}


def search_doc(controller, files, job_id, **extra):
    doc = {"job_id": job_id, "kind": "search",
           "artifacts": {role: controller.add_artifact(p) for role, p in files.items()},
           "plan": {"precision": "int8", "calibration": {"algorithm": "minmax"}},
           "gate": {"atol": 1e-7, "rtol": 1e-7},
           "search": {"mode": "linear", "direction": "forward"}}
    doc.update(extra)
    return doc


def worker_pid(agent, job_id, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with agent.journal() as journal:
            row = journal.job(job_id)
        if row and row["stage"] == "searching" and row["details"].get("worker_pid"):
            return int(row["details"]["worker_pid"])
        time.sleep(0.1)
    raise AssertionError("the search did not start\n" + agent.log_tail())


def gone(pid):
    try:
        with open("/proc/{}/stat".format(pid)) as f:
            return f.read().split(") ")[1].startswith("Z")  # a zombie has exited
    except OSError:
        return True


def test_cancel_stops_a_running_search(controller, agent_factory, deep_files):
    agent = agent_factory().start()
    controller.send_job(search_doc(controller, deep_files, "search-1"))
    # A deploy queued behind the search, cancelled by a cancel *job*.
    controller.send_job({"job_id": "deploy-q", "kind": "deploy",
                         "artifacts": {"model": controller.add_artifact(deep_files["model"])},
                         "plan": {"precision": "fp32"}})
    pid = worker_pid(agent, "search-1")
    controller.send_job({"job_id": "cancel-q", "kind": "cancel", "cancel": {"job_id": "deploy-q"}})
    assert controller.wait_state("deploy-q", protocol.TERMINAL_STATES, 30)["state"] == "CANCELED"
    done = controller.wait_state("cancel-q", protocol.TERMINAL_STATES, 30)
    assert done["state"] == "SUCCEEDED" and done["result"] == {"job_id": "deploy-q",
                                                                "state": "CANCELED"}
    # The running search, cancelled by a command.
    time.sleep(0.5)
    started = time.monotonic()
    controller.command({"command": "cancel", "request_id": "c1", "job_id": "search-1"})
    final = controller.wait_state("search-1", protocol.TERMINAL_STATES, 30)
    assert final["state"] == "CANCELED", final
    assert final["error"]["code"] == "cancelled"
    assert time.monotonic() - started < 15
    # SIGTERM made the search stop between evaluations and return what it had.
    partial = final["error"]["details"]["partial_result"]
    assert partial["partial"] is True and partial["interrupted"] is True
    controller.wait_for(lambda: gone(pid), 10, "the worker to exit")
    reply = controller.wait_for(
        lambda: next((r for r in controller.replies if r.get("request_id") == "c1"), None), 10,
        "cancel reply")
    assert reply["ok"] is True and reply["result"]["state"] == "CANCELED"
    # Cancelling what cannot be cancelled answers with a stable code.
    controller.command({"command": "cancel", "request_id": "c2", "job_id": "search-1"})
    controller.command({"command": "cancel", "request_id": "c3", "job_id": "no-such-job"})
    r2 = controller.wait_for(
        lambda: next((r for r in controller.replies if r.get("request_id") == "c2"), None), 10,
        "reply c2")
    r3 = controller.wait_for(
        lambda: next((r for r in controller.replies if r.get("request_id") == "c3"), None), 10,
        "reply c3")
    assert not r2["ok"] and r2["error"]["code"] == "bad_state_transition"
    assert not r3["ok"] and r3["error"]["code"] == "unknown_job"
    for msg in controller.replies:
        protocol.validate("command_reply", msg)
    assert controller.diag()["result"]["current_job"] is None
    assert agent.stop() == 0
    assert not os.listdir(os.path.join(agent.state_dir, "work"))  # work files cleaned up


def test_timeout_stops_a_running_search(controller, agent_factory, deep_files):
    agent = agent_factory().start()
    controller.send_job(search_doc(controller, deep_files, "search-t", timeout_s=4))
    pid = worker_pid(agent, "search-t")
    final = controller.wait_state("search-t", protocol.TERMINAL_STATES, 60)
    assert final["state"] == "TIMED_OUT", final
    assert final["error"]["code"] == "job_timed_out"
    controller.wait_for(lambda: gone(pid), 10, "the worker to exit")
    assert agent.alive()


def test_search_runs_to_the_end(controller, agent_factory, digits_files):
    agent_factory().start()
    controller.send_job({
        "job_id": "search-d", "kind": "search",
        "artifacts": {role: controller.add_artifact(p) for role, p in digits_files.items()},
        "plan": {"precision": "int8", "calibration": {"algorithm": "minmax"}},
        "gate": {"atol": 0.5, "rtol": 0.5, "check_error_stat": "mean"},
        "search": {"mode": "bisect"}})
    final = controller.wait_state("search-d", protocol.TERMINAL_STATES, 120)
    assert final["state"] == "SUCCEEDED", final
    result = final["result"]
    assert result["complete"] is True and result["partial"] is False
    assert result["passed"] is True and isinstance(result["keep"], list)
    assert set(result["layers_kept"]) == set(result["keep"])
    assert result["evaluations"] >= 1 and result["engine_key"]
    assert "activated" not in result  # a search does not activate
    protocol.validate("job_status", final)
