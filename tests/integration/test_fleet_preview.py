"""Previewing a deployment with real agents (onnxruntime backend) over a real Mosquitto and
``fleet serve`` on SQLite, the operator's CLI as a user types it:

- ``fleet devices`` shows labels (table and --json, from the registry and from the broker) and
  ``--selector`` lists the devices a selector matches;
- ``fleet deploy --dry-run`` lists the matched devices and what would change for each (install,
  already converged) and records nothing: no deployment row, no rollout;
- a selector that matches no device is refused with a code unless ``--allow-empty``;
- ``--on-leave remove``: a device relabelled out of the selector has the model uninstalled (its
  journal's versions and its models directory), the others keep it.
"""

import json
import os
import time

from agent.fleet.database.store import Store
from tests.integration.test_fleet_deployments import FP16, cli, wait_converged
from tests.integration.test_fleet_rollout import wait_status
from tests.integration.test_fleet_service import Service, fleet_cli, wait_registered

SITES = {"pv-0": "a", "pv-1": "a", "pv-2": "b"}


def counts(db):
    store = Store(db)
    try:
        return [store.db.query("SELECT COUNT(*) FROM " + t)[0][0]
                for t in ("deployments", "rollouts", "deployment_devices")]
    finally:
        store.close()


def test_dry_run_lists_what_would_change_and_records_nothing(mosquitto, agent_factory,
                                                              tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    agents = [agent_factory(n, extra_config="labels:\n  site: {}\n".format(s)).start()
              for n, s in sorted(SITES.items())]
    wait_status(mosquitto, list(SITES), agents=agents, timeout=120)
    service = Service(mosquitto, db, tmp_path).start()
    try:
        wait_registered(db, list(SITES), service, timeout=60)
        cli(["label", "pv-1", "tier=canary"], db)

        # Labels in the device list, from the registry and from the broker; --selector.
        rows = {r["device"]: r for r in json.loads(cli(["devices", "--json"], db))}
        assert rows["pv-1"]["labels"]["tier"] == "canary"  # the operator's
        assert rows["pv-2"]["labels"]["site"] == "b"  # the device's claim
        table = cli(["devices", "--selector", "site=a"], db)
        assert "LABELS" in table and "pv-0" in table and "pv-1" in table
        assert "pv-2" not in table and "site=a,tier=canary" in table
        out = fleet_cli(["devices", "--json", "--broker", mosquitto.url, "--wait", "0",
                         "--selector", "site in (a)"])
        assert out.returncode == 0, out.stderr
        assert {r["device"]: r["labels"]["site"] for r in json.loads(out.stdout)} == {
            "pv-0": "a", "pv-1": "a"}

        cli(["models", "push", os.path.join(FP16, "model.onnx"), "--name", "det", "--version",
             "3", "--inputs", os.path.join(FP16, "inputs.json"), "--golden",
             os.path.join(FP16, "golden.json"), "--precision", "fp32"], db)
        before = counts(db)

        # The preview: the two of site=a would install; nothing is recorded.
        plan = json.loads(cli(["deploy", "det@3", "--to", "site=a", "--id", "d3",
                               "--dry-run", "--json"], db))
        assert plan["dry_run"] is True and plan["selector"] == "site=a"
        assert {r["device"]: r["action"] for r in plan["devices"]} == {
            "pv-0": "install", "pv-1": "install"}
        text = cli(["deploy", "det@3", "--to", "site=a", "--dry-run"], db)
        assert "matches 2 device(s) (2 install)" in text and "nothing recorded" in text
        assert counts(db) == before

        # A selector matching nothing is refused, with its code; --allow-empty records it.
        out = fleet_cli(["deploy", "det@3", "--to", "site=nowhere", "--db", db])
        assert out.returncode == 2 and "selector_matches_nothing" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and counts(db) == before
        cli(["deploy", "det@3", "--to", "site=nowhere", "--id", "d-empty", "--allow-empty"],
            db)
        assert counts(db)[0] == before[0] + 1

        # Once deployed, the preview says the devices already run it.
        cli(["deploy", "det@3", "--to", "site=a", "--id", "d3", "--timeout", "300"], db)
        wait_converged(db, "d3", ["pv-0", "pv-1"], service)
        after = counts(db)
        plan = json.loads(cli(["deploy", "det@3", "--to", "site=a", "--dry-run", "--json"],
                              db))
        assert {r["device"]: (r["action"], r["current"]) for r in plan["devices"]} == {
            "pv-0": ("converged", "3"), "pv-1": ("converged", "3")}
        assert plan["would_supersede"] == ["d3"]
        assert counts(db)[:2] == after[:2]
    finally:
        service.stop()


def test_on_leave_remove_uninstalls_from_a_device_that_leaves_the_selector(
        mosquitto, agent_factory, tmp_path):
    from tests.integration.test_fleet_deployments import models_held

    db = "sqlite:///" + str(tmp_path / "fleet.db")
    names = ["rm-0", "rm-1"]
    events = str(tmp_path / "handoff-events")
    handoff = ("handoff:\n  - type: command\n    models: [det]\n    command: [sh, -c, "
               "'echo $JETSON_AGENT_MODEL_EVENT $JETSON_AGENT_MODEL_NAME "
               "$JETSON_AGENT_MODEL_VERSION >> {}.$0', {{}}]\n".format(events))
    agents = {n: agent_factory(n, extra_config="labels:\n  site: a\n" + handoff.replace(
        "{}", n)).start() for n in names}
    wait_status(mosquitto, names, agents=list(agents.values()), timeout=120)
    service = Service(mosquitto, db, tmp_path).start()
    try:
        wait_registered(db, names, service, timeout=60)
        cli(["models", "push", os.path.join(FP16, "model.onnx"), "--name", "det", "--version",
             "3", "--inputs", os.path.join(FP16, "inputs.json"), "--golden",
             os.path.join(FP16, "golden.json"), "--precision", "fp32"], db)
        cli(["deploy", "det@3", "--to", "site=a", "--id", "d3", "--on-leave", "remove",
             "--timeout", "300"], db)
        wait_converged(db, "d3", names, service)
        assert "on leave: remove" in cli(["deployments", "show", "d3"], db)
        gone = agents["rm-1"]
        models = os.path.join(gone.state_dir, "models", "det")
        assert os.path.isdir(models)

        cli(["label", "rm-1", "site=b"], db)  # leaves the selector
        deadline = time.monotonic() + 60
        while models_held(db, "rm-1").get("det") is not None or os.path.exists(models):
            assert time.monotonic() < deadline, service.tail() + gone.log_tail()
            time.sleep(0.3)
        with gone.journal() as journal:
            assert journal.model_versions("det") == []
        assert "model det removed" in gone.log_tail(20000)
        deadline = time.monotonic() + 30  # its hand-off entry let it go (off the main loop)
        while "revert det 3" not in open(events + ".rm-1").read():
            assert time.monotonic() < deadline, gone.log_tail()
            time.sleep(0.2)
        assert open(events + ".rm-0").read().split("\n")[:-1] == ["switch det 3"]
        assert models_held(db, "rm-0").get("det") == "3"  # still in the selector: kept
        assert "rm-1" not in {d["device"] for d in device_rows(db, "d3")}
    finally:
        service.stop()


def device_rows(db, dep):
    from agent.fleet.deployments import deployments

    store = Store(db)
    try:
        return deployments.device_states(store, dep)
    finally:
        store.close()
