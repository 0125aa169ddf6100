"""Hostile job inputs against a real daemon (real Mosquitto, onnxruntime backend): each is
REJECTED (or FAILED out_of_memory) with its stable code and the numbers, and a genuine job
still completes within 30 s of each attack.

- decompression bombs: a golden .npz inflating to 2 GiB (deflate, about 2 MB on the wire),
  one lying about its size, a calibration .npz with a bzip2 member declaring 8 GiB;
- lying headers: .npz members claiming 10^12 rows;
- pickled labels, JSON nested 100,000 deep;
- a worker memory ceiling catching what the inflate caps were told to let through;
- external tensor data naming the worker's own files (job.json), in a Constant attribute;
- inputs of (2^31-1)^2 elements, and a dynamic model benchmarked at the job's shapes.

Measured times (attack end to the genuine job's SUCCEEDED) are printed for
docs/reliability.md.
"""

import os
import pickle
import stat
import time

import onnx
import pytest
from onnx import TensorProto, helper

from agent.engines import model_check
from agent.wire import protocol
from tests import bombs

GENUINE_S = 30
BENCH = {"iterations": 5, "warmup": 0}
TIMES = {}


def final(controller, job_id, timeout=90):
    return controller.wait_state(job_id, protocol.TERMINAL_STATES, timeout)


def genuine(controller, model, tag):
    """A real bench job after an attack: SUCCEEDED within 30 s; returns the seconds."""
    start = time.monotonic()
    job_id = "genuine-" + tag
    controller.send_job({"job_id": job_id, "kind": "bench", "artifacts": {"model": model},
                         "plan": {"precision": "fp32"}, "bench": BENCH})
    msg = final(controller, job_id, GENUINE_S)
    assert msg["state"] == "SUCCEEDED", msg
    TIMES[tag] = time.monotonic() - start
    return TIMES[tag]


def attack(controller, job_id, doc, state, code, *needles):
    controller.send_job(dict(doc, job_id=job_id))
    msg = final(controller, job_id)
    assert msg["state"] == state and msg["error"]["code"] == code, msg
    for needle in needles:
        assert needle in msg["error"]["message"], msg["error"]["message"]
    protocol.validate("job_status", msg)
    return msg


def assert_clean(controller, agent):
    """Nothing lost or broken: the daemon lives, its outbox is empty (every status reached the
    controller), its store is sound and its log holds no traceback."""
    assert agent.alive()
    diag = controller.diag()
    assert diag["ok"] and diag["result"]["outbox"] == 0, diag
    agent.assert_store_sound()
    assert "Traceback" not in agent.log_tail(10 ** 7)


def rss_kb(pid):
    with open("/proc/{}/status".format(pid)) as f:
        return int([line.split()[1] for line in f if line.startswith("VmRSS")][0])


def test_bombs_lying_headers_pickles_and_deep_json(controller, agent_factory, digits_files,
                                                   tmp_path):
    agent = agent_factory().start()
    controller.wait_online()
    files = {role: controller.add_artifact(path) for role, path in digits_files.items()}
    model = files["model"]
    pickled = tmp_path / "labels.npy"
    pickled.write_bytes(pickle.dumps(list(range(10))))
    nested = tmp_path / "inputs.json"
    nested.write_text("[" * 100000 + "]" * 100000)
    int8 = {"precision": "int8", "calibration": {"algorithm": "minmax"}}
    deploy = {"kind": "deploy", "plan": {"precision": "fp32"}, "bench": BENCH}
    add = controller.add_artifact
    cases = [
        ("golden-deflate-2gib", dict(deploy, artifacts=dict(
            model=model, inputs=files["inputs"],
            goldens=add(bombs.deflate_bomb(tmp_path / "g1.npz", total=2048 * bombs.MIB)))),
         "bad_golden_file", ["2,147,483,520 bytes", "limits.inflate_ratio"]),
        ("golden-deflate-lying", dict(deploy, artifacts=dict(
            model=model, inputs=files["inputs"],
            goldens=add(bombs.deflate_bomb(tmp_path / "g2.npz", total=256 * bombs.MIB,
                                           honest=False)))),
         "bad_golden_file", ["inflates to more than the 192 bytes"]),
        ("calib-bzip2-8gib", dict(deploy, plan=int8, artifacts=dict(
            model=model, calibration=add(bombs.bzip2_bomb(tmp_path / "c1.npz", name="input",
                                                          actual=4 * bombs.MIB)))),
         "bad_calibration_data", ["8,589,934,592 bytes"]),
        ("calib-rows-1e12", dict(deploy, plan=int8, artifacts=dict(
            model=model, calibration=add(bombs.lying_rows(tmp_path / "c2.npz", row=(64,))))),
         "bad_calibration_data", ["1000000000000"]),
        ("inputs-rows-1e12", dict(deploy, kind="bench", artifacts=dict(
            model=model, inputs=add(bombs.lying_rows(tmp_path / "i1.npz", row=(64,))))),
         "bad_golden_file", ["1000000000000"]),
        ("labels-pickle", dict(deploy, artifacts=dict(files, labels=add(pickled))),
         "bad_golden_file", ["pickle"]),
        ("inputs-nested-json", dict(deploy, kind="bench", artifacts=dict(
            model=model, inputs=add(nested))), "bad_golden_file", ["nested deeper"]),
    ]
    for job_id, doc, code, needles in cases:
        attack(controller, job_id, doc, "REJECTED", code, *needles)
        genuine(controller, model, job_id)
    assert_clean(controller, agent)
    print("\nhostile inputs: seconds to a genuine job after each attack:",
          {k: round(v, 2) for k, v in sorted(TIMES.items())},
          "daemon RSS {} kB".format(rss_kb(agent.proc.pid)))


def test_memory_ceiling_ends_a_blow_up_as_out_of_memory(controller, agent_factory,
                                                        digits_files, tmp_path):
    # The inflate caps are opened wide on purpose: the worker's RLIMIT_DATA must catch it.
    agent = agent_factory(extra_config=(
        "limits:\n  max_data_bytes: 4GiB\n  inflate_ratio: 100000\n"
        "  worker_memory_bytes: 700MiB\n")).start()
    controller.wait_online()
    files = {role: controller.add_artifact(path) for role, path in digits_files.items()}
    bomb = controller.add_artifact(bombs.deflate_bomb(tmp_path / "g.npz",
                                                      total=1024 * bombs.MIB))
    before = rss_kb(agent.proc.pid)
    msg = attack(controller, "oom", {"kind": "deploy", "plan": {"precision": "fp32"},
                                     "artifacts": dict(files, goldens=bomb)},
                 "FAILED", "out_of_memory", "734,003,200 bytes (limits.worker_memory_bytes)")
    assert msg["error"]["details"]["limit_bytes"] == 700 << 20
    # A genuine deploy (build, gate, bench) fits under the same ceiling.
    controller.send_job({"job_id": "deploy-ok", "kind": "deploy", "artifacts": files,
                         "plan": {"precision": "fp32"}, "bench": BENCH})
    assert final(controller, "deploy-ok", GENUINE_S)["state"] == "SUCCEEDED"
    genuine(controller, files["model"], "out-of-memory")
    assert rss_kb(agent.proc.pid) < before + 50 * 1024
    assert_clean(controller, agent)
    print("\nout_of_memory: daemon RSS {} -> {} kB; genuine job {:.2f} s after".format(
        before, rss_kb(agent.proc.pid), TIMES["out-of-memory"]))


def test_external_data_naming_the_workers_files_is_refused(controller, agent_factory,
                                                           digits_files, tmp_path):
    agent = agent_factory().start()
    controller.wait_online()
    genuine_model = controller.add_artifact(digits_files["model"])
    for job_id, key, location, needle in (
            ("ext-constant-job-json", "c", "job.json", "not an artifact of this job"),
            ("ext-if-body-log", "t", "worker.log", "not an artifact of this job"),
            ("ext-loop-body-traversal", "b", "../../journal.db", "no '..'"),
            ("ext-sparse-absolute", "s", "/etc/hostname", "no absolute path")):
        folder = tmp_path / job_id
        path, _ = bombs.external_data_model(folder, {key: location}, inline_others=True)
        attack(controller, job_id, {"kind": "deploy", "plan": {"precision": "fp32"},
                                    "artifacts": {"model": controller.add_artifact(path)}},
               "REJECTED", "bad_model", needle)
        genuine(controller, genuine_model, job_id)
    # The same graph with its weights inside deploys, and its cached engine names no file.
    path, _ = bombs.external_data_model(tmp_path / "whole")
    from agent.engines.backends import onnx_model

    whole = tmp_path / "whole.onnx"
    whole.write_bytes(onnx_model.load_model(path).SerializeToString())
    controller.send_job({"job_id": "ext-inlined", "kind": "deploy", "bench": BENCH,
                         "plan": {"precision": "fp32"},
                         "artifacts": {"model": controller.add_artifact(whole)}})
    assert final(controller, "ext-inlined")["state"] == "SUCCEEDED"
    engines = [os.path.join(d, n) for d, _, names in os.walk(agent.state_dir) for n in names
               if "engines" in d and n.startswith("engine")]
    assert engines
    for engine in engines:
        assert model_check.is_self_contained(onnx.load(engine, load_external_data=False))
    assert_clean(controller, agent)


def _model(path, dims):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g",
                              [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


def test_huge_shapes_are_refused_and_job_shapes_are_benchmarked(controller, agent_factory,
                                                                 digits_files, tmp_path):
    agent = agent_factory().start()
    controller.wait_online()
    genuine_model = controller.add_artifact(digits_files["model"])
    huge = 2 ** 31 - 1
    static = controller.add_artifact(_model(tmp_path / "static.onnx", [huge, huge]))
    dynamic = controller.add_artifact(_model(tmp_path / "dynamic.onnx", ["n", "d"]))
    bench = {"kind": "bench", "plan": {"precision": "fp32"}, "bench": BENCH}
    attack(controller, "static-huge", dict(bench, artifacts={"model": static}), "REJECTED",
           "bad_model", "shape [2147483647, 2147483647]", "limits.max_data_bytes")
    genuine(controller, genuine_model, "static-huge")
    shapes = {"x": [[1, 1], [huge, huge], [huge, huge]]}
    attack(controller, "shapes-huge", dict(bench, artifacts={"model": dynamic},
                                           plan={"precision": "fp32", "shapes": shapes}),
           "REJECTED", "bad_argument", "18,446,744,056,529,682,436 bytes")
    genuine(controller, genuine_model, "shapes-huge")
    # Before: FAILED/REJECTED dynamic_shape. Now the profile's opt shape is benchmarked.
    controller.send_job(dict(bench, job_id="dynamic-shapes", artifacts={"model": dynamic},
                             plan={"precision": "fp32",
                                   "shapes": {"x": [[1, 4], [3, 8], [8, 16]]}}))
    msg = final(controller, "dynamic-shapes")
    assert msg["state"] == "SUCCEEDED", msg
    assert msg["result"]["bench"]["batch"] == 3
    assert_clean(controller, agent)


def test_a_native_allocation_failure_is_out_of_memory(controller, agent_factory, digits_files,
                                                      tmp_path):
    # What onnxruntime or TensorRT leave when an allocation fails in C++: std::bad_alloc, abort.
    worker = tmp_path / "bad-alloc-python"
    worker.write_text("#!/bin/sh\necho \"terminate called after throwing an instance of "
                      "'std::bad_alloc'\" >&2\nkill -ABRT $$\n")
    worker.chmod(worker.stat().st_mode | stat.S_IXUSR)
    agent = agent_factory(extra_config="worker_python: {}\nlimits:\n  worker_memory_bytes: "
                                       "1GiB\n".format(worker)).start()
    controller.wait_online()
    model = controller.add_artifact(digits_files["model"])
    attack(controller, "bad-alloc", {"kind": "bench", "artifacts": {"model": model},
                                     "plan": {"precision": "fp32"}, "bench": BENCH},
           "FAILED", "out_of_memory", "SIGABRT", "1,073,741,824 bytes")
    assert_clean(controller, agent)


@pytest.fixture(autouse=True, scope="module")
def _report():
    yield
    if TIMES:
        print("\nhostile inputs: worst time to a genuine job after an attack: {:.2f} s over "
              "{} attacks".format(max(TIMES.values()), len(TIMES)))
