"""The pure decisions of deployments with pins and attempts (no database, no I/O):
``deployments.decide``, ``backoff``, ``pins.effective`` and ``pins.reported``."""

from agent.fleet.deployments import deployments, pins

SHA = "4" * 64


def dep(state="active", **spec):
    base = {"precision": "fp16", "artifacts": {"model": {"sha256": SHA}}}
    base.update(spec)
    return {"deployment_id": "d4", "name": "det", "version": "4", "state": state,
            "spec": base}


def held(version, **extra):
    return dict({"models": [{"name": "det", "version": version, "state": "committed",
                             "model": SHA if version == "4" else "3" * 64}]}, **extra)


def timed_out(at):
    return {"state": "TIMED_OUT", "error": None, "updated": at, "open": False}


def test_a_pin_wins_over_the_deployment():
    pin = {"name": "det", "version": "3"}
    v = deployments.decide(dep(), True, held("3"), 10.0, None, 0.0, pin=pin)
    assert (v["state"], v["reason"], v["send"]) == ("waiting", "pinned to det@3", False)
    # a pin still in flight (a rollback not answered yet): hold whatever it runs
    v = deployments.decide(dep(), True, held("4"), 10.0, None, 0.0,
                           pin={"name": "det", "version": None})
    assert v["state"] == "waiting" and "rollback in flight" in v["reason"] and not v["send"]
    # pinned to the deployment's own version, held: converged
    v = deployments.decide(dep(), True, held("4"), 10.0, None, 0.0,
                           pin={"name": "det", "version": "4"})
    assert v["state"] == "converged"
    # no pin: sent
    assert deployments.decide(dep(), True, held("3"), 10.0, None, 0.0)["send"]


def test_a_fleet_pin_wins_over_the_devices_own():
    msg = held("3", pins={"det": "2", "../x": "1", "other": 7})
    assert pins.reported(msg) == {"det": "2"}
    assert pins.effective(None, msg, "det")["source"] == "device"
    assert pins.effective({"name": "det", "version": "3"}, msg, "det")["version"] == "3"
    assert pins.effective(None, msg, "cls") is None
    assert pins.reported({"pins": {str(i): "1" for i in range(500)}}).__len__() == \
        pins.MAX_DEVICE_PINS
    assert pins.reported({"pins": ["det"]}) == {} and pins.reported(None) == {}


def test_timeouts_back_off_exponentially_then_halt():
    d = dep(max_attempts=3, retry_backoff=5.0)
    assert [deployments.backoff(d["spec"], n) for n in (1, 2, 3)] == [5.0, 10.0, 20.0]
    assert deployments.backoff({"retry_backoff": 400.0}, 5) == deployments.BACKOFF_CAP_S
    v = deployments.decide(d, True, held("3"), 1.0, timed_out(100.0), 0.0, attempts=1,
                           now=101.0)
    assert (v["state"], v["send"], v["at"]) == ("retrying", False, 105.0)
    assert v["reason"].startswith("attempt 2 at")
    v = deployments.decide(d, False, held("3"), 1.0, timed_out(100.0), 0.0, attempts=1,
                           now=106.0)
    assert (v["state"], v["send"], v["at"]) == ("retrying", True, None)  # offline: sent too
    v = deployments.decide(d, False, held("3"), 1.0, timed_out(100.0), 0.0, attempts=3,
                           now=106.0)
    assert (v["state"], v["reason"], v["halt"], v["send"]) == ("failed", "offline", True, False)
    v = deployments.decide(d, True, held("3"), 1.0, timed_out(100.0), 0.0, attempts=3,
                           now=106.0)
    assert v["reason"] == "timed_out" and v["halt"]
    # retried after the timeouts: they count no more
    v = deployments.decide(d, True, held("3"), 1.0, timed_out(100.0), 200.0, attempts=0,
                           now=201.0)
    assert (v["state"], v["send"]) == ("waiting", True)


def test_waiting_says_why():
    assert deployments.decide(dep(), False, held("3"), 1.0, None, 0.0)["reason"] == "offline"
    assert deployments.decide(dep("paused"), True, held("3"), 1.0, None, 0.0)["reason"] == \
        "paused"
    v = deployments.decide(dep("halted"), True, held("3"), 1.0, None, 0.0)
    assert (v["state"], v["reason"], v["send"]) == ("waiting", "halted", False)
    failed = {"state": "FAILED", "error": {"code": "accuracy_gate_failed", "message": "0.2 > "
                                           "0.1"}, "updated": 5.0, "open": False}
    v = deployments.decide(dep(), True, held("3"), 1.0, failed, 0.0)
    assert (v["state"], v["reason"]) == ("failed", "accuracy_gate_failed: 0.2 > 0.1")
