"""Shared by the fleet database benchmarks (``dashboard``, ``fleet_history``): a registry of
devices with a board, an active engine and telemetry, medians of repeated calls, and pages of
a dashboard fetched over HTTP."""

import statistics
import time
import urllib.request

MODEL = "ab" * 32


def register(store, names, metrics, engine_job, now):
    """Every device online (but every 10th), on one of two boards, with an active engine that
    ``engine_job`` activated and one telemetry sample of ``metrics``."""
    store.upsert_devices({d: {"device": d, "online": i % 10 != 0, "boot": 1,
                              "platform": {"board": "Orin Nano" if i % 2 else "Xavier NX",
                                           "jetpack": "6.0", "tensorrt": "10.3",
                                           "backend": "tensorrt"},
                              "active_engines": [{"model": MODEL, "engine_key": "k" * 64,
                                                  "precision": "fp16", "job_id": engine_job,
                                                  "activated": now}]}
                          for i, d in enumerate(names)})
    store.touch_devices({d: {"ts": now, "metrics": metrics} for d in names})


def median_ms(fn, n=5):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000.0)
    return statistics.median(times)


def page_rows(url, pages, n=5, timeout=60):
    """One row per page ((name, path, goal); ``{kib}`` in the name: its size) of a dashboard
    over the database at ``url``: the median over HTTP of ``n`` fetches, next to the plain read
    every view starts from (``Store.devices()``)."""
    from agent.fleet.database.store import Store
    from agent.fleet.web.server import Dashboard

    dash = Dashboard(url).start()
    store = Store(url)
    try:
        def fetch(path):
            with urllib.request.urlopen(dash.url + path, timeout=timeout) as r:
                return r.read()

        base = median_ms(store.devices, n)
        rows = []
        for name, path, goal in pages:
            size = len(fetch(path))
            rows.append({"name": name.format(kib=size / 1024.0), "baseline": base,
                         "ours": median_ms(lambda p=path: fetch(p), n), "unit": "ms",
                         "goal": goal})
        return rows
    finally:
        store.close()
        dash.stop()
