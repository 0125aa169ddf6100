"""Fleet engine sharing: a rollout to SHARING_DEVICES real agents of one class (``jetson-agent
run`` on the onnxruntime backend, each with its own empty engine cache) through a real
``fleet serve --http`` and a local Mosquitto, with ``--share-engines`` (ours) and without
(baseline). Measured: the engines built (a device's result says built or adopted; without
sharing every device builds), the device time spent building (the sum of the devices'
``build_seconds``) and the rollout's wall time (``fleet rollout --submit`` until every device
ended). On the host backend a build is the emulated model's (well under a second); to stand
for a TensorRT build, each build of the benchmark's agents first sleeps SHARING_BUILD_S
seconds (default 10: a worker wrapper patches the backend's ``build``; nothing else changes).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEVICES = int(os.environ.get("SHARING_DEVICES", "20"))
BUILD_S = float(os.environ.get("SHARING_BUILD_S", "10"))
# The agents' worker_python: the real worker, with a build that takes BUILD_S longer.
SLOW_WORKER = """#!{python}
import runpy, sys, time
from agent.engines.backends import onnxruntime as ort_backend
_build = ort_backend.OnnxRuntimeBackend.build
def build(self, *args, **kwargs):
    time.sleep({build_s})
    return _build(self, *args, **kwargs)
ort_backend.OnnxRuntimeBackend.build = build
assert sys.argv[1:3] == ["-m", "agent.worker"], sys.argv
sys.argv = ["agent.worker"] + sys.argv[3:]
runpy.run_module("agent.worker", run_name="__main__")
"""
EXAMPLE = os.path.join(ROOT, "examples", "fp16_max")


def _daemon_bench():
    """scripts/benchmarks/daemon.py (its broker, agent and controller set-up) as a module."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "lib"))
    from bench import load  # the benchmark runner's loader

    return load("daemon")


def _agent(workdir, port, name, worker):
    state = os.path.join(workdir, name)
    os.makedirs(state, exist_ok=True)
    config = os.path.join(state, "agent.yaml")
    with open(config, "w") as f:
        f.write("device_id: {}\nstate_dir: {}\nbackend: onnxruntime\ntelemetry_interval: 60\n"
                "worker_python: {}\n"
                "broker:\n  host: 127.0.0.1\n  port: {}\nsecurity:\n  allow_unsigned: true\n"
                .format(name, os.path.join(state, "state"), worker, port))
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("JETSON_AGENT_STATE_DIR", None)
    log = open(os.path.join(state, "agent.log"), "wb")
    return subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", config],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def _fleet(args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "agent", "fleet"] + args, env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _once(bd, share, tag):
    from agent.fleet.database.store import Store

    workdir = tempfile.mkdtemp(prefix="bench-sharing-")
    broker = bd._Broker(workdir)
    names = ["cls-{:02d}".format(i) for i in range(DEVICES)]
    agents, service = [], None
    try:
        worker = os.path.join(workdir, "slow-worker")
        with open(worker, "w") as f:
            f.write(SLOW_WORKER.format(python=sys.executable, build_s=BUILD_S))
        os.chmod(worker, 0o755)
        agents = [_agent(workdir, broker.port, n, worker) for n in names]
        db = "sqlite:///" + os.path.join(workdir, "fleet.db")
        cmd = [sys.executable, "-m", "agent", "fleet", "serve", "--broker",
               "mqtt://127.0.0.1:{}".format(broker.port), "--db", db, "--http",
               "127.0.0.1:0", "--http-min-bytes", "1"] + (
                   ["--share-engines", "--builders", names[0]] if share else [])
        service = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
        deadline = time.monotonic() + 120
        while True:  # every device registered with the service
            time.sleep(0.5)
            store = Store(db) if os.path.exists(db.split("sqlite:///")[-1]) else None
            known = {d["device"] for d in store.devices()} if store else set()
            if store:
                store.close()
            if set(names) <= known:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("devices not registered: {}".format(set(names) - known))
        started = time.perf_counter()
        out = _fleet(["rollout", "--model", os.path.join(EXAMPLE, "model.onnx"), "--inputs",
                      os.path.join(EXAMPLE, "inputs.json"), "--golden",
                      os.path.join(EXAMPLE, "golden.json"), "--precision", "fp16",
                      "--layer-precisions", "Add:float32", "Sub:float32",
                      "--check-error-stat", "median", "--all", "--rollout-id", tag,
                      "--db", db, "--submit", "--json", "--quiet"])
        seconds = time.perf_counter() - started
        if out.returncode != 0:
            raise RuntimeError("rollout failed: " + out.stderr[-2000:])
        rows = json.loads(out.stdout)["devices"]
        modes = [((r.get("share") or {}).get("mode"), r.get("cache_hit")) for r in rows]
        built = sum(1 for mode, hit in modes if mode == "built" or (mode is None and
                                                                   hit is False))
        adopted = sum(1 for r in rows if (r.get("share") or {}).get("mode") == "adopted")
        ok = sum(1 for r in rows if r["state"] == "SUCCEEDED")
        store = Store(db)
        try:
            build_s = sum(float((j.get("result") or {}).get("build_seconds") or 0)
                          for j in store.rollout_jobs(tag))
        finally:
            store.close()
        return seconds, built, adopted, ok, build_s
    finally:
        stop(service, agents, broker)
        shutil.rmtree(workdir, ignore_errors=True)


def stop(service, agents, broker):
    """The service, then every agent (killed after 30 s), then the broker."""
    if service is not None:
        service.terminate()
        service.wait(30)
    for a in agents:
        a.terminate()
    for a in agents:
        try:
            a.wait(30)
        except subprocess.TimeoutExpired:
            a.kill()
    broker.stop()


def run():
    bd = _daemon_bench()
    s_sec, s_built, s_adopted, s_ok, s_build = _once(bd, True, "ro-share")
    b_sec, b_built, _b_adopted, b_ok, b_build = _once(bd, False, "ro-noshare")
    what = "{} real agents of one class (onnxruntime), one rollout".format(DEVICES)
    return [
        {"name": what + ": engines built", "ours": s_built, "baseline": b_built,
         "unit": "builds", "goal": "1 build instead of {} ({} adopted; {}+{} succeeded)".format(
             DEVICES, s_adopted, s_ok, b_ok)},
        {"name": what + ": device time spent building (each build {:g} s longer)".format(
            BUILD_S), "ours": s_build, "baseline": b_build, "unit": "s",
         "goal": "about 1/{} of it".format(DEVICES)},
        {"name": what + ": rollout wall time", "ours": s_sec, "baseline": b_sec, "unit": "s",
         "goal": "(one stage: the builds ran in parallel; sharing adds the wait, the upload "
                 "and the download)"},
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
