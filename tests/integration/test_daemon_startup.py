"""What the daemon checks when it starts: one daemon per state directory (an flock naming the
other PID; ``status`` says whether it runs), and a backend the worker's Python can import
(warned once with diag's fix, the truth in the birth message). Real processes, real broker."""

import json
import os
import subprocess
import sys

import pytest

from .conftest import ROOT

ORIN_NANO = os.path.join(ROOT, "tests", "fixtures", "platforms", "orin-nano")


def agent_cli(*args, expect=0, timeout=60):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("JETSON_AGENT_STATE_DIR", None)
    env.pop("JOURNAL_STREAM", None)
    proc = subprocess.run([sys.executable, "-m", "agent"] + list(args), capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)
    assert proc.returncode == expect, proc.stdout + proc.stderr
    return proc


def test_second_daemon_on_the_same_state_dir_is_refused(agent_factory, controller):
    proc = agent_cli("status", "--state-dir", "/nonexistent/jetson-agent", expect=2)
    assert "file_not_found" in proc.stderr and not os.path.exists("/nonexistent")
    agent = agent_factory().start()
    controller.wait_online()
    second = agent_cli("run", "--config", agent.config, expect=2)
    assert "error [state_dir_in_use]" in second.stderr
    assert "(PID {}, device dev1)".format(agent.proc.pid) in second.stderr
    assert "Traceback" not in second.stderr and agent.alive()

    status = json.loads(agent_cli("status", "--config", agent.config, "--json").stdout)
    assert status["daemon"]["running"] is True and status["daemon"]["pid"] == agent.proc.pid
    text = agent_cli("status", "--config", agent.config).stdout
    assert text.startswith("daemon: running, PID {}, device dev1".format(agent.proc.pid))

    assert agent.stop() == 0
    text = agent_cli("status", "--config", agent.config).stdout
    assert text.startswith("daemon: not running")


def test_a_file_as_state_dir_is_a_clear_error(tmp_path):
    afile = tmp_path / "state"
    afile.write_text("not a directory")
    for args in (["run", "--state-dir", str(afile), "--broker", "mqtt://127.0.0.1:1"],
                 ["status", "--state-dir", str(afile)],
                 ["cache", "ls", "--state-dir", str(afile)],
                 ["build", os.path.join(ROOT, "examples", "fp16_max", "model.onnx"),
                  "--state-dir", str(afile)],
                 ["compare", os.path.join(ROOT, "examples", "fp16_max", "model.onnx"),
                  "--state-dir", str(afile)],
                 ["jobs", "ls", "--state-dir", str(afile)]):
        proc = agent_cli(*args, expect=2)
        assert "error [bad_argument]: state directory {} is a file".format(afile) in proc.stderr
        assert "Traceback" not in proc.stderr


def _on_a_jetson_without_tensorrt(agent, backend):
    with open(agent.config) as f:
        text = f.read()
    with open(agent.config, "w") as f:
        f.write(text.replace("backend: onnxruntime\n", "backend: {}\nplatform_root: {}\n".format(
            backend, ORIN_NANO)))


@pytest.mark.parametrize("backend", ["auto", "tensorrt"])
def test_backend_that_does_not_import_is_warned_once_and_not_advertised(
        agent_factory, controller, digits_files, backend):
    agent = agent_factory()
    _on_a_jetson_without_tensorrt(agent, backend)
    agent.start()
    birth = controller.wait_online()
    platform = birth["platform"]
    assert platform["kind"] == "jetson" and platform["backend"] is None
    assert "cannot import tensorrt" in platform["backend_problem"]
    assert "scripts/install-jetson" in platform["backend_problem"]  # diag's fix
    model = controller.add_artifact(digits_files["model"])
    controller.send_job({"job_id": "trt-1", "kind": "deploy", "artifacts": {"model": model},
                         "plan": {"precision": "fp16"}})
    final = controller.wait_state("trt-1", ("REJECTED", "FAILED"), timeout=60)
    assert final["error"]["code"] == "backend_unavailable", final
    assert "scripts/install-jetson" in final["error"]["message"]  # not a host's hint
    assert not controller.requests  # rejected before any download
    assert agent.stop() == 0
    assert agent.log_tail(100000).count("agent.device.daemon: backend tensorrt is not usable") == 1


def test_a_succeeded_job_is_in_no_stage_and_its_model_keeps_its_name(
        agent_factory, controller, digits_files):
    agent = agent_factory().start()
    controller.wait_online()
    model = controller.add_artifact(digits_files["model"], name="digits-mlp.onnx")
    controller.send_job({"job_id": "fp32-1", "kind": "deploy", "artifacts": {
        "model": model, "inputs": controller.add_artifact(digits_files["inputs"]),
        "goldens": controller.add_artifact(digits_files["goldens"])},
        "plan": {"precision": "fp32"}, "gate": {"atol": 1e-3, "rtol": 1e-3},
        "bench": {"iterations": 5, "warmup": 1}})
    final = controller.wait_state("fp32-1", ("SUCCEEDED", "FAILED", "REJECTED"), timeout=120)
    assert final["state"] == "SUCCEEDED", (final, agent.log_tail())
    assert "stage" not in final and "progress" not in final
    jobs = json.loads(agent_cli("jobs", "ls", "--config", agent.config, "--json").stdout)
    row = next(j for j in jobs if j["job_id"] == "fp32-1")
    assert row["state"] == "SUCCEEDED" and not row.get("stage")
    listing = agent_cli("cache", "ls", "--config", agent.config).stdout
    assert "digits-mlp.onnx" in listing and "model.onnx" not in listing


def test_status_of_a_state_dir_it_may_not_read_says_so(tmp_path, monkeypatch, capsys):
    # Another user's /var/lib/jetson-agent: neither "running" nor "not running".
    from agent.cli import main

    real_open = os.open

    def denied(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise PermissionError(13, "Permission denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    assert main(["status", "--state-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Permission denied" in err and "with sudo" in err
