"""Bad input is answered with REJECTED or FAILED and a stable code; the daemon carries on.

Malformed JSON, schema violations, unknown kinds, oversized documents, a document naming
another device, blocks for unknown artifacts, a hash mismatch, a truncated model, a failing
accuracy gate, a job for an unsupported precision (recorded Jetson Nano tree: no INT8), a
fallback that is reported, an artifact over the size limit, and a worker that crashes.
"""

import os
import stat

from agent.device.status_publisher import fit_result
from agent.device.worker_process import describe_exit
from agent.wire import protocol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NANO = os.path.join(ROOT, "tests", "fixtures", "platforms", "nano")
SHA0 = "0" * 64


def final(controller, job_id, timeout=60):
    return controller.wait_state(job_id, protocol.TERMINAL_STATES, timeout)


def raw_job(controller, job_id, payload):
    h = controller.send_raw(controller.topics.job(controller.device, job_id), payload,
                            retain=True)
    assert h.wait(10)


def test_bad_documents_blocks_and_artifacts(controller, agent_factory, digits_files, tmp_path):
    agent = agent_factory().start()
    controller.wait_online()
    model = controller.add_artifact(digits_files["model"])
    good = {"protocol": 1, "job_id": "x", "device": "dev1", "kind": "deploy",
            "artifacts": {"model": model}, "plan": {"precision": "fp32"}}

    raw_job(controller, "bad-json", b'{"job_id": "bad-json", ')
    raw_job(controller, "bad-utf8", b"\xff\xfe\x00")
    raw_job(controller, "bad-schema", protocol.encode(dict(good, job_id="bad-schema",
                                                            plan={"precision": "int4"})))
    raw_job(controller, "bad-kind", protocol.encode(dict(good, job_id="bad-kind", kind="format")))
    raw_job(controller, "bad-device", protocol.encode(dict(good, job_id="bad-device",
                                                            device="dev9")))
    raw_job(controller, "bad-id", protocol.encode(dict(good, job_id="other-id")))
    raw_job(controller, "too-big", protocol.encode(dict(good, job_id="too-big",
                                                         plan={"precision": "fp32"},
                                                         padding="x" * 40000)))
    expected = {"bad-json": "bad_message", "bad-utf8": "bad_message",
                "bad-schema": "bad_message", "bad-kind": "unknown_job_kind",
                "bad-device": "bad_message", "bad-id": "bad_message",
                "too-big": "message_too_large"}
    for job_id, code in expected.items():
        msg = final(controller, job_id)
        assert msg["state"] == "REJECTED" and msg["error"]["code"] == code, msg
        assert msg["statusDetails"]["error_code"] == code
        protocol.validate("job_status", msg)

    # Blocks nobody asked for: dropped.
    for i in range(5):
        controller.send_raw(controller.topics.block("dev1", SHA0, i), b"junk" * i)

    # A hash mismatch: the controller serves other bytes under the announced sha.
    fake_sha = "ab" * 32
    controller.server.add_file(digits_files["calibration"], sha256=fake_sha)
    size = os.path.getsize(digits_files["calibration"])
    controller.send_job(dict(good, job_id="mismatch", kind="bench",
                             artifacts={"model": model,
                                        "inputs": {"sha256": fake_sha, "size": size}}))
    msg = final(controller, "mismatch")
    assert msg["state"] == "FAILED" and msg["error"]["code"] == "hash_mismatch", msg

    # A truncated model: the bytes arrive intact, but they are not a whole ONNX model.
    truncated = tmp_path / "truncated.onnx"
    with open(digits_files["model"], "rb") as f:
        truncated.write_bytes(f.read()[:700])
    controller.send_job(dict(good, job_id="truncated",
                             artifacts={"model": controller.add_artifact(truncated)}))
    msg = final(controller, "truncated")
    assert msg["state"] == "REJECTED" and msg["error"]["code"] == "bad_model", msg

    # An accuracy gate the int8 engine cannot meet: FAILED, and nothing activated.
    files = {role: controller.add_artifact(path) for role, path in digits_files.items()}
    controller.send_job({"job_id": "strict", "kind": "deploy", "artifacts": files,
                         "plan": {"precision": "int8", "calibration": {"algorithm": "minmax"}},
                         "gate": {"atol": 1e-9, "rtol": 1e-9}})
    msg = final(controller, "strict", 120)
    assert msg["state"] == "FAILED" and msg["error"]["code"] == "accuracy_gate_failed", msg
    assert msg["error"]["details"]["accuracy"]["passed"] is False

    # Still serving, nothing stored that does not match its hash, nothing activated.
    diag = controller.diag()
    assert diag["ok"] and diag["result"]["active_engines"] == []
    assert diag["result"]["counters"]["blocks"] >= 5
    assert not os.path.exists(os.path.join(agent.state_dir, "artifacts", fake_sha[:2], fake_sha))
    assert agent.alive()


def test_unsupported_precision_fallback_and_limits(controller, agent_factory, digits_files):
    nano = agent_factory("nano1", extra_config=(
        "platform_root: {}\nlimits:\n  max_artifact_bytes: 40000\n".format(NANO)))
    # The Nano has no INT8: rejected before anything is downloaded.
    with open(nano.config) as f:
        text = f.read().replace("backend: onnxruntime\n", "backend: auto\n")
    with open(nano.config, "w") as f:
        f.write(text)
    nano.start()
    controller.device = "nano1"
    model = controller.add_artifact(digits_files["model"])
    controller.send_job({"job_id": "int8", "kind": "deploy", "artifacts": {"model": model},
                         "plan": {"precision": "int8"}})
    msg = final(controller, "int8")
    assert msg["state"] == "REJECTED" and msg["error"]["code"] == "unsupported_precision", msg
    assert "Maxwell" in msg["error"]["message"]
    assert not controller.requests  # nothing was downloaded for it

    # With a fallback list, it falls back to fp16 and says so; this host then has no TensorRT.
    controller.send_job({"job_id": "int8-fb", "kind": "deploy", "artifacts": {"model": model},
                         "plan": {"precision": "int8"}, "fallback": ["fp16"]})
    msg = final(controller, "int8-fb")
    assert msg["statusDetails"]["precision"] == "fp16"
    assert "fell back to fp16" in msg["statusDetails"]["fallback"]
    assert msg["state"] == "REJECTED" and msg["error"]["code"] == "backend_unavailable", msg

    # An artifact over limits.max_artifact_bytes.
    big = controller.add_artifact(digits_files["inputs"])
    assert big["size"] > 40000
    controller.send_job({"job_id": "too-large", "kind": "bench",
                         "artifacts": {"model": model, "inputs": big},
                         "plan": {"precision": "fp16"}})
    msg = final(controller, "too-large")
    assert msg["state"] == "REJECTED" and msg["error"]["code"] == "bad_argument", msg
    assert "max_artifact_bytes" in msg["error"]["message"]


def test_worker_crash_fails_the_job_and_the_daemon_carries_on(controller, agent_factory,
                                                              digits_files, tmp_path):
    crash = tmp_path / "crashing-python"
    crash.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crash.chmod(crash.stat().st_mode | stat.S_IXUSR)
    agent = agent_factory(extra_config="worker_python: {}\n".format(crash)).start()
    controller.wait_online()
    model = controller.add_artifact(digits_files["model"])
    doc = {"job_id": "crash-1", "kind": "bench", "artifacts": {"model": model},
           "plan": {"precision": "fp32"}, "bench": {"iterations": 5, "warmup": 0}}
    controller.send_job(doc)
    msg = final(controller, "crash-1")
    assert msg["state"] == "FAILED" and msg["error"]["code"] == "worker_crashed", msg
    assert "SIGSEGV" in msg["error"]["message"]
    controller.send_job(dict(doc, job_id="crash-2"))
    assert final(controller, "crash-2")["error"]["code"] == "worker_crashed"
    assert controller.diag()["ok"] and agent.alive()
    # A worker interpreter that does not exist: the job says so.
    agent_factory("dev2", extra_config="worker_python: /nonexistent/python3\n").start()
    controller.device = "dev2"
    controller.send_job(dict(doc, job_id="no-python"))
    msg = final(controller, "no-python")
    assert msg["state"] == "FAILED" and msg["error"]["code"] == "worker_crashed", msg
    assert "/nonexistent/python3" in msg["error"]["message"]


def test_results_are_kept_small_and_exits_described():
    big = {"precision": "int8", "engine_key": "k", "iterations": [{"i": i} for i in range(9000)],
           "sensitivity": ["x" * 100] * 100}
    fitted = fit_result(big)
    assert len(protocol.encode(fitted)) <= 48 * 1024
    assert fitted["precision"] == "int8" and fitted["truncated"] == ["iterations"]
    assert fit_result({"a": 1}) == {"a": 1}
    assert describe_exit(-11) == "killed by SIGSEGV (11)"
    assert describe_exit(-9) == "killed by SIGKILL (9)"
    assert describe_exit(7) == "exited with status 7"
