"""What an app developer looks for, end to end: real Mosquitto, a real daemon, the onnxruntime
backend, the app socket.

A model set of two names (``det`` and ``cls``, one job each with the same ``model_set``) is
switched name by name; the app reports the second unhealthy and both names go back to the
versions the set replaced; a second set whose members the app confirms is committed. The state
the app sees (``agent.client.state``) and ``models ls`` say pending, then committed, and the
health says why a name was rolled back. ``models pin`` switches a name back to a kept version,
refuses a job to another version (``model_pinned``), is reported in the retained models
message, survives a restart, and ``unpin`` lets the job through.
"""

import os

from agent import client
from tests.integration.test_daemon_deploy import deploy_doc
from tests.integration.test_named_models import MODELS_TOPIC, ask, cli, current, final, named


def set_job(controller, files, job_id, name, version, set_id):
    """A member of the model set ``set_id`` (det + cls)."""
    doc = deploy_doc(controller, {k: files[k] for k in ("model", "inputs", "goldens")}, job_id,
                     precision="fp32", model_name=name, model_version=version,
                     model_set={"id": set_id, "names": ["det", "cls"]})
    doc["bench"] = {"iterations": 5, "warmup": 1}
    return controller.send_job(doc)


def wait_current(controller, agent, name, version):
    controller.wait_for(lambda: current(agent, name) == version, 30,
                        "{} back at {}\n{}".format(name, version, agent.log_tail()))


def test_model_set_switches_and_reverts_together_and_state_is_visible(controller, agent_factory,
                                                                     digits_files):
    extra = "models:\n  commit_timeout_s: 60\n  app_confirms: [det, cls]\n"
    agent = agent_factory(extra_config=extra).start()
    controller.wait_online()
    assert "model_sets" in controller.device_status[-1]["platform"]["features"]
    sock = os.path.join(agent.state_dir, "app.sock")
    for name in ("det", "cls"):  # v1 of each, alone
        named(controller, digits_files, name + "-1", name, "v1")
        controller.wait_stage(name + "-1", "committing", timeout=120)
        st = client.state(name, socket_path=sock)
        assert (st.version, st.state) == ("v1", "pending"), st
        assert ask(sock, {"op": "commit", "name": name})["ok"]
        assert final(controller, agent, name + "-1")["state"] == "SUCCEEDED"
    assert client.state("det", socket_path=sock).state == "committed"
    ls = {m["name"]: m for m in cli("models", "ls", "--state-dir", agent.state_dir,
                                    "--json")["models"]}
    assert ls["det"]["state"] == "committed" and ls["det"]["health"] == "ok", ls

    # Set s2: det v2 is confirmed, then the app calls cls v2 unhealthy: both go back to v1.
    set_job(controller, digits_files, "det-2", "det", "v2", "s2")
    controller.wait_stage("det-2", "committing", timeout=120)
    ls = {m["name"]: m for m in cli("models", "ls", "--state-dir", agent.state_dir,
                                    "--json")["models"]}
    assert (ls["det"]["version"], ls["det"]["state"]) == ("v2", "pending"), ls
    assert ask(sock, {"op": "commit", "name": "det", "version": "v2"})["ok"]
    done = final(controller, agent, "det-2")
    assert done["state"] == "SUCCEEDED", agent.log_tail()
    assert done["result"]["model_set"] == {"id": "s2", "state": "open"}, done["result"]
    assert current(agent, "det") == "v2"
    set_job(controller, digits_files, "cls-2", "cls", "v2", "s2")
    controller.wait_stage("cls-2", "committing", timeout=120)
    assert client.state("cls", socket_path=sock)[1:3] == ("v2", "pending")
    answer = ask(sock, {"op": "health", "name": "cls", "version": "v2", "ok": False,
                        "detail": "wrong classes"})
    assert answer["ok"], answer
    done = final(controller, agent, "cls-2")
    assert done["state"] == "FAILED" and done["error"]["code"] == "handoff_rolled_back", done
    wait_current(controller, agent, "cls", "v1")
    wait_current(controller, agent, "det", "v1")  # reverted with its set
    det = client.state("det", socket_path=sock)
    assert (det.version, det.state) == ("v1", "committed"), det
    assert "model set s2" in det.health and "wrong classes" in det.health, det
    assert client.state("cls", "v2", socket_path=sock).state == "rejected"
    out = cli("models", "show", "det", "--state-dir", agent.state_dir, "--json")
    assert out["current"] == "v1" and "wrong classes" in out["health"], out
    ls = {m["name"]: m for m in cli("models", "ls", "--state-dir", agent.state_dir,
                                    "--json")["models"]}
    assert "wrong classes" in ls["cls"]["health"] and ls["cls"]["version"] == "v1", ls

    # A job for a name of an open set must belong to it; set s3 commits when both are confirmed.
    set_job(controller, digits_files, "det-3", "det", "v3", "s3")
    controller.wait_stage("det-3", "committing", timeout=120)
    assert ask(sock, {"op": "commit", "name": "det"})["ok"]
    assert final(controller, agent, "det-3")["result"]["model_set"]["state"] == "open"
    named(controller, digits_files, "cls-x", "cls", "v9")  # no model_set: refused
    done = final(controller, agent, "cls-x")
    assert done["state"] == "REJECTED" and done["error"]["code"] == "bad_model_set", done
    set_job(controller, digits_files, "cls-3", "cls", "v3", "s3")
    controller.wait_stage("cls-3", "committing", timeout=120)
    assert ask(sock, {"op": "commit", "name": "cls"})["ok"]
    done = final(controller, agent, "cls-3")
    assert done["state"] == "SUCCEEDED", done
    assert done["result"]["model_set"] == {"id": "s3", "state": "committed"}, done["result"]
    assert current(agent, "det") == "v3" and current(agent, "cls") == "v3"
    assert not os.path.exists(os.path.join(agent.state_dir, "model_set.json"))
    assert agent.stop() == 0
    assert not controller.errors


def test_pin_refuses_other_versions_and_is_reported(controller, agent_factory, digits_files):
    controller.client.subscribe(MODELS_TOPIC, 1)
    agent = agent_factory().start()
    controller.wait_online()
    for job_id, version in (("d-1", "v1"), ("d-2", "v2")):
        named(controller, digits_files, job_id, "det", version)
        assert final(controller, agent, job_id)["state"] == "SUCCEEDED", agent.log_tail()
    assert current(agent, "det") == "v2"

    out = cli("models", "pin", "det", "v1", "--state-dir", agent.state_dir, "--json")
    assert out["pinned"] and out["switched_from"] == "v2", out
    assert current(agent, "det") == "v1"

    def pins_reported():
        msg = controller.models[-1] if controller.models else {}
        return msg.get("pins") == {"det": "v1"} and msg["models"][0]["version"] == "v1"

    controller.wait_for(pins_reported, 20, "models message with the pin")
    named(controller, digits_files, "d-3", "det", "v3")
    done = final(controller, agent, "d-3")
    assert done["state"] == "REJECTED" and done["error"]["code"] == "model_pinned", done
    assert "pinned to version v1" in done["error"]["message"], done
    assert current(agent, "det") == "v1"

    assert agent.stop() == 0  # the pin outlives the daemon
    ls = cli("models", "ls", "--state-dir", agent.state_dir, "--json")["models"]
    assert ls[0]["pinned"] == "v1", ls
    seen = len(controller.models)
    agent.start()
    controller.wait_for(lambda: len(controller.models) > seen and
                        controller.models[-1].get("pins") == {"det": "v1"}, 30,
                        "models message with the pin after a restart")
    out = cli("models", "unpin", "det", "--state-dir", agent.state_dir, "--json")
    assert out["was"] == "v1", out
    controller.wait_for(lambda: "pins" not in controller.models[-1], 20,
                        "models message without pins")
    named(controller, digits_files, "d-4", "det", "v3")
    assert final(controller, agent, "d-4")["state"] == "SUCCEEDED", agent.log_tail()
    assert current(agent, "det") == "v3"
    assert agent.stop() == 0
