"""The fleet service's web side at fleet scale: a SQLite fleet database with 1000 devices
(telemetry, active engines), 20 rollouts of 50 devices each and a day of telemetry history for
one device; the time of one ``/metrics`` scrape, the fleet page and a device page over HTTP
(median of 5), side by side with the plain read every view starts from (``Store.devices()``).
"""

import os
import statistics
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

DEVICES, ROLLOUTS, PER_ROLLOUT = 1000, 20, 50


def fill(url):
    from agent.fleet import history
    from agent.fleet.store import Store

    store = Store(url)
    now = time.time()
    model = "ab" * 32
    names = ["dev-{:04d}".format(i) for i in range(DEVICES)]
    store.upsert_devices({d: {"device": d, "online": i % 10 != 0, "boot": 1,
                              "platform": {"board": "Orin Nano" if i % 2 else "Xavier NX",
                                           "jetpack": "6.0", "tensorrt": "10.3",
                                           "backend": "tensorrt"},
                              "active_engines": [{"model": model, "engine_key": "k" * 64,
                                                  "precision": "fp16", "job_id": "ro-0",
                                                  "activated": now}]}
                          for i, d in enumerate(names)})
    metrics = {"temp_cpu_c": 51.0, "temp_gpu_c": 49.5, "power_total_mw": 7300,
               "power_vdd_in_mw": 7300, "gpu_percent": 40.0, "cpu_percent": 12.0,
               "ram_fraction": 0.4, "swap_fraction": 0.0}
    store.touch_devices({d: {"ts": now, "metrics": metrics} for d in names})
    for r in range(ROLLOUTS):
        rid = "ro-{}".format(r)
        devs = names[(r * PER_ROLLOUT) % DEVICES:][:PER_ROLLOUT]
        store.insert_rollout(rid, {"precision": "fp16", "artifacts": {"model": {
            "sha256": model, "name": "model.onnx", "size": 1}}}, [devs[:5], devs[5:]], 9e9)
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


def median_ms(fn, n=5):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000.0)
    return statistics.median(times)


def run():
    from agent.fleet.store import Store
    from agent.fleet.web.server import Dashboard

    work = tempfile.mkdtemp(prefix="bench-dashboard-")
    url = "sqlite:///" + os.path.join(work, "fleet.db")
    first = fill(url)
    dash = Dashboard(url).start()
    store = Store(url)
    try:
        def fetch(path):
            with urllib.request.urlopen(dash.url + path, timeout=60) as r:
                return r.read()

        base = median_ms(store.devices)
        rows = []
        for name, path in (("/metrics scrape", "/metrics"), ("fleet page", "/"),
                           ("device page (8640 samples)", "/devices/" + first)):
            size = len(fetch(path))
            rows.append({"name": "{}, {} devices, {} rollouts: {:.0f} KiB".format(
                name, DEVICES, ROLLOUTS, size / 1024.0), "ours": median_ms(lambda p=path: fetch(p)),
                "baseline": base, "unit": "ms", "goal": "< 1000 ms"})
        return rows
    finally:
        store.close()
        dash.stop()


if __name__ == "__main__":
    for row in run():
        print(row)
