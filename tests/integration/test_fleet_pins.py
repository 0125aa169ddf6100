"""One truth, with real agents (onnxruntime backend, fp32 of the tiny model) over a real
Mosquitto, ``fleet serve`` on SQLite and the operator's CLI as a user types it:

- ``fleet rollback`` of a device that a deployment governs holds (it becomes a pin): for half a
  dozen of the runner's ticks and across a service restart the deployment sends nothing to it,
  ``fleet deployments show`` and /metrics show the pin; ``fleet unpin`` lets it converge;
  ``fleet deployments undo`` returns the deployment to its previous revision (the version it
  superseded) and the devices follow; ``fleet pin`` to a version a device does not run sends
  it;
- a wave whose only device goes away (frozen, then killed: its Will) halts after its
  attempts with the reason "offline"; back, the device converges after ``fleet deployments
  retry``.
"""

import json
import os
import signal
import time
import urllib.request

import pytest

from agent.fleet.database.store import Store
from agent.fleet.deployments import deployments
from tests.integration.test_fleet_deployments import FP16, cli, device_states, models_held
from tests.integration.test_fleet_rollout import wait_status
from tests.integration.test_fleet_service import Service, fleet_cli, wait_registered

COMMON = ["--inputs", os.path.join(FP16, "inputs.json"), "--golden",
          os.path.join(FP16, "golden.json"), "--precision", "fp32"]


def push(db, versions):
    for version in versions:
        cli(["models", "push", os.path.join(FP16, "model.onnx"), "--name", "det", "--version",
             version, "--notes", "v" + version] + COMMON, db)


def wait_for(what, check, service, timeout=240, agent=None):
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, "{}: not yet\n{}\n{}".format(
            what, service.tail(), agent.log_tail() if agent is not None else "")
        time.sleep(0.5)


def on_version(db, dep, devices, version):
    """Every device converged for ``dep`` and its models message shows ``version``."""
    states = device_states(db, dep)
    return all(states.get(d) == "converged" and models_held(db, d).get("det") == version
               for d in devices)


def rollouts(db, dep):
    store = Store(db)
    try:
        return deployments.rollouts_of(store, dep)
    finally:
        store.close()


def dashboard(db, *paths):
    """The bodies of the dashboard's ``paths`` (a dashboard on the same database)."""
    from agent.fleet.web.server import Dashboard

    dash = Dashboard(db).start()
    try:
        out = []
        for path in paths:
            with urllib.request.urlopen(dash.url + path, timeout=10) as r:
                out.append(r.read().decode())
        return out
    finally:
        dash.stop()


@pytest.mark.slow
def test_a_rollback_of_a_governed_device_holds_until_unpinned(mosquitto, agent_factory,
                                                              tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    names = ["pin-0", "pin-1"]
    agents = {n: agent_factory(n, extra_config="labels:\n  site: p\n").start() for n in names}
    wait_status(mosquitto, names, agents=list(agents.values()), timeout=120)
    service = Service(mosquitto, db, tmp_path).start()
    try:
        wait_registered(db, names, service, timeout=60)
        push(db, ["1", "2"])
        cli(["deploy", "det@1", "--to", "site=p", "--id", "dp1", "--timeout", "300"], db)
        wait_for("det@1", lambda: on_version(db, "dp1", names, "1"), service)
        cli(["deploy", "det@2", "--to", "site=p", "--id", "dp2", "--timeout", "300"], db)
        wait_for("det@2", lambda: on_version(db, "dp2", names, "2"), service)

        out = fleet_cli(["rollback", "--broker", mosquitto.url, "--db", db, "--device",
                         "pin-0", "--name", "det", "--reason", "camera drift", "--wait", "60"],
                        timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "rolled back to det@1" in out.stdout and "pinned" in out.stdout, out.stdout
        sent = rollouts(db, "dp2")
        shown = wait_for("pin shown", lambda: (lambda s: s if "pinned to det@1" in s else None)(
            cli(["deployments", "show", "dp2"], db)), service, timeout=60)
        assert "pin: pin-0 det@1 (fleet" in shown and "camera drift" in shown, shown
        # The runner looks at every deployment each tick (TICK_S, 0.5 s): six ticks with the
        # pin shown and nothing sent say it holds (the wave's own timeout is 300 s).
        held_until = time.monotonic() + 3
        while time.monotonic() < held_until:
            assert models_held(db, "pin-0").get("det") == "1", service.tail()
            assert rollouts(db, "dp2") == sent
            time.sleep(0.5)
        body, page, pins_page = dashboard(db, "/metrics", "/deployments/dp2", "/labels")
        assert "<h2>Pins</h2>" in page and "camera drift" in page, page
        assert 'href="/devices/pin-0"' in page.split("<h2>Pins</h2>")[1], page
        assert "camera drift" in pins_page, pins_page
        assert 'jetson_fleet_deployment_devices{deployment="dp2",state="pinned"} 1.0' in body
        assert 'jetson_fleet_deployment_devices{deployment="dp2",state="converged"} 1.0' in body
        shown = json.loads(cli(["deployments", "show", "dp2", "--json"], db))
        assert shown["summary"]["pinned"] == 1 and shown["summary"]["converged"] == 1
        assert [p["device_id"] for p in shown["pins"]] == ["pin-0"]

        # across a restart of the service: still held
        service.stop()
        service.start()
        service.wait_ready()
        held_until = time.monotonic() + 2
        while time.monotonic() < held_until:
            assert models_held(db, "pin-0").get("det") == "1", service.tail()
            assert rollouts(db, "dp2") == sent
            time.sleep(0.5)
        assert device_states(db, "dp2")["pin-0"] == "waiting"

        # unpinned: the deployment governs it again
        assert "unpinned" in cli(["unpin", "pin-0", "det"], db)
        wait_for("unpinned", lambda: on_version(db, "dp2", names, "2"), service)
        out = fleet_cli(["unpin", "pin-0", "det", "--db", db])
        assert out.returncode == 2 and "not_pinned" in out.stderr, out.stderr

        # undo: back to the revision dp2 superseded (det@1), then forward again
        out = cli(["deployments", "undo", "dp2"], db)
        assert "det@1" in out, out
        wait_for("undone", lambda: on_version(db, "dp2", names, "1"), service)
        history = json.loads(cli(["deployments", "history", "dp2", "--json"], db))
        assert [r["version"] for r in history] == ["1", "2", "1"]

        # a pin to a version the device does not run sends it; the deployment leaves it there
        out = cli(["pin", "pin-1", "det@2", "--reason", "canary"], db)
        assert "rollout pin-pin-1-" in out, out
        wait_for("pinned to @2", lambda: models_held(db, "pin-1").get("det") == "2" and
                 device_states(db, "dp2").get("pin-1") == "waiting", service)
        listed = json.loads(cli(["pin", "--json"], db))
        assert [(p["device_id"], p["version"], p["reason"]) for p in listed] == [
            ("pin-1", "2", "canary")]
        for agent in agents.values():
            assert agent.alive(), agent.log_tail()
    finally:
        service.stop()


@pytest.mark.slow
def test_a_wave_whose_device_went_offline_halts_then_retry_converges(mosquitto, agent_factory,
                                                                      tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    agent = agent_factory("gone-0", extra_config="labels:\n  site: q\n").start()
    wait_status(mosquitto, ["gone-0"], agents=[agent], timeout=120)
    service = Service(mosquitto, db, tmp_path).start()
    try:
        wait_registered(db, ["gone-0"], service, timeout=60)
        push(db, ["1"])
        # Frozen: the broker still holds its session (online), so the wave includes it.
        agent.proc.send_signal(signal.SIGSTOP)
        # Each rollout gives a device 15 s (a job on a loaded host takes a few); 2 attempts.
        cli(["deploy", "det@1", "--to", "site=q", "--id", "dq", "--timeout", "15",
             "--max-attempts", "2", "--retry-backoff", "1"], db)
        wait_for("first wave", lambda: "dq-w" in rollouts(db, "dq"), service, timeout=60)
        agent.kill()  # its connection closes: the broker publishes its Will
        agent.proc.wait(10)
        wait_status(mosquitto, ["gone-0"], online=False)

        def halted():
            store = Store(db)
            try:
                dep = deployments.get(store, "dq")
                states = {d["device"]: d for d in deployments.device_states(store, "dq")}
            finally:
                store.close()
            return (dep, states) if dep["state"] == "halted" else None

        dep, states = wait_for("halted", halted, service, timeout=120)
        assert "gone-0 (offline)" in dep["reason"], dep
        assert (states["gone-0"]["state"], states["gone-0"]["reason"]) == ("failed", "offline")
        assert len(rollouts(db, "dq")) == 2  # the wave and one retry, then no more
        shown = cli(["deployments", "show", "dq"], db)
        assert "halted" in shown and "offline" in shown, shown

        agent.start()  # back; halted, the deployment waits for the operator
        wait_status(mosquitto, ["gone-0"], agents=[agent], timeout=120)
        assert "recorded" in cli(["deployments", "retry", "dq"], db)
        wait_for("converged after retry", lambda: on_version(db, "dq", ["gone-0"], "1"),
                 service, agent=agent)
        store = Store(db)
        try:
            assert deployments.get(store, "dq")["state"] == "active"
        finally:
            store.close()
    finally:
        service.stop()
