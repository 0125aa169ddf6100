"""Deployments as desired state with real agents (onnxruntime backend, fp32 of the tiny model)
over a real Mosquitto, ``fleet serve`` on SQLite, the operator's CLI as a user types it:

- ``fleet models push`` det@3 and det@4; ``fleet deploy det@3 --to site=w3`` over 9 of 11
  agents (their config's ``labels:``), 3 of them offline during the first wave: they converge
  when they return;
- a device registered afterwards converges within 60 s of its birth;
- a re-imaged device (state directory wiped, same id) converges again;
- relabelling moves a device in (``fleet label``: the operator's word over the device's claim)
  and out;
- a canary deployment moves two devices to @4, then det@4 to the same group as det@3
  supersedes it: the others move from @3 to @4, the two already on @4 get no job.
"""

import json
import os
import shutil
import time

from agent.fleet.database.store import Store
from agent.fleet.deployments import deployments
from tests.integration.test_fleet_rollout import wait_status
from tests.integration.test_fleet_service import Service, fleet_cli, fleet_main, wait_registered

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FP16 = os.path.join(ROOT, "examples", "fp16_max")
W3 = ["dp-{:02d}".format(i) for i in range(9)]
LAB = ["dp-09", "dp-10"]
OFFLINE = ["dp-06", "dp-07", "dp-08"]
LATE = "dp-11"  # registered after the first wave
REIMAGED = "dp-04"  # its state directory wiped, same id
MOVED_IN, MOVED_OUT = "dp-09", "dp-05"  # relabelled by the operator


def cli(args, db):
    """``jetson-agent fleet ARGS --db DB`` as typed, in this process (no interpreter and its
    imports a command, which a loaded host makes seconds); its stdout."""
    code, out, err = fleet_main(args + ["--db", db])
    assert code == 0, out + err
    return out


def device_states(db, dep):
    store = Store(db)
    try:
        return {d["device"]: d["state"] for d in deployments.device_states(store, dep)}
    finally:
        store.close()


def wait_converged(db, dep, devices, service, timeout=240):
    deadline = time.monotonic() + timeout
    while True:
        now = device_states(db, dep)
        if all(now.get(d) == "converged" for d in devices):
            return now
        assert time.monotonic() < deadline, "not converged: {}\n{}".format(
            {d: now.get(d) for d in devices if now.get(d) != "converged"}, service.tail())
        time.sleep(0.5)


def jobs_of(agent):
    from agent.device.daemon import journal_path

    if not os.path.exists(journal_path(agent.state_dir)):
        return []  # not created yet by the (re-imaged) daemon
    with agent.journal() as journal:
        return [j["job_id"] for j in journal.jobs()]


def models_held(db, device):
    store = Store(db)
    try:
        row = store.db.query("SELECT message FROM device_models WHERE device_id = ?", (device,))
    finally:
        store.close()
    msg = json.loads(row[0][0]) if row else {}
    return {m["name"]: m["version"] for m in msg.get("models") or []}


def test_deployments_converge_over_real_agents(mosquitto, agent_factory, tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    agents = {}
    for name in W3 + LAB:
        site = "w3" if name in W3 else "lab"
        agents[name] = agent_factory(name, extra_config="labels:\n  site: {}\n".format(
            site)).start()
    wait_status(mosquitto, list(agents), agents=list(agents.values()), timeout=120)
    service = Service(mosquitto, db, tmp_path).start()
    try:
        wait_registered(db, list(agents), service, timeout=60)
        for name in OFFLINE:
            assert agents[name].stop() == 0
        wait_status(mosquitto, OFFLINE, online=False)
        common = ["--inputs", os.path.join(FP16, "inputs.json"), "--golden",
                  os.path.join(FP16, "golden.json"), "--precision", "fp32"]
        for version in ("3", "4"):
            cli(["models", "push", os.path.join(FP16, "model.onnx"), "--name", "det",
                 "--version", version, "--notes", "v" + version] + common, db)
        assert "det@4" in cli(["models", "ls"], db)

        # The first wave: the online devices of site=w3, in two stages.
        cli(["deploy", "det@3", "--to", "site=w3", "--id", "d3", "--percent", "50",
             "--timeout", "300"], db)
        online_w3 = [d for d in W3 if d not in OFFLINE]
        wait_converged(db, "d3", online_w3, service)
        assert {d for d, s in device_states(db, "d3").items() if s == "waiting"} == \
            set(OFFLINE)
        assert all(models_held(db, d).get("det") == "3" for d in online_w3)

        # The offline ones return; a new device is born; one is re-imaged.
        for name in OFFLINE:
            agents[name].start()
        late = agent_factory(LATE, extra_config="labels:\n  site: w3\n").start()
        agents[LATE] = late
        wait_registered(db, [LATE], service)
        born = time.monotonic()
        wait_converged(db, "d3", [LATE], service, timeout=60)
        assert time.monotonic() - born < 60
        wait_converged(db, "d3", OFFLINE, service)
        reimaged = agents[REIMAGED]
        assert reimaged.stop() == 0
        shutil.rmtree(reimaged.state_dir)
        reimaged.start()
        deadline = time.monotonic() + 120
        while not jobs_of(reimaged):  # its new journal gets the job again
            assert time.monotonic() < deadline, reimaged.log_tail()
            time.sleep(0.5)
        wait_converged(db, "d3", [REIMAGED], service)

        # Relabelled in (the operator's word over the device's claim of "lab") and out.
        cli(["label", MOVED_IN, "site=w3"], db)
        wait_converged(db, "d3", [MOVED_IN], service)
        cli(["label", MOVED_OUT, "site=lab"], db)
        deadline = time.monotonic() + 30
        while MOVED_OUT in device_states(db, "d3"):
            assert time.monotonic() < deadline, service.tail()
            time.sleep(0.5)
        assert "dp-10" not in device_states(db, "d3")
        assert "site=lab" in cli(["label", MOVED_OUT], db)

        # A canary moves dp-00 and dp-01 to @4; then det@4 supersedes det@3 for site=w3.
        for name in ("dp-00", "dp-01"):
            cli(["label", name, "canary=yes"], db)
        cli(["deploy", "det@4", "--to", "canary", "--id", "d4c", "--timeout", "300"], db)
        wait_converged(db, "d4c", ["dp-00", "dp-01"], service)
        before = {d: jobs_of(agents[d]) for d in ("dp-00", "dp-01")}
        out = cli(["deploy", "det@4", "--to", "site = w3", "--id", "d4", "--timeout", "300"],
                  db)
        assert "supersedes d3" in out
        members = [d for d in W3 + [MOVED_IN, LATE] if d != MOVED_OUT]
        wait_converged(db, "d4", members, service)
        assert all(models_held(db, d).get("det") == "4" for d in members)
        assert {d: jobs_of(agents[d]) for d in ("dp-00", "dp-01")} == before
        assert models_held(db, MOVED_OUT).get("det") == "3"  # out of the group: left alone
        shown = cli(["deployments", "show", "d4"], db)
        assert "{}/{} converged".format(len(members), len(members)) in shown, shown
        listed = cli(["deployments", "ls"], db)
        assert "superseded" in listed and "d4c" in listed
        # rm of a version kept on devices is refused; of one no one needs, done
        out = fleet_cli(["models", "rm", "det@3", "--db", db])
        assert out.returncode != 0 and "model_in_use" in out.stderr, out.stderr
        for agent in agents.values():
            assert agent.alive(), agent.log_tail()
    finally:
        service.stop()
