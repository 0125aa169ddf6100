"""Read paths of a long-running fleet service against months of history: a SQLite fleet
database with 1,000 devices, ``FLEET_HISTORY`` (2,000) finished rollouts of 50 devices with
results (every 50th with failures; the newest 200 finished within the day) and one running
rollout of ``FLEET_RUNNING`` (1,000) devices; the time of the rollouts page, the fleet page
and one ``/metrics`` scrape over HTTP (median of 3), and of one service tick driving the
running rollout (median of 5), next to the plain read every view starts from
(``Store.devices()``).

Only public names that the parent revisions have too: the same script measures the code before
a change (run it with the older tree on PYTHONPATH).
"""

import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fleet_db import MODEL, median_ms, page_rows, register  # noqa: E402 - shared helpers

DEVICES, PER_ROLLOUT = 1000, 50
FINISHED = int(os.environ.get("FLEET_HISTORY", "2000"))
RUNNING = int(os.environ.get("FLEET_RUNNING", "1000"))  # above DEVICES: unregistered ones
RECENT = 200  # finished within the day: /metrics keeps their series


def _result(rid):
    return {"job_id": rid, "phase": "done", "job_stage": "activate", "finished": time.time(),
            "result": {"precision": "fp16", "throughput_qps": 900.0, "engine_key": "k" * 64,
                       "latency_ms": {"median": 1.1, "p99": 1.9},
                       "accuracy": {"passed": True, "max_abs_error": 0.01}}}


def fill(url):
    from agent.fleet.database.store import Store

    store = Store(url)
    now = time.time()
    names = ["dev-{:04d}".format(i) for i in range(DEVICES)]
    register(store, names, {"temp_cpu_c": 51.0, "power_total_mw": 7300, "gpu_percent": 40.0,
                            "ram_fraction": 0.4}, "ro-00000", now)
    spec = {"precision": "fp16", "artifacts": {"model": {"sha256": MODEL, "name": "model.onnx",
                                                         "size": 1}}}
    with store.transaction():
        for r in range(FINISHED):
            rid = "ro-{:05d}".format(r)
            devs = names[(r * PER_ROLLOUT) % DEVICES:][:PER_ROLLOUT]
            store.insert_rollout(rid, spec, [devs[:5], devs[5:]], now + 9e9)
            failed = set(devs[:3]) if r % 50 == 0 else set()
            store.save_rollout(rid, {
                "current_stage": 1, "state": "failed" if failed else "succeeded",
                "outcome": "failed" if failed else "succeeded",
                "finished": now - 60 * (FINISHED - r) if r >= FINISHED - RECENT
                else now - 86400 * 30}, {
                d: (0 if d in devs[:5] else 1, "FAILED" if d in failed else "SUCCEEDED",
                    dict(_result(rid), error={"code": "accuracy_gate", "message": "too far"})
                    if d in failed else _result(rid)) for d in devs})
    running = ["dev-{:04d}".format(i) for i in range(RUNNING)]
    store.insert_rollout("ro-running", spec, [running[:10], running[10:]], now + 9e9)
    store.save_rollout("ro-running", {"current_stage": 1},
                       {d: (0, "SUCCEEDED", _result("ro-running")) for d in running[:10]})
    store.close()


class _Conn(object):
    """The service's MQTT side is not exercised by a tick of an adopted rollout: only the
    topics it is built with."""

    def __init__(self):
        from agent.wire.topics import Topics

        self.topics = Topics()


def tick_ms(url):
    from agent.fleet.database.store import Store
    from agent.fleet.rollouts import durable
    from agent.fleet.service import FleetService

    store = Store(url)
    try:
        service = FleetService(store, _Conn(), instance="bench")
        service.rollouts["ro-running"] = durable.load(store, "ro-running")  # adopted
        service._tick()
        return median_ms(service._tick, 5)
    finally:
        store.close()


def run():
    work = tempfile.mkdtemp(prefix="bench-fleet-history-")
    url = "sqlite:///" + os.path.join(work, "fleet.db")
    fill(url)
    label = "{} finished rollouts x {}, 1 running of {}".format(FINISHED, PER_ROLLOUT, RUNNING)
    flat, scan = "flat in finished rollouts", "+ one scan of job keys (no JSON)"
    rows = page_rows(url, [(name + ", " + label + ": {kib:.0f} KiB", path, goal)
                           for name, path, goal in (("rollouts page", "/rollouts", flat),
                                                    ("fleet page", "/", scan),
                                                    ("/metrics scrape", "/metrics", scan))],
                     n=3, timeout=600)
    rows.append({"name": "one service tick, {}".format(label), "ours": tick_ms(url),
                 "baseline": rows[0]["baseline"], "unit": "ms", "goal": flat})
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
