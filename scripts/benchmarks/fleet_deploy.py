"""Deployments at scale: ``fleet serve`` (SQLite) with simulated devices
(scripts/simulate_devices.py, labelled ``site=bench``) on a local Mosquitto, run as the product
runs: the broker with the shipped queue limits (systemd/mosquitto/jetson-fleet.conf; ``--big-queue``
or FLEET_BIG_QUEUE=1: a queue nothing fills, for comparison), every device with its own key
and admitted by the service's ``keys`` policy (the default ``manual`` would hold them pending),
job documents signed (``--signing-key``).

- ``fleet deploy det@3 --to site=bench`` over SCALE devices (default 10,000), one stage: the
  time until every device is converged (the deployment's recorded states), the controller's
  CPU seconds and peak RSS;
- then LATE devices (default 1,000) born at once: the time from their births until all of them
  converged (catch-up rollouts), the controller's CPU for it;
- the controller's CPU over IDLE_S seconds once converged (the tick works from changes: no
  scan of the fleet per tick);
- once the registry is complete, the devices each view counts (``fleet devices --db``, the
  dashboard, ``/metrics``); FLEET_DEPLOY_REGISTRY_ONLY=1 stops there;
- FLEET_DEPLOY_RESTART=1: then the service is stopped and started again with every device's
  birth retained: the time until it serves (its roll call over), until every device answered
  its call and was acknowledged, and the registry's count meanwhile (it never drops).

    python scripts/lib/bench.py fleet_deploy     (FLEET_DEPLOY_SCALE=1000 FLEET_DEPLOY_LATE=100)
    python scripts/benchmarks/fleet_deploy.py --big-queue
"""

import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
for path in (ROOT, os.path.join(ROOT, "scripts"), HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

import fleet_scale as fs  # noqa: E402
from simulate_devices import SimulatedFleet  # noqa: E402

SCALE = int(os.environ.get("FLEET_DEPLOY_SCALE", "10000"))
LATE = int(os.environ.get("FLEET_DEPLOY_LATE", "1000"))
IDLE_S = float(os.environ.get("FLEET_DEPLOY_IDLE_S", "10"))
TIMEOUT = 1800


def converged(db_path):
    return fs.count(db_path, "SELECT COUNT(*) FROM deployment_devices WHERE deployment_id = "
                    "'d3' AND state = 'converged'")


def wait(db_path, n, serve, what):
    deadline = time.monotonic() + TIMEOUT
    while converged(db_path) < n:
        assert time.monotonic() < deadline and serve.poll() is None, "{}: {} of {}".format(
            what, converged(db_path), n)
        time.sleep(0.2)


def count_views(db, web):
    """Devices each view counts: ``fleet devices --db``, the dashboard's overview card and
    ``/metrics`` (jetson_fleet_devices, summed over state and board)."""
    import json
    import re
    import urllib.request

    out = fs.cli(["devices", "--json"], db, timeout=600)
    listed = len(json.loads(out.stdout)) if out.returncode == 0 else -1
    base = "http://127.0.0.1:{}".format(web)
    page = urllib.request.urlopen(base + "/", timeout=60).read().decode()
    card = re.search(r"<b>(\d+)</b> devices", page)
    metrics = urllib.request.urlopen(base + "/metrics", timeout=60).read().decode()
    total = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                if line.startswith("jetson_fleet_devices{"))
    return {"fleet devices --db": listed, "dashboard": int(card.group(1)) if card else -1,
            "/metrics": int(total)}


def restarted(serve, work, db_path, fleet, scale):
    """``fleet serve`` stopped (SIGTERM) and started again with the same arguments: (the new
    process, its figures). Complete again when every device answered the new call and was
    acknowledged (agent.wire.rollcall); the registry's count is sampled all along."""
    args = serve.args
    old_call = fleet.call
    serve.terminate()
    serve.wait(60)
    log_path = os.path.join(work, "serve-restart.log")
    t0 = time.monotonic()
    serve = subprocess.Popen(args, env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=open(log_path, "w"))
    low, serving_s, deadline = scale, None, time.monotonic() + TIMEOUT
    while True:
        assert time.monotonic() < deadline and serve.poll() is None, "restart"
        low = min(low, fs.count(db_path, "SELECT COUNT(*) FROM devices"))
        text = open(log_path, errors="replace").read()
        if serving_s is None and "INFO agent.fleet: fleet service " in text:
            serving_s = time.monotonic() - t0
        with fleet.lock:
            call = fleet.call
            answered = sum(1 for t in fleet.acked.values() if t == call) \
                if call != old_call else 0
        if serving_s is not None and answered == scale:
            break
        time.sleep(0.2)
    roll = [line.split("roll call: ", 1)[1] for line in text.splitlines() if "roll call: " in
            line]
    return serve, {"serving_s": serving_s, "all_answered_s": time.monotonic() - t0,
                   "window_s": fleet.window_s, "registry_low": low,
                   "roll_call": roll[-1] if roll else None, "births": fleet.births}


def measure(scale=SCALE, late=LATE):
    import shutil

    work = tempfile.mkdtemp(prefix="fleet-deploy-")
    limits = None if fs.big_queue() else fs.shipped_limits()
    mosq, port = fs.broker(work, limits)
    db_path = os.path.join(work, "fleet.db")
    db = "sqlite:///" + db_path
    fleet = SimulatedFleet("127.0.0.1", port, scale, name="sim", labels={"site": "bench"},
                           identity=True)
    joiners = SimulatedFleet("127.0.0.1", port, late, name="late", labels={"site": "bench"},
                             identity=True)
    keys = os.path.join(work, "device-keys")
    with open(keys, "w") as f:  # as from manufacturing: every device's key, late ones too
        for sim in (fleet, joiners):
            f.write(open(sim.write_keys(keys + "." + sim.devices[0])).read())
    from agent.wire import job_signer

    signing = job_signer.generate_keypair(work, "bench-signing")["private_key"]
    serve = None
    load0 = os.getloadavg()
    try:
        fleet.start()
        env = dict(os.environ, PYTHONPATH=ROOT)
        t_start = time.monotonic()
        web = fs.free_port()
        serve = subprocess.Popen([sys.executable, "-m", "agent", "fleet", "serve", "--broker",
                                  "mqtt://127.0.0.1:{}".format(port), "--db", db,
                                  "--dashboard", "127.0.0.1:{}".format(web),
                                  "--admission", "keys", "--admission-keys", keys,
                                  "--signing-key", signing],
                                 env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=open(os.path.join(work, "serve.log"), "w"))
        deadline = time.monotonic() + TIMEOUT
        while fs.count(db_path, "SELECT COUNT(*) FROM devices") < scale:
            assert time.monotonic() < deadline and serve.poll() is None, "registry"
            time.sleep(0.5)
        registry_s = time.monotonic() - t_start
        views = count_views(db, web)
        restart = None
        if os.environ.get("FLEET_DEPLOY_RESTART") == "1":
            serve, restart = restarted(serve, work, db_path, fleet, scale)
            restart["views"] = count_views(db, web)
        if os.environ.get("FLEET_DEPLOY_REGISTRY_ONLY") == "1":  # the registry's figures alone
            return {"devices": scale, "registry_s": registry_s, "views": views,
                    "restart": restart, "queue": limits or fs.BIG_QUEUE,
                    "load": [load0, os.getloadavg()]}
        out = fs.cli(["models", "push", os.path.join(fs.FP16, "model.onnx"), "--name", "det",
                      "--version", "3", "--inputs", os.path.join(fs.FP16, "inputs.json"),
                      "--golden", os.path.join(fs.FP16, "golden.json"), "--precision",
                      "fp16"], db)
        assert out.returncode == 0, out.stderr
        cpu0, _ = fs.proc_usage(serve.pid)
        t0 = time.time()
        out = fs.cli(["deploy", "det@3", "--to", "site=bench", "--id", "d3", "--timeout",
                      str(TIMEOUT)], db)
        assert out.returncode == 0, out.stderr
        wait(db_path, scale, serve, "first wave")
        t1 = time.time()
        cpu1, rss1 = fs.proc_usage(serve.pid)
        joiners.start()  # every birth at once
        wait(db_path, scale + late, serve, "late joiners")
        t2 = time.time()
        cpu2, rss2 = fs.proc_usage(serve.pid)
        time.sleep(IDLE_S)  # measuring the idle tick: nothing to wait for
        cpu3, _ = fs.proc_usage(serve.pid)
        jobs = sum(len(v) for v in fleet.jobs.values()) + sum(
            len(v) for v in joiners.jobs.values())
        rollouts = fs.count(db_path, "SELECT COUNT(*) FROM deployment_rollouts")
        return {"devices": scale, "late": late, "wave_s": t1 - t0, "wave_cpu": cpu1 - cpu0,
                "late_s": t2 - t1, "late_cpu": cpu2 - cpu1, "rss": max(rss1, rss2),
                "idle_cpu_per_s": (cpu3 - cpu2) / IDLE_S, "jobs": jobs,
                "converged": converged(db_path), "rollouts": rollouts,
                "registry_s": registry_s, "views": views, "restart": restart,
                "queue": limits or fs.BIG_QUEUE,
                "load": [load0, os.getloadavg()]}
    finally:
        fleet.stop()
        joiners.stop()
        if serve is not None and serve.poll() is None:
            serve.terminate()
            serve.wait(30)
        mosq.terminate()
        mosq.wait(10)
        shutil.rmtree(work, ignore_errors=True)


def run():
    r = measure()
    if "wave_s" not in r:
        print(r)
        return []
    n = r["devices"] + r["late"]
    assert r["converged"] == n and r["jobs"] == n, r
    print("devices counted by each view once the registry was complete: {}".format(r["views"]))
    if r["restart"]:
        print("service restarted with every birth retained: {}".format(r["restart"]))
    print("broker queue {}, load average at start {:.1f}/{:.1f}/{:.1f}, at end "
          "{:.1f}/{:.1f}/{:.1f}".format(r["queue"], *(r["load"][0] + r["load"][1])))
    return [
        {"name": "registry complete ({} devices, admitted by keys) after the service's "
                 "start".format(r["devices"]), "ours": r["registry_s"], "unit": "s"},
        {"name": "deploy to {} devices (one stage): converged".format(r["devices"]),
         "ours": r["wave_s"], "unit": "s"},
        {"name": "controller CPU for the first wave, per 1,000 devices",
         "ours": r["wave_cpu"] * 1000.0 / r["devices"], "unit": "CPU s"},
        {"name": "{} late joiners at once: converged after their births".format(r["late"]),
         "ours": r["late_s"], "unit": "s", "goal": "< 60 s"},
        {"name": "controller CPU for the late joiners", "ours": r["late_cpu"],
         "unit": "CPU s"},
        {"name": "controller peak RSS", "ours": r["rss"] / 2 ** 20, "unit": "MiB"},
        {"name": "controller CPU once converged (idle ticks, {} devices)".format(n),
         "ours": r["idle_cpu_per_s"], "unit": "CPU s per s"},
        {"name": "jobs sent (one per device, none twice); rollouts", "ours": r["jobs"],
         "baseline": r["rollouts"], "unit": "jobs (baseline: rollouts)"},
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
