"""The daemon's command line and its service-manager side: --check-config, sd_notify (READY,
WATCHDOG, STATUS, STOPPING) over a real socket, retrying an unreachable broker, and the local
``status`` / ``jobs`` views of the journal."""

import json
import signal
import socket
import time

import pytest

from agent.cli import main
from agent.wire import protocol

from .conftest import Broker, free_port


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def cli(capsys):
    """Run the CLI in this process (the daemon is the subprocess; these commands read files)."""
    def run(*args):
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return Result(code, out, err)
    return run


def test_check_config(tmp_path, cli):
    good = tmp_path / "good.yaml"
    good.write_text("device_id: nano-7\nbroker:\n  host: 10.0.0.2\n  port: 1884\n")
    proc = cli("run", "--config", str(good), "--check-config", "--json")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)["config"]
    assert shown["device_id"] == "nano-7" and shown["broker"]["port"] == 1884
    proc = cli("run", "--config", str(good), "--broker", "mqtt://b:9", "--device-id", "d2",
               "--check-config")
    assert proc.returncode == 0 and "device d2 -> broker b:9" in proc.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("device_id: nano-7\nbroker:\n  host: x\n  keepalive: soon\n")
    proc = cli("run", "--config", str(bad), "--check-config")
    assert proc.returncode == 2
    assert "error [bad_config]" in proc.stderr and "line 4" in proc.stderr
    assert "broker.keepalive" in proc.stderr


def test_sd_notify_and_an_unreachable_broker(tmp_path, agent_factory, mosquitto):
    # The agent starts against a broker that is not there yet, then the broker appears.
    broker = Broker(tmp_path, port=free_port())
    sock_path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(sock_path)
    sock.settimeout(0.5)
    agent = agent_factory(workdir=tmp_path / "agent")
    agent.broker = broker
    with open(agent.config) as f:
        text = f.read().replace("port: {}".format(mosquitto.port), "port: {}".format(broker.port))
    with open(agent.config, "w") as f:
        f.write(text)
    agent.start(env_extra={"NOTIFY_SOCKET": sock_path, "WATCHDOG_USEC": "1000000"})
    received = []

    def read_for(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                received.extend(sock.recv(4096).decode().split("\n"))
            except socket.timeout:
                pass

    read_for(2)
    assert agent.alive()
    assert "WATCHDOG=1" in received  # the loop runs while the broker is unreachable
    assert "READY=1" not in received
    assert any(m.startswith("STATUS=broker 127.0.0.1:{} unreachable".format(broker.port))
               for m in received), received
    assert "broker_unreachable: 127.0.0.1:{}: ConnectionRefusedError".format(broker.port) in \
        agent.log_tail()
    broker.start()
    try:
        deadline = time.monotonic() + 20
        while "READY=1" not in received and time.monotonic() < deadline:
            read_for(0.5)
        assert "READY=1" in received, received
        assert any(m.startswith("STATUS=connected to") for m in received)
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(30) == 0
        read_for(0.5)
        assert "STOPPING=1" in received
    finally:
        sock.close()
        broker.stop()


def test_status_and_jobs_views(controller, agent_factory, digits_files, cli):
    agent = agent_factory().start()
    model = controller.add_artifact(digits_files["model"])
    controller.send_job({"job_id": "fp32-1", "kind": "deploy", "artifacts": {"model": model},
                         "plan": {"precision": "fp32"}})
    assert controller.wait_state("fp32-1", protocol.TERMINAL_STATES, 90)["state"] == "SUCCEEDED"
    controller.send_job({"job_id": "bad-1", "kind": "deploy", "artifacts": {"model": model},
                         "plan": {"precision": "fp32"}, "fallback": ["fp8"]})
    assert controller.wait_state("bad-1", protocol.TERMINAL_STATES, 30)["state"] == "REJECTED"
    controller.wait_for(lambda: controller.diag()["result"]["outbox"] == 0, 30, "empty outbox")
    state = ["--state-dir", agent.state_dir]
    proc = cli("status", "--json", *state)
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["jobs"] == {"SUCCEEDED": 1, "REJECTED": 1}
    assert status["outbox"] == 0 and status["boot"] == 1
    assert [e["job_id"] for e in status["active_engines"]] == ["fp32-1"]
    proc = cli("status", *state)
    assert proc.returncode == 0 and "models: 1" in proc.stdout
    proc = cli("jobs", "ls", *state)
    assert proc.returncode == 0 and "fp32-1" in proc.stdout and "bad_message" in proc.stdout
    proc = cli("jobs", "ls", "--json", "--state", "SUCCEEDED", *state)
    assert [j["job_id"] for j in json.loads(proc.stdout)] == ["fp32-1"]
    proc = cli("jobs", "show", "fp32-1", "--json", *state)
    shown = json.loads(proc.stdout)
    assert shown["state"] == "SUCCEEDED" and shown["result"]["engine_key"]
    proc = cli("jobs", "show", "fp32-1", *state)
    assert "result:" in proc.stdout and "document:" in proc.stdout
    proc = cli("jobs", "show", "nope", *state)
    assert proc.returncode == 2 and "unknown_job" in proc.stderr
    proc = cli("status", "--state-dir", str(agent.state_dir) + "-missing")
    assert proc.returncode == 2 and "file_not_found" in proc.stderr
