"""Versions that can't be lost, on a real daemon (real Mosquitto, the onnxruntime backend).

A version refused by the probe leaves every rollback target of ``keep_versions`` (v1, v2
committed, v3 refused: back to v1 works); ``models retry`` un-rejects it (the CLI over the app
socket); a daemon killed during the commit window finds the version ``unconfirmed`` on restart
and reopens its window once (the app commits it then); a job cancelled while its version is
pending is rolled back, never committed later; slow clients on the app socket do not starve
the app's commit, and a nested JSON line gets an error reply; an app acts only on the names
``models.app_names`` gives it, and a uid that may not use the socket is told so.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tests.integration.conftest import ROOT
from tests.integration.test_named_models import ask, cli, current, final, named, reply_to
from tests.unit.device.test_app_socket import NOBODY, as_other_user


def cli_error(*args):
    out = subprocess.run([sys.executable, "-m", "agent"] + list(args), capture_output=True,
                         env=dict(os.environ, PYTHONPATH=ROOT), timeout=60, text=True)
    return out.returncode, out.stderr


def probe_on(flag):
    return [sys.executable, "-c",
            "import os, sys; sys.exit(0 if os.path.exists({!r}) else 1)".format(str(flag))]


def socket_answers(path, request):
    """The reply, or None while the daemon's socket is not there yet (a restart)."""
    try:
        return ask(path, request)
    except (FileNotFoundError, ConnectionRefusedError):
        return None


def test_refused_version_keeps_rollback_targets_and_retry_unrejects(controller, agent_factory,
                                                                    digits_files, tmp_path):
    flag = tmp_path / "healthy"
    extra = "models:\n  keep_versions: 2\n  commit_timeout_s: 8\n  probe: {}\n".format(
        json.dumps(probe_on(flag)))
    agent = agent_factory(extra_config=extra).start()
    controller.wait_online()
    sock = os.path.join(agent.state_dir, "app.sock")
    flag.write_text("")
    for job, version in (("k-1", "v1"), ("k-2", "v2")):
        named(controller, digits_files, job, "det", version)
        assert final(controller, agent, job)["state"] == "SUCCEEDED", agent.log_tail()
    flag.unlink()  # the probe refuses v3
    named(controller, digits_files, "k-3", "det", "v3")
    done = final(controller, agent, "k-3")
    assert done["state"] == "FAILED" and done["error"]["code"] == "handoff_rolled_back", done
    assert current(agent, "det") == "v2"
    # v3 was pending with keep_versions 2: v1 stayed a rollback target
    reply = ask(sock, {"op": "rollback", "name": "det", "version": "v1"})
    assert reply["ok"] and reply["version"] == "v1" and reply["replaced"] == "v2", reply
    assert current(agent, "det") == "v1"

    named(controller, digits_files, "k-4", "det", "v3")  # the same version: refused
    done = final(controller, agent, "k-4")
    assert done["state"] == "REJECTED" and done["error"]["code"] == "version_rejected", done
    out = cli("models", "retry", "det", "v3", "--state-dir", agent.state_dir, "--json")
    assert out["ok"] and out["forgotten"] is True, out
    again = ask(sock, {"op": "retry", "name": "det", "version": "v3"})
    assert again["ok"] and again["forgotten"] is False, again  # nothing left to forget
    flag.write_text("")
    named(controller, digits_files, "k-5", "det", "v3")
    assert final(controller, agent, "k-5")["state"] == "SUCCEEDED", agent.log_tail()
    assert current(agent, "det") == "v3"
    # current names the models directory's link: refused before anything is asked
    for args in (("rollback", "det", "--version", "current"), ("retry", "det", "current")):
        rc, err = cli_error("models", *args, "--state-dir", agent.state_dir)
        assert rc == 2 and "error [bad_argument]" in err and "'current'" in err, err
    assert agent.stop() == 0
    assert not controller.errors


def test_daemon_killed_in_the_commit_window_is_unconfirmed_then_retried(controller,
                                                                       agent_factory,
                                                                       digits_files):
    extra = "models:\n  commit_timeout_s: 8\n  app_confirms: [det]\n"
    agent = agent_factory(extra_config=extra).start()
    controller.wait_online()
    sock = os.path.join(agent.state_dir, "app.sock")
    named(controller, digits_files, "u-1", "det", "v1")
    controller.wait_stage("u-1", "committing", timeout=120)
    assert ask(sock, {"op": "commit", "name": "det"})["ok"]
    assert final(controller, agent, "u-1")["state"] == "SUCCEEDED", agent.log_tail()
    named(controller, digits_files, "u-2", "det", "v2")
    controller.wait_stage("u-2", "committing", timeout=120)
    controller.wait_for(lambda: current(agent, "det") == "v2", 60, "current -> v2")
    agent.kill()  # kill -9 in v2's commit window
    with agent.journal() as journal:
        deadline = journal.active_version("det")["deadline"]
    controller.wait_for(lambda: time.time() > deadline + 0.5, 30,
                        "the commit window to close while the daemon is down")
    agent.start()

    def retried():
        listed = socket_answers(sock, {"op": "list"})
        row = listed["models"][0] if listed and listed.get("models") else {}
        return row if row.get("retries") == 1 and row.get("state") == "pending" else None

    row = controller.wait_for(retried, 60, "v2 pending again, retry 1")
    assert row["version"] == "v2"
    assert ask(sock, {"op": "commit", "name": "det"})["ok"]
    done = final(controller, agent, "u-2", timeout=60)
    assert done["state"] == "SUCCEEDED", (done, agent.log_tail())
    assert current(agent, "det") == "v2"
    assert "unconfirmed" in agent.log_tail(20000)
    assert agent.stop() == 0
    with agent.journal() as journal:
        assert journal.active_version("det")["state"] == "committed"
        assert journal.rejected_versions("det") == []


def test_cancelled_pending_job_is_rolled_back(controller, agent_factory, digits_files):
    extra = "models:\n  commit_timeout_s: 120\n  app_confirms: [det]\n"
    agent = agent_factory(extra_config=extra).start()
    controller.wait_online()
    sock = os.path.join(agent.state_dir, "app.sock")
    named(controller, digits_files, "c-1", "det", "v1")
    controller.wait_stage("c-1", "committing", timeout=120)
    assert ask(sock, {"op": "commit", "name": "det"})["ok"]
    assert final(controller, agent, "c-1")["state"] == "SUCCEEDED"
    named(controller, digits_files, "c-2", "det", "v2")
    controller.wait_stage("c-2", "committing", timeout=120)
    controller.wait_for(lambda: current(agent, "det") == "v2", 60, "current -> v2")
    reply = reply_to(controller, {"command": "cancel", "job_id": "c-2"}, "cancel-1")
    assert reply["ok"], reply
    assert final(controller, agent, "c-2")["state"] == "CANCELED"
    controller.wait_for(lambda: current(agent, "det") == "v1", 60, "current back to v1")
    late = ask(sock, {"op": "commit", "name": "det", "version": "v2"})  # the app, too late
    assert not late["ok"] and late["error"]["code"] == "not_pending", late
    controller.wait_for(lambda: (ask(sock, {"op": "list"})["models"][0]["version"],
                                 ask(sock, {"op": "list"})["models"][0]["state"]) ==
                        ("v1", "committed"), 30, "v1 active and committed")
    assert agent.stop() == 0
    with agent.journal() as journal:
        assert journal.active_version("det")["version"] == "v1"
        assert journal.job("c-2")["state"] == "CANCELED"


SLOW_CLIENT = r"""
import socket, sys, time
path, count = sys.argv[1], int(sys.argv[2])
conns, said = [], False
while True:  # keeps `count` connections open, each sending a byte now and then, never a line
    while len(conns) < count:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        s.setblocking(False)
        conns.append(s)
    if not said:
        print("holding", flush=True)
        said = True
    for s in list(conns):
        try:
            s.send(b" ")
            s.recv(4096)  # a refusal: the daemon pushed this one out
            s.close()
            conns.remove(s)
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            conns.remove(s)
    time.sleep(0.05)
"""


def test_slow_clients_do_not_starve_the_apps_commit(controller, agent_factory, digits_files):
    extra = "models:\n  commit_timeout_s: 120\n  app_confirms: [det]\n"
    agent = agent_factory(extra_config=extra).start()
    controller.wait_online()
    sock = os.path.join(agent.state_dir, "app.sock")
    named(controller, digits_files, "w-1", "det", "v1")
    controller.wait_stage("w-1", "committing", timeout=120)
    slow = subprocess.Popen([sys.executable, "-c", SLOW_CLIENT, sock, "12"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert slow.stdout.readline().strip() == "holding"
        # 12 slow connections of the app's own uid hold no worker and push out their oldest
        assert ask(sock, {"op": "commit", "name": "det"})["ok"]
        assert final(controller, agent, "w-1")["state"] == "SUCCEEDED", agent.log_tail()
        # a nested line gets an error reply; the connection and the daemon live on
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(15)
            s.connect(sock)
            s.sendall(b'{"op": "list", "x": ' + b"[" * 2000 + b"]" * 2000 + b"}\n")
            reply = json.loads(s.makefile("rb").readline())
        assert reply["ok"] is False and reply["error"]["code"] == "bad_message", reply
        assert "nested" in reply["error"]["message"]
        assert ask(sock, {"op": "list"})["ok"]
        assert slow.poll() is None  # still holding its connections all along
    finally:
        slow.kill()
        slow.wait(10)
    assert agent.alive() and "Traceback" not in agent.log_tail(200000)
    assert agent.stop() == 0


@pytest.mark.skipif(os.getuid() != 0, reason="clients as other uids need root (setuid)")
def test_apps_act_only_on_their_names_and_strangers_are_told_so(controller, agent_factory):
    sock_dir = tempfile.mkdtemp(prefix="appsock-", dir="/tmp")  # traversable by other uids
    os.chmod(sock_dir, 0o755)
    sock = os.path.join(sock_dir, "app.sock")
    try:
        extra = ("models:\n  socket: {}\n  app_users: [nobody]\n  app_names:\n"
                 "    nobody: [cls]\n".format(sock))
        agent = agent_factory(extra_config=extra).start()
        controller.wait_online()
        controller.wait_for(lambda: os.path.exists(sock), 30, "the app socket")
        os.chmod(sock, 0o666)  # the socket's own modes are not what this test is about
        refused = as_other_user(sock, NOBODY, NOBODY, {"op": "commit", "name": "det"})
        assert refused["error"]["code"] == "model_not_owned", refused
        assert "models.app_names: cls" in refused["error"]["message"]
        owned = as_other_user(sock, NOBODY, NOBODY, {"op": "commit", "name": "cls"})
        assert owned["error"]["code"] == "not_pending", owned  # its own: the daemon answers
        assert as_other_user(sock, NOBODY, NOBODY, {"op": "list"})["ok"]
        stranger = as_other_user(sock, 54321, 54321, {"op": "list"})
        assert stranger["error"]["code"] == "app_not_allowed", stranger
        assert ask(sock, {"op": "rollback", "name": "det"})["error"]["code"] == \
            "no_previous_version"  # root: every name, past the ownership check
        assert agent.stop() == 0
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
