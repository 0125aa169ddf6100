"""What an app developer looks for, end to end: real Mosquitto, a real daemon, the onnxruntime
backend, the app socket.

A model set of two names (``det`` and ``cls``, one job each with the same ``model_set``) is
switched name by name; the app reports the second unhealthy and both names go back to the
versions the set replaced; a second set whose members the app confirms is committed. The state
the app sees (``agent.client.state``) and ``models ls`` say pending, then committed, and the
health says why a name was rolled back. ``models pin`` switches a name back to a kept version,
refuses a job to another version (``model_pinned``), is reported in the retained models
message, survives a restart, and ``unpin`` lets the job through. A daemon killed -9 while the
set's second name is pending, and down past its commit deadline, comes back with both names at
the versions the set replaced. Every meta.json the daemon wrote matches its JSON Schema.
"""

import json
import os
import time

from agent import client
from agent.device.models import meta as model_meta
from agent.wire.json_schema import Validator
from tests.integration.test_daemon_deploy import deploy_doc
from tests.integration.test_named_models import MODELS_TOPIC, ask, cli, current, final, named


def set_job(controller, files, job_id, name, version, set_id):
    """A member of the model set ``set_id`` (det + cls)."""
    doc = deploy_doc(controller, {k: files[k] for k in ("model", "inputs", "goldens")}, job_id,
                     precision="fp32", model_name=name, model_version=version,
                     model_set={"id": set_id, "names": ["det", "cls"]})
    doc["bench"] = {"iterations": 5, "warmup": 1}
    doc["plan"]["shapes"] = {"input": [[1, 64], [8, 64], [512, 64]]}  # meta.json's profile
    return controller.send_job(doc)


def assert_metas_valid(agent):
    """Every meta.json under the models directory against agent/data/schemas/model_meta.json."""
    with open(model_meta.SCHEMA) as f:
        validator = Validator(json.load(f), "meta.json")
    seen = 0
    for folder, _, files in os.walk(os.path.join(agent.state_dir, "models")):
        if "meta.json" in files:
            with open(os.path.join(folder, "meta.json")) as f:
                meta = json.load(f)
            assert validator.first_violation(meta, folder) is None, \
                validator.first_violation(meta, folder)
            assert meta["schema_version"] == model_meta.SCHEMA_VERSION
            assert meta["portability"]["sm_count"] is None  # a host: no GPU
            if meta["job_id"].startswith(("det-", "cls-")) and meta["version"] != "v1":
                assert meta["profiles"] == [{"inputs": {"input": {  # a set job's plan.shapes
                    "min": [1, 64], "opt": [8, 64], "max": [512, 64]}}}], meta
            else:  # a dynamic batch and no plan shapes: no profile fixes it on this host
                assert meta["profiles"] == [], meta
            seen += 1
    assert seen >= 2


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
    assert done["result"]["model"]["set"] == {"id": "s2", "state": "open"}, done["result"]
    assert current(agent, "det") == "v2"
    ls = {m["name"]: m for m in cli("models", "ls", "--state-dir", agent.state_dir,
                                    "--json")["models"]}
    assert ls["det"]["set"] == {"id": "s2", "state": "open"} and "set" not in ls["cls"], ls
    listed = {m["name"]: m for m in ask(sock, {"op": "list"})["models"]}
    assert listed["det"]["set"] == {"id": "s2", "state": "open"}, listed
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
    assert final(controller, agent, "det-3")["result"]["model"]["set"]["state"] == "open"
    named(controller, digits_files, "cls-x", "cls", "v9")  # no model_set: refused
    done = final(controller, agent, "cls-x")
    assert done["state"] == "REJECTED" and done["error"]["code"] == "bad_model_set", done
    set_job(controller, digits_files, "cls-3", "cls", "v3", "s3")
    controller.wait_stage("cls-3", "committing", timeout=120)
    assert ask(sock, {"op": "commit", "name": "cls"})["ok"]
    done = final(controller, agent, "cls-3")
    assert done["state"] == "SUCCEEDED", done
    assert done["result"]["model"]["set"] == {"id": "s3", "state": "committed"}, done["result"]
    assert current(agent, "det") == "v3" and current(agent, "cls") == "v3"
    assert not os.path.exists(os.path.join(agent.state_dir, "model_set.json"))
    assert agent.stop() == 0
    assert not controller.errors
    assert_metas_valid(agent)


def test_model_set_crash_mid_way_recovers_to_the_set_it_replaced(controller, agent_factory,
                                                                 digits_files):
    extra = "models:\n  commit_timeout_s: 12\n  app_confirms: [det, cls]\n"
    agent = agent_factory(extra_config=extra).start()
    controller.wait_online()
    sock = os.path.join(agent.state_dir, "app.sock")

    def confirmed(job_id, name, version, set_id=None):
        if set_id:
            set_job(controller, digits_files, job_id, name, version, set_id)
        else:
            named(controller, digits_files, job_id, name, version)
        controller.wait_stage(job_id, "committing", timeout=120)
        assert ask(sock, {"op": "commit", "name": name})["ok"]
        assert final(controller, agent, job_id)["state"] == "SUCCEEDED", agent.log_tail()

    confirmed("det-1", "det", "v1")
    confirmed("cls-1", "cls", "v1")
    confirmed("det-2", "det", "v2", "s2")
    set_job(controller, digits_files, "cls-2", "cls", "v2", "s2")
    controller.wait_stage("cls-2", "committing", timeout=120)
    controller.wait_for(lambda: current(agent, "cls") == "v2", 30, "cls switched to v2")
    agent.kill()  # kill -9: det committed at v2, cls pending at v2
    with agent.journal() as journal:
        deadline = journal.pending_versions()[0]["deadline"]
    while time.time() <= deadline:  # down past cls v2's commit deadline
        time.sleep(0.2)
    agent.start()
    done = final(controller, agent, "cls-2", timeout=60)
    assert done["state"] == "FAILED" and done["error"]["code"] == "handoff_rolled_back", done
    wait_current(controller, agent, "cls", "v1")
    wait_current(controller, agent, "det", "v1")
    controller.wait_for(lambda: not os.path.exists(
        os.path.join(agent.state_dir, "model_set.json")), 30, "the set closed")
    out = cli("models", "ls", "--state-dir", agent.state_dir, "--json")["models"]
    assert {m["name"]: (m["version"], m["state"]) for m in out} == {
        "det": ("v1", "committed"), "cls": ("v1", "committed")}, out
    assert "model set s2 reverted" in {m["name"]: m for m in out}["det"]["health"], out
    assert agent.stop() == 0


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
    assert_metas_valid(agent)


def test_fleet_rollout_declares_a_model_set(mosquitto, agent_factory):
    """``fleet rollout --model-set``: the job documents carry the set to a device of this
    release, which commits it when its second name is committed."""
    from tests.integration.test_fleet_rollout import wait_status
    from tests.integration.test_fleet_service import fleet_cli

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "examples")
    agent = agent_factory("set-1").start()
    wait_status(mosquitto, ["set-1"], agents=[agent])
    results = []
    for name in ("det", "cls"):
        out = fleet_cli(["rollout", "--name", name, "--version", "v1",
                         "--model-set", "cam-1", "--model-set-names", "det,cls",
                         "--model", os.path.join(examples, "digits", "model.onnx"),
                         "--inputs", os.path.join(examples, "digits", "inputs.json"),
                         "--golden", os.path.join(examples, "digits", "golden.json"),
                         "--precision", "fp32", "--atol", "0.5", "--rtol", "0.5",
                         "--devices", "set-1", "--broker", mosquitto.url, "--timeout", "120",
                         "--json"], timeout=180)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        results.append(json.dumps(json.loads(out.stdout)))
    assert '"set": {"id": "cam-1", "state": "open"}' in results[0], results[0][-2000:]
    assert '"set": {"id": "cam-1", "state": "committed"}' in results[1], results[1][-2000:]
    bad = fleet_cli(["rollout", "--name", "det", "--model-set", "cam-1", "--model-set-names",
                     "cls,seg", "--model", os.path.join(examples, "digits", "model.onnx"),
                     "--precision", "fp32", "--no-accuracy-gate", "--devices", "set-1",
                     "--broker", mosquitto.url])
    assert bad.returncode != 0 and "bad_argument" in bad.stderr, bad.stderr
    assert agent.stop() == 0


def test_build_save_engine_meta_has_the_profile_and_matches_the_schema(tmp_path):
    """``jetson-agent build --save-engine`` writes the same meta.json beside the engine."""
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "examples")
    target = tmp_path / "d.engine"
    cli("build", os.path.join(examples, "digits", "model.onnx"), "--fp16", "--shapes",
        "input:1x64,8x64,64x64", "--save-engine", str(target), "--state-dir",
        str(tmp_path / "state"), "--json")
    meta = json.loads((tmp_path / "d.engine.json").read_text())
    with open(model_meta.SCHEMA) as f:
        assert Validator(json.load(f), "meta.json").first_violation(meta, "meta.json") is None
    assert meta["profiles"] == [{"inputs": {"input": {"min": [1, 64], "opt": [8, 64],
                                                      "max": [64, 64]}}}]
    assert meta["portability"]["dla_core"] is None and meta["schema_version"] == 1
