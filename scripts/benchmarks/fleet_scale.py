"""The fleet service at scale: ``fleet serve`` (SQLite) with simulated devices
(scripts/simulate_devices.py, the real protocol over one MQTT connection) on a local Mosquitto.

- One stage of SCALE devices (default 10,000): every device SUCCEEDED; job documents per
  second as the devices received them; the controller's peak RSS and CPU seconds, also per
  1,000 devices.
- The same stage with every job document signed, as a production service does.
- Device identity is on (FLEET_IDENTITY=0 turns it off): each simulated device signs its
  reports with its own key and the service admits them by pre-provisioned keys
  (``--admission keys --admission-keys``), so every device message is verified; each row's
  name says which.
- Artifact egress: 10, 100 and 1,000 devices fetching the rollout's artifacts block by block,
  on the artifacts' shared (fan-out) block topics vs each on its own topics: bytes the
  controller published (the simulator's one connection receives each publication once).

    python scripts/lib/bench.py fleet_scale        (FLEET_SCALE=1000 for a quicker run)
"""

import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for path in (ROOT, os.path.join(ROOT, "scripts")):
    if path not in sys.path:
        sys.path.insert(0, path)

from simulate_devices import SimulatedFleet  # noqa: E402

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
SCALE = int(os.environ.get("FLEET_SCALE", "10000"))
EGRESS = [int(n) for n in os.environ.get("FLEET_EGRESS", "10,100,1000").split(",") if n]
TICKS = os.sysconf("SC_CLK_TCK")
FP16 = os.path.join(ROOT, "examples", "fp16_max")
BIG_MB = float(os.environ.get("FLEET_EGRESS_MB", "8"))  # the egress rollouts' model
IDENTITY = os.environ.get("FLEET_IDENTITY", "1") != "0"
BASELINE_MAX = 100  # per-device topics beyond this many devices: devices x size, not run


def big_model(work):
    """An fp32 model of about BIG_MB MiB (one large initializer): y = x + W."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    n = int(BIG_MB * 2 ** 20 / 4)
    w = numpy_helper.from_array(np.random.default_rng(1).random((1, n), dtype=np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "W"], ["y"])], "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path = os.path.join(work, "big.onnx")
    onnx.save(model, path)
    return path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SHIPPED_CONF = os.path.join(ROOT, "systemd", "mosquitto", "jetson-fleet.conf")
BIG_QUEUE = {"max_queued_messages": 1000000, "max_inflight_messages": 1000}


def shipped_limits():
    """The queue limits of the broker config the project ships, as its lines say."""
    import re

    with open(SHIPPED_CONF) as f:
        text = f.read()
    return {key: int(re.search(r"^{}\s+(\d+)\s*$".format(key), text, re.M).group(1))
            for key in ("max_queued_messages", "max_inflight_messages")}


def big_queue():
    """``--big-queue`` (or FLEET_BIG_QUEUE=1): the comparison run with a queue nothing fills."""
    return "--big-queue" in sys.argv[1:] or os.environ.get("FLEET_BIG_QUEUE") == "1"


def broker(work, limits=None):
    """A local Mosquitto; ``limits``: its queue limits (default: a queue nothing fills)."""
    port = free_port()
    conf = os.path.join(work, "mosquitto.conf")
    limits = limits or BIG_QUEUE
    with open(conf, "w") as f:
        f.write("listener {} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                "max_queued_messages {}\nmax_inflight_messages {}\n".format(
                    port, limits["max_queued_messages"], limits["max_inflight_messages"]))
    proc = subprocess.Popen([MOSQUITTO, "-c", conf], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return proc, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("mosquitto did not start")


def cli(args, db, **kw):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "agent", "fleet"] + args + ["--db", db],
                          env=env, cwd=ROOT, capture_output=True, text=True, **kw)


def count(db_path, sql):
    try:
        con = sqlite3.connect(db_path, timeout=30)
        try:
            return con.execute(sql).fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return 0


def proc_usage(pid):
    with open("/proc/{}/stat".format(pid)) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / float(TICKS)
    rss = 0
    with open("/proc/{}/status".format(pid)) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                rss = int(line.split()[1]) * 1024
    return cpu, rss


def one_rollout(n, fetch, timeout=1800, fanout=False, model=None, signed=False):
    """A rollout of ``n`` simulated devices; returns the measurements. ``signed``: the service
    signs every job document (Ed25519, sequence numbers persisted) as in production."""
    work = tempfile.mkdtemp(prefix="fleet-scale-")
    mosq, port = broker(work)
    db_path = os.path.join(work, "fleet.db")
    db = "sqlite:///" + db_path
    fleet = SimulatedFleet("127.0.0.1", port, n, name="sim", fetch=fetch, fanout=fanout,
                           identity=IDENTITY)
    admission = ["--admission", "keys", "--admission-keys", fleet.write_keys(os.path.join(
        work, "device-keys"))] if IDENTITY else ["--admission", "open"]
    serve = None
    try:
        fleet.start()
        env = dict(os.environ, PYTHONPATH=ROOT)
        signing = []
        if signed:
            made = subprocess.run([sys.executable, "-m", "agent", "fleet", "keygen", "--out",
                                   os.path.join(work, "keys"), "--json"], env=env, cwd=ROOT,
                                  capture_output=True, text=True)
            assert made.returncode == 0, made.stderr
            signing = ["--signing-key", json.loads(made.stdout)["private_key"],
                       "--sequence-file", os.path.join(work, "sequence.json")]
        serve = subprocess.Popen([sys.executable, "-m", "agent", "fleet", "serve", "--broker",
                                  "mqtt://127.0.0.1:{}".format(port), "--db", db] + signing +
                                 admission,
                                 env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=open(os.path.join(work, "serve.log"), "w"))
        deadline = time.monotonic() + timeout
        while count(db_path, "SELECT COUNT(*) FROM devices") < n:
            assert time.monotonic() < deadline and serve.poll() is None, "registry"
            time.sleep(0.5)
        cpu0, _ = proc_usage(serve.pid)
        t0 = time.time()
        what = ["--model", model, "--precision", "fp32", "--no-accuracy-gate"] if model else [
            "--model", os.path.join(FP16, "model.onnx"), "--inputs",
            os.path.join(FP16, "inputs.json"), "--golden", os.path.join(FP16, "golden.json"),
            "--precision", "fp16"]
        out = cli(["rollout"] + what + ["--match", "sim-*", "--rollout-id", "scale",
                                        "--submit", "--detach", "--timeout", str(timeout)], db)
        assert out.returncode == 0, out.stderr
        while count(db_path, "SELECT COUNT(*) FROM rollouts WHERE state = 'succeeded'") < 1:
            assert time.monotonic() < deadline and serve.poll() is None, (
                "rollout: {} of {} succeeded".format(fleet.succeeded, n))
            time.sleep(0.5)
        t1 = time.time()
        cpu1, rss = proc_usage(serve.pid)
        ok = count(db_path, "SELECT COUNT(*) FROM jobs WHERE state = 'SUCCEEDED'")
        size = count(db_path, "SELECT SUM(size) FROM artifacts")
        docs_window = max(1e-6, (fleet.last_doc or t1) - (fleet.first_doc or t0))
        return {"devices": n, "succeeded": ok, "seconds": t1 - t0,
                "docs_per_s": n / docs_window, "cpu_s": cpu1 - cpu0, "rss": rss,
                "block_bytes": fleet.block_bytes, "artifact_bytes": size}
    finally:
        stop(fleet, serve, mosq)
        shutil.rmtree(work, ignore_errors=True)


def stop(fleet, serve, mosq):
    """The simulator, then the service (if it still runs), then the broker."""
    fleet.stop()
    if serve is not None and serve.poll() is None:
        serve.terminate()
        serve.wait(30)
    mosq.terminate()
    mosq.wait(10)


def run():
    rows = []
    r = one_rollout(SCALE, fetch=False)
    rows.append({"name": "{} devices, one stage: SUCCEEDED (device identity {})".format(
        r["devices"], "on: signed reports, admitted by keys" if IDENTITY else "off"),
                 "ours": r["succeeded"], "unit": "devices", "goal": "all"})
    rows.append({"name": "rollout wall time", "ours": r["seconds"], "unit": "s"})
    rows.append({"name": "job documents received by devices", "ours": r["docs_per_s"],
                 "unit": "docs/s", "goal": ">= 1000"})
    rows.append({"name": "controller peak RSS", "ours": r["rss"] / 2 ** 20, "unit": "MiB"})
    rows.append({"name": "controller CPU per 1,000 devices", "ours":
                 r["cpu_s"] * 1000.0 / r["devices"], "unit": "CPU s"})
    signed = one_rollout(SCALE, fetch=False, signed=True)
    assert signed["succeeded"] == SCALE
    rows.append({"name": "job documents received, signed (Ed25519, sequence persisted)",
                 "ours": signed["docs_per_s"], "baseline": r["docs_per_s"],
                 "unit": "docs/s (baseline: unsigned)", "goal": ">= 1000"})
    rows.append({"name": "controller CPU per 1,000 devices, signed", "ours":
                 signed["cpu_s"] * 1000.0 / signed["devices"], "baseline":
                 r["cpu_s"] * 1000.0 / r["devices"], "unit": "CPU s (baseline: unsigned)"})
    work = tempfile.mkdtemp(prefix="fleet-big-")
    try:
        model = big_model(work)
        size = os.path.getsize(model)
        for n in EGRESS:
            e = one_rollout(n, fetch=True, fanout=True, model=model)
            p = one_rollout(n, fetch=True, fanout=False, model=model) \
                if n <= BASELINE_MAX else None
            rows.append({"name": "block bytes published, {} devices, {:.1f} MiB model".format(
                n, size / 2 ** 20), "ours": e["block_bytes"],
                "baseline": p["block_bytes"] if p else None,
                "ratio": e["block_bytes"] / float(size),
                "unit": "bytes (baseline: per-device topics; ratio: to the model's size)",
                "goal": "~1x per request window"})
            assert e["succeeded"] == n
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
