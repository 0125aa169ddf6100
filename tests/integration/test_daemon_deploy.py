"""The daemon end to end: real Mosquitto, a real daemon subprocess, the onnxruntime backend.

A deploy job for the int8 digits classifier: blocks downloaded, calibrated, built, verified
against goldens, benchmarked, activated; SUCCEEDED with accuracy and throughput. A second
identical job is an engine-cache hit and downloads nothing.
"""

import os

from agent.wire import protocol

GATE = {"atol": 0.5, "rtol": 0.5, "check_error_stat": "mean", "min_top1": 0.9}


def deploy_doc(controller, files, job_id, precision="int8", **extra):
    artifacts = {role: controller.add_artifact(path) for role, path in files.items()}
    doc = {"job_id": job_id, "kind": "deploy", "artifacts": artifacts,
           "plan": {"precision": precision,
                    "calibration": {"algorithm": "minmax", "batch_size": 64}},
           "gate": GATE, "bench": {"iterations": 50, "warmup": 5}}
    doc.update(extra)
    return doc


def test_deploy_int8_then_cache_hit(controller, agent_factory, digits_files):
    agent = agent_factory().start()
    doc = controller.send_job(deploy_doc(controller, digits_files, "deploy-1"))
    final = controller.wait_state("deploy-1", protocol.TERMINAL_STATES, timeout=120)
    assert final["state"] == "SUCCEEDED", (final, agent.log_tail())
    result = final["result"]
    assert result["precision"] == "int8"
    assert result["accuracy"]["passed"] is True
    assert result["accuracy"]["top1_agreement"] >= 0.9
    assert result["accuracy"]["label_accuracy"] > 0.8
    assert result["throughput_qps"] > 0 and result["latency_ms"]["p99"] > 0
    assert result["cache_hit"] is False and result["calibrated"] is True
    assert result["activated"] is True
    # What it was built and measured under (issue 34): power mode, clocks, temperatures.
    assert set(result["conditions"]) == {"nvpmodel", "clocks_mhz", "temperatures_c"}
    # Retained statuses are coalesced in the outbox, so intermediate stages may be skipped;
    # versions only grow.
    versions = [m["version"] for m in controller.job_status["deploy-1"]]
    assert versions == sorted(set(versions))
    for msg in controller.job_status["deploy-1"]:
        protocol.validate("job_status", msg)
    # every block was sent once
    assert set(controller.blocks_sent.values()) == {1}
    sent_before = dict(controller.blocks_sent)

    # The retained device status lists the active engine.
    controller.wait_for(lambda: any(s.get("active_engines") for s in controller.device_status),
                        20, "status with the active engine")
    # The version's folder holds what an app (or DeepStream's int8-calib-file) needs.
    name = "sha-" + doc["artifacts"]["model"]["sha256"][:12]
    version_dir = os.path.join(agent.state_dir, "models", name, "current")
    assert sorted(os.listdir(version_dir)) == ["calibration.cache", "meta.json", "model.engine",
                                               "model.onnx"]
    with open(os.path.join(version_dir, "calibration.cache")) as f:
        assert f.readline().startswith("TRT-")

    doc2 = dict(doc, job_id="deploy-2")
    controller.send_job(doc2)
    final2 = controller.wait_state("deploy-2", protocol.TERMINAL_STATES, timeout=120)
    assert final2["state"] == "SUCCEEDED", final2
    assert final2["result"]["cache_hit"] is True
    assert final2["result"]["engine_key"] == result["engine_key"]
    assert controller.blocks_sent == sent_before  # nothing downloaded twice

    # A bench job on the same model and inputs: fp32, its own engine, nothing activated.
    controller.send_job({"job_id": "bench-1", "kind": "bench",
                         "artifacts": {r: doc["artifacts"][r] for r in ("model", "inputs")},
                         "plan": {"precision": "fp32"}, "bench": {"iterations": 30}})
    bench = controller.wait_state("bench-1", protocol.TERMINAL_STATES, timeout=90)
    assert bench["state"] == "SUCCEEDED", bench
    assert bench["result"]["precision"] == "fp32" and bench["result"]["throughput_qps"] > 0
    assert bench["result"]["latency_ms"]["p50"] > 0 and "activated" not in bench["result"]
    assert not controller.errors
    controller.wait_for(lambda: controller.telemetry, 20, "telemetry")
    for msg in controller.telemetry:
        protocol.validate("telemetry", msg)
    diag = controller.diag()
    assert diag["ok"] and diag["result"]["outbox"] == 0
    assert agent.stop() == 0
    agent.assert_store_sound()
    with agent.journal() as journal:
        assert journal.outbox_count() == 0
        assert [e["job_id"] for e in journal.active_engines()] == ["deploy-2"]
        model_sha = doc["artifacts"]["model"]["sha256"]
        assert journal.previous_engine(model_sha) is None  # same engine, refreshed
    offline = controller.wait_for(
        lambda: [s for s in controller.device_status if s["online"] is False], 10, "offline")
    assert offline[-1]["reason"] == "shutdown"


def test_a_plugin_artifact_is_installed_in_the_models_directory_and_named_in_meta(
        controller, agent_factory, digits_files, tmp_path):
    """Issue 34: a job ships a TensorRT plugin library as a signed artifact (SHA-256 pinned
    like the model): the daemon installs it as <models dir>/plugins/<sha256>.so, the only
    place plugins load from, and the version's meta.json names it for the app (DeepStream's
    custom-lib-path, Triton's plugin preload). The host backend runs the plain model."""
    import json

    from agent.engines.plugins import sha256_of

    lib = tmp_path / "libnms_plugin.so"
    lib.write_bytes(b"\x7fELF a plugin library")
    sha = sha256_of(str(lib))
    agent = agent_factory().start()
    files = {"model": digits_files["model"], "plugin": str(lib)}
    doc = deploy_doc(controller, files, "plugin-1", plan={"precision": "fp32"},
                     bench={"iterations": 5, "warmup": 1})
    del doc["gate"]  # no inputs or goldens: nothing to compare
    controller.send_job(doc)
    final = controller.wait_state("plugin-1", protocol.TERMINAL_STATES, timeout=120)
    assert final["state"] == "SUCCEEDED", (final, agent.log_tail())
    installed = os.path.join(agent.state_dir, "models", "plugins", sha + ".so")
    assert sha256_of(installed) == sha
    name = "sha-" + doc["artifacts"]["model"]["sha256"][:12]
    with open(os.path.join(agent.state_dir, "models", name, "current", "meta.json")) as f:
        assert json.load(f)["plugins"] == [{"path": installed, "sha256": sha}]
    assert agent.stop() == 0
