"""Named models end to end: real Mosquitto, a real daemon, the onnxruntime backend.

v1 -> v2 of one name replaces it (the models directory's ``current`` follows), a second name
lives beside it, ``rollback`` by name goes back to v1 and is refused with nothing kept; the
retained models topic and the status say so. With a probe: a daemon killed -9 while a version
is pending resumes the wait and commits it; a version nobody confirms is rolled back at the
commit timeout and refused when it comes again. The app socket (when this installation has
it): the app commits, and its unhealthy report rolls back.
"""

import json
import os
import socket
import sys
import time

import pytest

from agent.wire import protocol
from tests.integration.test_daemon_deploy import deploy_doc

MODELS_TOPIC = "jetson-agent/devices/+/models"


def named(controller, files, job_id, name, version):
    doc = deploy_doc(controller, {k: files[k] for k in ("model", "inputs", "goldens")}, job_id,
                     precision="fp32", model_name=name, model_version=version)
    doc["bench"] = {"iterations": 5, "warmup": 1}
    return controller.send_job(doc)


def final(controller, agent, job_id, timeout=120):
    return controller.wait_state(job_id, protocol.TERMINAL_STATES, timeout=timeout)


def current(agent, name):
    return os.readlink(os.path.join(agent.state_dir, "models", name, "current"))


def reply_to(controller, cmd, rid):
    controller.command(dict(cmd, request_id=rid))
    return controller.wait_for(
        lambda: next((r for r in controller.replies if r.get("request_id") == rid), None),
        20, "reply " + rid)


def cli(*args):
    import subprocess

    from tests.integration.conftest import ROOT

    out = subprocess.run([sys.executable, "-m", "agent"] + list(args), capture_output=True,
                         env=dict(os.environ, PYTHONPATH=ROOT),
                         timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    return json.loads(out.stdout.decode())


def test_versions_replace_live_side_by_side_and_roll_back(controller, agent_factory,
                                                          digits_files):
    controller.client.subscribe(MODELS_TOPIC, 1)
    agent = agent_factory().start()
    controller.wait_online()
    birth = controller.device_status[-1]
    assert "named_models" in birth["platform"]["features"]
    named(controller, digits_files, "det-1", "det", "v1")
    assert final(controller, agent, "det-1")["state"] == "SUCCEEDED", agent.log_tail()
    named(controller, digits_files, "det-2", "det", "v2")
    done = final(controller, agent, "det-2")
    assert done["state"] == "SUCCEEDED", agent.log_tail()
    assert done["result"]["model"] == {"name": "det", "version": "v2", "previous": "v1",
                                       "state": "committed"}
    named(controller, digits_files, "cls-1", "cls", "2024.1")
    assert final(controller, agent, "cls-1")["state"] == "SUCCEEDED"
    assert current(agent, "det") == "v2" and current(agent, "cls") == "2024.1"
    vdir = os.path.join(agent.state_dir, "models", "det", "v2")
    with open(os.path.join(vdir, "meta.json")) as f:
        meta = json.load(f)
    assert meta["name"] == "det" and meta["version"] == "v2" and meta["job_id"] == "det-2"
    assert meta["inputs"][0]["name"] == "input" and meta["outputs"][0]["name"] == "logits"
    assert meta["engine_size"] == os.path.getsize(os.path.join(vdir, "model.engine"))
    assert os.path.isfile(os.path.join(vdir, "model.onnx"))
    assert os.stat(os.path.join(vdir, "model.engine")).st_mode & 0o777 == 0o640

    def models_now():
        if not controller.models:
            return None
        last = {m["name"]: m for m in controller.models[-1]["models"]}
        return last if set(last) == {"det", "cls"} else None

    models = controller.wait_for(models_now, 20, "models message with both names")
    assert models["det"]["version"] == "v2" and models["det"]["previous"] == "v1"
    assert models["det"]["state"] == "committed" and models["cls"]["version"] == "2024.1"
    controller.wait_for(lambda: len(controller.device_status[-1].get("active_engines") or [])
                        == 2, 20, "status with two active engines (one per name)")

    out = cli("models", "ls", "--state-dir", agent.state_dir, "--json")
    assert {m["name"]: m["version"] for m in out["models"]} == {"det": "v2", "cls": "2024.1"}
    out = cli("models", "show", "det", "--state-dir", agent.state_dir, "--json")
    assert out["current"] == "v2" and out["problem"] is None and out["meta"]["version"] == "v2"
    assert [v["version"] for v in out["versions"]] == ["v2", "v1"]
    out = cli("status", "--state-dir", agent.state_dir, "--json")
    assert sorted(m["name"] for m in out["models"]) == ["cls", "det"]

    reply = reply_to(controller, {"command": "rollback", "name": "det"}, "rb1")
    assert reply["ok"] and reply["result"]["version"] == "v1", reply
    assert current(agent, "det") == "v1"
    assert not os.path.exists(vdir)  # no longer kept
    reply = reply_to(controller, {"command": "rollback", "name": "det"}, "rb2")
    assert not reply["ok"] and reply["error"]["code"] == "no_previous_version", reply
    controller.wait_for(lambda: controller.models[-1]["models"][0]["version"] == "v1"
                        if controller.models[-1]["models"][0]["name"] == "det" else
                        controller.models[-1]["models"][1]["version"] == "v1", 20,
                        "models message after the rollback")
    assert agent.stop() == 0
    assert not controller.errors


def test_pending_survives_kill_and_unconfirmed_version_rolls_back(controller, agent_factory,
                                                                  digits_files, tmp_path):
    flag = tmp_path / "healthy"
    probe = [sys.executable, "-c",
             "import os, sys; sys.exit(0 if os.path.exists({!r}) else 1)".format(str(flag))]
    extra = "models:\n  commit_timeout_s: 12\n  probe: {}\n".format(json.dumps(probe))
    agent = agent_factory(extra_config=extra).start()
    controller.wait_online()
    flag.write_text("")
    named(controller, digits_files, "p-1", "det", "v1")
    assert final(controller, agent, "p-1")["state"] == "SUCCEEDED", agent.log_tail()
    flag.unlink()
    named(controller, digits_files, "p-2", "det", "v2")
    controller.wait_stage("p-2", "committing", timeout=120)
    # The hand-off runs beside the daemon's loop: ``current`` switches just after the stage.
    deadline = time.monotonic() + 60
    while current(agent, "det") != "v2":
        assert time.monotonic() < deadline, agent.log_tail()
        time.sleep(0.05)
    agent.kill()  # kill -9 while v2 is pending (the probe says unhealthy)
    assert current(agent, "det") == "v2"
    agent.start()
    flag.write_text("")  # the app is healthy now: the resumed wait commits
    done = final(controller, agent, "p-2", timeout=60)
    assert done["state"] == "SUCCEEDED", (done, agent.log_tail())
    assert done["result"]["model"]["previous"] == "v1"

    flag.unlink()  # v3: nothing confirms it
    named(controller, digits_files, "p-3", "det", "v3")
    done = final(controller, agent, "p-3", timeout=120)
    assert done["state"] == "FAILED" and done["error"]["code"] == "handoff_rolled_back", done
    assert done["error"]["details"]["version"] == "v3"
    assert done["error"]["details"]["previous"] == "v2"
    assert current(agent, "det") == "v2"
    named(controller, digits_files, "p-4", "det", "v3")  # the same version again: refused
    done = final(controller, agent, "p-4", timeout=60)
    assert done["state"] == "REJECTED" and done["error"]["code"] == "version_rejected", done
    assert agent.stop() == 0
    with agent.journal() as journal:
        assert journal.pending_versions() == []
        assert [r["version"] for r in journal.rejected_versions("det")] == ["v3"]


def ask(path, request):
    """One request on the app socket, with plain socket code (agent.client is the app's)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(15)
    s.connect(path)
    s.sendall(json.dumps(request).encode("utf-8") + b"\n")
    data = b""
    while not data.endswith(b"\n"):
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    s.close()
    return json.loads(data.decode("utf-8"))


def test_app_socket_commits_and_reports(controller, agent_factory, digits_files):
    pytest.importorskip("agent.device.app.server", reason="the app socket module (another "
                        "branch of issue 21) is not in this tree yet")
    extra = "models:\n  commit_timeout_s: 60\n  app_confirms: [det]\n"
    agent = agent_factory(extra_config=extra).start()
    controller.wait_online()
    sock = os.path.join(agent.state_dir, "app.sock")
    named(controller, digits_files, "s-1", "det", "v1")
    controller.wait_stage("s-1", "committing", timeout=120)
    assert ask(sock, {"op": "commit", "name": "det"})["ok"]
    assert final(controller, agent, "s-1")["state"] == "SUCCEEDED"
    named(controller, digits_files, "s-2", "det", "v2")
    controller.wait_stage("s-2", "committing", timeout=120)
    listed = ask(sock, {"op": "list"})
    assert listed["ok"] and listed["models"][0]["state"] == "pending"
    answer = ask(sock, {"op": "health", "name": "det", "version": "v2", "ok": False,
                        "detail": "wrong outputs"})
    assert answer["ok"], answer
    done = final(controller, agent, "s-2")
    assert done["error"]["code"] == "handoff_rolled_back" and "wrong outputs" in \
        done["error"]["message"]
    assert current(agent, "det") == "v1"
    bad = ask(sock, {"op": "commit", "name": "det"})
    assert not bad["ok"] and bad["error"]["code"] == "not_pending"
    assert agent.stop() == 0
