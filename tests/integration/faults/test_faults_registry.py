"""The fault suite (``suite.py``): what an attacker or a careless operator does to the
controller's registry (issue 23): a flood of random telemetry keys leaves ``/metrics`` bounded
(devices x fixed labels), and an unsigned rollout to devices that require signed jobs fails at
once with the fix, instead of QUEUED then TIMED_OUT at its deadline. (10,000 of 10,000 devices
with the shipped broker limits: tests/integration/test_fleet_roll_call.py.)"""

import json
import os
import random
import sys
import time

from agent.fleet.admission import bounds
from agent.fleet.database.store import Store
from agent.fleet.mqtt_edge import FleetConnection
from agent.fleet.service import FleetService
from agent.fleet.web import metrics
from agent.wire import protocol
from tests.integration.faults.suite import REPORT, fault
from tests.integration.test_fleet_service import ROOT, fleet_cli, fp16_args

sys.path.insert(0, os.path.join(ROOT, "scripts"))

from simulate_devices import SimulatedFleet  # noqa: E402

FLOOD_DEVICES = 500


def _series(body):
    return [ln for ln in body.decode().splitlines() if ln and not ln.startswith("#")]


def test_random_telemetry_keys_leave_metrics_bounded(mosquitto, tmp_path):
    sim = SimulatedFleet(mosquitto.host, mosquitto.port, FLOOD_DEVICES, name="flood")
    sim.start()
    conn = FleetConnection(mosquitto.url).connect()
    store = Store("sqlite:///" + str(tmp_path / "fleet.db"))
    service = FleetService(store, conn, instance="flood-test")
    try:
        service.start()
        assert len(store.devices()) == FLOOD_DEVICES
        base_body, _ = metrics.exposition(store)
        rng = random.Random(23)
        sent = 0
        for dev in sim.devices:
            keys = ["{}_{:08x}{}".format(rng.choice(("temp", "power", "x")), rng.getrandbits(32),
                                         rng.choice(("_c", "_mw", ""))) for _ in range(256)]
            msg = {"device": dev, "ts": time.time(), "metrics": {k: 1.0 for k in keys}}
            protocol.validate("telemetry", msg)  # what any device may send
            sim.client.publish(service.topics.telemetry(dev), protocol.encode(msg), 1)
            sent += 1
        fault("telemetry_flood", sent)
        deadline = time.monotonic() + 60
        while service.stats["telemetry_capped"] < FLOOD_DEVICES:
            assert time.monotonic() < deadline, service.stats
            service.step(0.2)
        service._flush_devices()
        assert service.stats["telemetry_keys_dropped"] == FLOOD_DEVICES * (
            256 - bounds.MAX_TELEMETRY_KEYS)
        for row in store.devices():
            held = (row.get("telemetry") or {}).get("metrics") or {}
            assert len(held) <= bounds.MAX_TELEMETRY_KEYS
        # This thread's CPU time, not the wall clock: a loaded host (the suite at load 8) must
        # not fail a bound that is about the work a scrape does.
        t0 = time.thread_time()
        body, _ = metrics.exposition(store)
        took = time.thread_time() - t0
        extra = len(_series(body)) - len(_series(base_body))
        # Temperatures and power rails: at most 16 each a device, whatever it sends.
        assert 0 < extra <= FLOOD_DEVICES * 2 * bounds.MAX_SERIES_PER_FAMILY
        assert took < 1.0
        print("flood: {} -> {} series ({} bytes) for {} devices, scrape {:.2f} s of CPU".format(
            len(_series(base_body)), len(_series(body)), len(body), FLOOD_DEVICES, took))
    finally:
        conn.close()
        sim.stop()
        store.close()


def test_an_unsigned_rollout_to_devices_requiring_signatures_fails_fast(fleet, mosquitto,
                                                                        tmp_path):
    controller, make_agent = fleet
    make_agent("dev1")
    status = controller.wait_online("dev1")
    assert status["platform"]["requires_signed_jobs"] is True
    t0 = time.monotonic()
    out = fleet_cli(["rollout"] + fp16_args() + [
        "--devices", "dev1", "--broker", mosquitto.url, "--json", "-q",
        "--embedded", "--db", "sqlite:///" + str(tmp_path / "fleet.db")], timeout=120)
    took = time.monotonic() - t0
    fault("unsigned_rollout")
    assert out.returncode != 0, out.stdout[-2000:]
    assert "signing_required" in out.stderr and "--signing-key" in out.stderr, out.stderr[-2000:]
    assert took < 60
    REPORT["jobs_refused"] += 1
    devices = json.loads(fleet_cli(["devices", "--db", "sqlite:///" + str(
        tmp_path / "fleet.db"), "--json"]).stdout)
    assert [d["device"] for d in devices] == ["dev1"]
