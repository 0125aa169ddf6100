"""Switching the app to a new version under load (docs/benchmarks.md, "Model switch").

The example app (examples/app/serve.py) serves ``digits`` from a ``models_dir`` under a steady
load (examples/app/loadgen.py: 4 clients, back to back, 8 rows a request); the benchmark switches
``current`` between two versions the way the daemon does (the version's ``meta.json`` stamped
``activated``, then a new relative link renamed over ``current``: examples/app/fake_agent.py)
and waits until the app has served a request on the new version. Per switch: the time from
activation to that first request (the app's own record); over the run: every failed request.

- ours: the app's hot swap (the new version loaded and checked in a second session, then one
  reference replaced; requests in flight finish on the old one), ``JETSON_AGENT_SWITCHES``
  switches (default 120);
- baseline: what an app without a hot swap does, restarting on every switch (a ``command``
  hand-off running ``systemctl restart my-app``): the app process stopped and started again on
  the same port, ``JETSON_AGENT_RESTART_SWITCHES`` times (default 10; each costs ~1 s).
  Its failed-request count depends on how fast the clients retry (every 50 ms each).

And a real Triton (``_triton_switch``): request latency p50/p99/max during
``JETSON_AGENT_TRITON_SWITCHES`` switches of the ``triton`` hand-off (default 50; loads through
Triton's gRPC endpoint; back to back, or ``JETSON_AGENT_TRITON_GAP_S`` seconds apart) against
the same load without switches, in one run, from load clients in processes of their own, and
the CPU one switch costs Triton and the hand-off; then ``JETSON_AGENT_TRITON_HTTP_SWITCHES``
(default 5) loading through the HTTP load API instead.
``JETSON_AGENT_SWITCHES=0`` runs the Triton part alone.
"""

import os
import random
import shutil
import sys
import tempfile
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
APP = os.path.join(ROOT, "examples", "app")
for _path in (APP, os.path.dirname(os.path.abspath(__file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import _triton_switch  # noqa: E402 - scripts/benchmarks/_triton_switch.py
import demo_flow  # noqa: E402
import fake_agent  # noqa: E402
from loadgen import LoadGen  # noqa: E402

NAME = "digits"
VERSIONS = {"v1": os.path.join(ROOT, "examples", "digits", "model.onnx"),
            "v2": os.path.join(ROOT, "examples", "digits_v2", "model.onnx")}
THREADS = 4


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def hot_swap(workdir: str, switches: int) -> Dict[str, Any]:
    models = os.path.join(workdir, "models")
    for version, path in VERSIONS.items():
        fake_agent.install_version(models, NAME, version, path)
    fake_agent.activate(models, NAME, "v1")
    app = demo_flow.AppProcess(os.path.join(workdir, "hot"), NAME, models).start()
    gen = LoadGen(app.url, threads=THREADS).start()
    rng = random.Random(7)
    try:
        app.wait_serving("v1", 30)
        version = "v1"
        for i in range(switches):
            version = "v2" if version == "v1" else "v1"
            t = fake_agent.activate(models, NAME, version)
            app.wait(lambda s, t=t: any(w["activated"] == t for w in s["switches"]), 30,
                     "switch {} to {}".format(i + 1, version))
            time.sleep(rng.uniform(0.02, 0.1))  # both versions' requests in flight at times
        load = gen.stop()
        stats = app.stats()
    finally:
        gen.stop()
        app.stop()
    times = [w["switch_s"] for w in stats["switches"][1:]]  # the first is the app's start
    return {"times": times, "failed": load["failed"] + stats["failed"], "served": load["ok"],
            "seconds": load["seconds"]}


def restarts(workdir: str, switches: int) -> Dict[str, Any]:
    models = os.path.join(workdir, "models")
    fake_agent.activate(models, NAME, "v1")
    app = demo_flow.AppProcess(os.path.join(workdir, "restart-0"), NAME, models).start()
    port = app.url.rsplit(":", 1)[1]
    gen = LoadGen(app.url, threads=THREADS).start()
    times: List[float] = []
    try:
        app.wait_serving("v1", 30)
        version = "v1"
        for i in range(switches):
            version = "v2" if version == "v1" else "v1"
            t = fake_agent.activate(models, NAME, version)
            app.stop()  # the restart: stop, start again on the same port
            app = demo_flow.AppProcess(os.path.join(workdir, "restart-{}".format(i + 1)), NAME,
                                       models, extra=["--port", port]).start()
            first = app.wait_serving(version, 30)
            assert first["activated"] == t
            times.append(first["switch_s"])
            time.sleep(0.1)
        load = gen.stop()
    finally:
        gen.stop()
        app.stop()
    return {"times": times, "failed": load["failed"], "served": load["ok"]}


def run() -> List[Dict[str, Any]]:
    switches = int(os.environ.get("JETSON_AGENT_SWITCHES", "120"))
    restart_switches = int(os.environ.get("JETSON_AGENT_RESTART_SWITCHES", "10"))
    triton_switches = int(os.environ.get("JETSON_AGENT_TRITON_SWITCHES", "50"))
    triton_http = int(os.environ.get("JETSON_AGENT_TRITON_HTTP_SWITCHES", "5"))
    triton_rows = _triton_switch.rows(triton_switches, triton_http) if triton_switches else []
    if not switches:
        return triton_rows
    workdir = tempfile.mkdtemp(prefix="bench-switch-")
    try:
        ours = hot_swap(workdir, switches)
        base = restarts(workdir, restart_switches) if restart_switches else None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    def ms(values: List[float], q: float) -> float:
        return round(1000 * percentile(values, q), 1)

    rows = [
        {"name": "switches under load (ours: hot swap; baseline: restart)",
         "ours": len(ours["times"]), "baseline": len(base["times"]) if base else None,
         "unit": "count", "ratio": "-", "goal": ">= 100"},
        {"name": "switch time p50 (activation -> first request on it)",
         "ours": ms(ours["times"], 0.5), "baseline": ms(base["times"], 0.5) if base else None,
         "unit": "ms", "goal": "-"},
        {"name": "switch time max", "ours": ms(ours["times"], 1.0),
         "baseline": ms(base["times"], 1.0) if base else None, "unit": "ms", "goal": "-"},
        {"name": "failed requests during the switches", "ours": ours["failed"],
         "baseline": base["failed"] if base else None, "unit": "count", "ratio": "-",
         "goal": "0"},
        {"name": "requests served (4 clients, back to back)", "ours": ours["served"],
         "baseline": base["served"] if base else None, "unit": "count", "ratio": "-",
         "goal": "-"},
    ]
    return rows + triton_rows


if __name__ == "__main__":
    for row in run():
        print(row)
