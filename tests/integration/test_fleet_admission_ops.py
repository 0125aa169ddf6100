"""Admission as an operator works it, with real agents (their own keys), a real Mosquitto and
``fleet serve`` on SQLite under ``--admission manual``:

- ``fleet devices accept --key`` takes the key file's path or a bare base64 line (the body of
  the .pub file); a bad key is an error with a code, never a traceback;
- rejecting an unknown id fails with ``unknown_device``;
- ``fleet rollout --devices X`` for a device that reported but is not admitted says it is
  pending admission and how to admit it;
- a rejected device that presents a new key waits in ``fleet devices pending`` again;
- ``fleet devices rm`` decommissions a device: key unpinned, retained topics cleared, out of
  the device list, its rows kept; its next birth waits as a new pending device.
"""

import json
import os
import time

from agent.fleet.database.store import Store
from tests.integration.conftest import provision_device_key
from tests.integration.test_fleet_rollout import directory, wait_status
from tests.integration.test_fleet_service import Service, fleet_cli, fp16_args


def cli(args, db, expect=0):
    out = fleet_cli(args + ["--db", db], timeout=120)
    assert out.returncode == expect, out.stdout + out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    return out


def pending(db):
    return {r["device"]: r["key_id"] for r in json.loads(cli(["devices", "pending", "--json"],
                                                             db).stdout)}


def wait_pending(db, device, service, key_id=None, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        now = pending(db)
        if device in now and key_id in (None, now[device]):
            return now[device]
        assert time.monotonic() < deadline, "{} not pending: {}\n{}".format(
            device, now, service.tail())
        time.sleep(0.3)


def key_state(db, device):
    store = Store(db)
    try:
        return (store.device_keys().get(device) or {}).get("state"), \
            {d["device"] for d in store.devices()}, store.device(device) is not None
    finally:
        store.close()


def test_accept_reject_pending_and_decommission(mosquitto, agent_factory, tmp_path,
                                                monkeypatch):
    monkeypatch.setenv("JETSON_AGENT_FLEET_ADMISSION", "manual")
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    a = agent_factory("ad-1").start()
    b = agent_factory("ad-2").start()
    wait_status(mosquitto, ["ad-1", "ad-2"], agents=[a, b], timeout=120)
    service = Service(mosquitto, db, tmp_path).start()
    try:
        service.wait_ready()
        wait_pending(db, "ad-1", service)
        wait_pending(db, "ad-2", service)

        # Not admitted yet: a rollout names the fix.
        out = cli(["rollout"] + fp16_args() + ["--devices", "ad-2", "--rollout-id", "r1",
                                               "--submit", "--detach"], db, expect=2)
        assert "ad-2 is pending admission: fleet devices accept ad-2" in out.stderr

        # --key: the .pub file's path; a bare base64 line (the PEM body); a bad one.
        pub_a = os.path.join(os.path.dirname(a.key_path), "device.pub")
        bad = cli(["devices", "accept", "ad-1", "--key", "not a key"], db, expect=2)
        assert "bad_argument" in bad.stderr and "expected an Ed25519 public key" in bad.stderr
        assert "admitted with key" in cli(["devices", "accept", "ad-1", "--key", pub_a],
                                          db).stdout
        with open(os.path.join(os.path.dirname(b.key_path), "device.pub")) as f:
            body = "".join(line.strip() for line in f if not line.startswith("-----"))
        assert "admitted with key" in cli(["devices", "accept", "ad-2", "--key", body],
                                          db).stdout

        # Rejecting a typo fails; a rejected device asking again with a new key is pending.
        assert "unknown_device" in cli(["devices", "reject", "ad-nobody"], db,
                                       expect=2).stderr
        assert key_state(db, "ad-nobody")[0] is None
        cli(["devices", "reject", "ad-2"], db)
        assert b.stop() == 0
        os.unlink(b.key_path)
        os.unlink(os.path.join(os.path.dirname(b.key_path), "device.pub"))
        # Re-flashed: a new identity, not in the test's --admission-keys (a listed key would be
        # admitted at once instead of waiting as pending).
        provision_device_key(os.path.dirname(b.key_path),
                             keys_file=str(tmp_path / "not-listed.keys"))
        b.start()
        wait_pending(db, "ad-2", service)
        assert key_state(db, "ad-2")[0] == "pending"

        # Decommissioned: unpinned, out of the device list, rows kept, topics cleared.
        deadline = time.monotonic() + 60
        while "ad-1" not in key_state(db, "ad-1")[1]:
            assert time.monotonic() < deadline, service.tail()
            time.sleep(0.3)
        assert a.stop() == 0
        wait_status(mosquitto, ["ad-1"], online=False)
        out = cli(["devices", "rm", "ad-1", "--broker", mosquitto.url], db)
        assert "decommissioned" in out.stdout and "0 retained" not in out.stdout
        state, listed, kept = key_state(db, "ad-1")
        assert state == "decommissioned" and "ad-1" not in listed and kept
        assert "ad-1" not in directory(mosquitto)  # its retained birth is gone
        store = Store(db)
        try:
            assert store.device_keys()["ad-1"].get("key_id") is None
        finally:
            store.close()
        a.start()  # born again: a new pending device
        wait_pending(db, "ad-1", service)
        assert "ad-1" not in key_state(db, "ad-1")[1]
    finally:
        service.stop()
