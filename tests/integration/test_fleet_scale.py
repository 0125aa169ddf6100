"""1,500 simulated devices (scripts/simulate_devices.py: the real protocol, one connection)
in one stage of an embedded ``fleet rollout``, the size that deadlocked the old controller
(a full event queue blocking paho's thread while the main thread waited for a PUBACK): every
device SUCCEEDED, and the registry in the database lists all 1,500 (nothing truncated)."""

import json
import os
import sys

from tests.integration.test_fleet_service import ROOT, fleet_cli, fp16_args

sys.path.insert(0, os.path.join(ROOT, "scripts"))

from simulate_devices import SimulatedFleet  # noqa: E402

COUNT = 1500


def test_one_stage_of_1500_devices_ends_succeeded(mosquitto, tmp_path):
    fleet = SimulatedFleet(mosquitto.host, mosquitto.port, COUNT, name="scale")
    fleet.start()
    # spread over 100 connections (the broker's per-client costs), each with its own devices
    assert len(fleet.clients) == 100 and all(c.is_connected() for c in fleet.clients)
    assert sorted(sum(fleet.conn_devices, [])) == fleet.devices
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    try:
        out = fleet_cli(["rollout"] + fp16_args() + [
            "--match", "scale-*", "--rollout-id", "ro-scale", "--broker", mosquitto.url,
            "--db", db, "--admission", "open", "--embedded", "--json", "-q", "--timeout", "240"],
            timeout=300)
    finally:
        fleet.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert len(report["devices"]) == COUNT
    assert report["counts"] == {"SUCCEEDED": COUNT}
    devices = json.loads(fleet_cli(["devices", "--db", db, "--json"]).stdout)
    assert len(devices) == COUNT and devices[0]["board"] == "Simulated Jetson"
