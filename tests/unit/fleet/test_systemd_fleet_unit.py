"""systemd/jetson-agent-fleet.service: `systemd-analyze verify` accepts it without a warning,
and it runs `fleet serve` as a notify service restarted on any exit."""

import os

from tests.unit.device.test_systemd_unit import ROOT, settings, verify

UNIT = os.path.join(ROOT, "systemd", "jetson-agent-fleet.service")


def test_fleet_unit_verifies_and_restarts_the_service(tmp_path):
    with open(UNIT) as f:
        text = f.read()
    rc, complaints = verify(tmp_path, text)
    assert rc == 0 and not complaints, complaints
    service = settings(text)["Service"]
    assert service["Type"] == ["notify"] and service["Restart"] == ["always"]
    assert " fleet serve " in service["ExecStart"][0] and "--db " in service["ExecStart"][0]
