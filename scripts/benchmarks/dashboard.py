"""The fleet service's web side at fleet scale: a SQLite fleet database with 1000 devices
(telemetry, active engines), 20 rollouts of 50 devices each and a day of telemetry history for
one device; the time of one ``/metrics`` scrape, the fleet page and a device page over HTTP
(median of 5), side by side with the plain read every view starts from (``Store.devices()``).
"""

import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _fleet_db import MODEL, page_rows, register  # noqa: E402 - shared helpers

DEVICES, ROLLOUTS, PER_ROLLOUT = 1000, 20, 50


def fill(url):
    from agent.fleet.database import history
    from agent.fleet.database.store import Store

    store = Store(url)
    now = time.time()
    names = ["dev-{:04d}".format(i) for i in range(DEVICES)]
    metrics = {"temp_cpu_c": 51.0, "temp_gpu_c": 49.5, "power_total_mw": 7300,
               "power_vdd_in_mw": 7300, "gpu_percent": 40.0, "cpu_percent": 12.0,
               "ram_fraction": 0.4, "swap_fraction": 0.0}
    register(store, names, metrics, "ro-0", now)
    for r in range(ROLLOUTS):
        rid = "ro-{}".format(r)
        devs = names[(r * PER_ROLLOUT) % DEVICES:][:PER_ROLLOUT]
        store.insert_rollout(rid, {"precision": "fp16", "artifacts": {"model": {
            "sha256": MODEL, "name": "model.onnx", "size": 1}}}, [devs[:5], devs[5:]], 9e9)
        store.save_rollout(rid, {"current_stage": 1}, {d: (0, "SUCCEEDED", {
            "job_id": rid, "finished": now, "result": {
                "precision": "fp16", "throughput_qps": 900.0, "latency_ms": {
                    "median": 1.1, "p99": 1.9}, "accuracy": {"passed": True,
                                                             "max_abs_error": 0.01}}})
            for d in devs})
    rec = history.TelemetryHistory(store, min_interval_s=0.0)
    for i in range(8640):  # a day at one sample per 10 s
        rec.record({names[0]: {"metrics": metrics}}, now=now - 86400 + 10 * i)
    store.close()
    return names[0]


def run():
    work = tempfile.mkdtemp(prefix="bench-dashboard-")
    url = "sqlite:///" + os.path.join(work, "fleet.db")
    first = fill(url)
    label = "{}, " + "{} devices, {} rollouts".format(DEVICES, ROLLOUTS) + ": {{kib:.0f}} KiB"
    return page_rows(url, [(label.format(name), path, "< 1000 ms") for name, path in (
        ("/metrics scrape", "/metrics"), ("fleet page", "/"),
        ("device page (8640 samples)", "/devices/" + first))])


if __name__ == "__main__":
    for row in run():
        print(row)
