"""Fleet engine sharing: a rollout to SHARING_DEVICES real agents of one class (``jetson-agent
run`` on the onnxruntime backend, each with its own empty engine cache) through a real
``fleet serve --http`` and a local Mosquitto, with ``--share-engines`` (ours) and without
(baseline). Measured: the rollout's wall time (``fleet rollout --submit`` until every device
ended) and the engines built (a device's result says built or adopted; without sharing every
device builds). On the host backend a build is the emulated model's (well under a second), so
the wall time shows the protocol's overhead (the wait for the builder, the upload and the
download); on a Jetson each avoided build is minutes of TensorRT.
"""

import importlib.util
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
EXAMPLE = os.path.join(ROOT, "examples", "fp16_max")


def _daemon_bench():
    spec = importlib.util.spec_from_file_location(
        "bench_daemon_helpers", os.path.join(ROOT, "scripts", "benchmarks", "daemon.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _agent(workdir, port, name):
    state = os.path.join(workdir, name)
    os.makedirs(state, exist_ok=True)
    config = os.path.join(state, "agent.yaml")
    with open(config, "w") as f:
        f.write("device_id: {}\nstate_dir: {}\nbackend: onnxruntime\ntelemetry_interval: 60\n"
                "broker:\n  host: 127.0.0.1\n  port: {}\nsecurity:\n  allow_unsigned: true\n"
                .format(name, os.path.join(state, "state"), port))
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
    from agent.fleet.store import Store

    workdir = tempfile.mkdtemp(prefix="bench-sharing-")
    broker = bd._Broker(workdir)
    names = ["cls-{:02d}".format(i) for i in range(DEVICES)]
    agents, service = [], None
    try:
        agents = [_agent(workdir, broker.port, n) for n in names]
        db = "sqlite:///" + os.path.join(workdir, "fleet.db")
        cmd = [sys.executable, "-m", "agent", "fleet", "serve", "--broker",
               "mqtt://127.0.0.1:{}".format(broker.port), "--db", db, "--http",
               "127.0.0.1:0", "--http-min-bytes", "1"] + (["--share-engines"] if share else [])
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
        return seconds, built, adopted, ok
    finally:
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
        shutil.rmtree(workdir, ignore_errors=True)


def run():
    bd = _daemon_bench()
    s_sec, s_built, s_adopted, s_ok = _once(bd, True, "ro-share")
    b_sec, b_built, _b_adopted, b_ok = _once(bd, False, "ro-noshare")
    what = "{} real agents of one class (onnxruntime), one rollout".format(DEVICES)
    return [
        {"name": what + ": engines built", "ours": s_built, "baseline": b_built,
         "unit": "builds", "goal": "1 build instead of {} ({} adopted; {}+{} succeeded)".format(
             DEVICES, s_adopted, s_ok, b_ok)},
        {"name": what + ": rollout wall time", "ours": s_sec, "baseline": b_sec, "unit": "s",
         "goal": "(host builds take < 1 s: the protocol's overhead)"},
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
