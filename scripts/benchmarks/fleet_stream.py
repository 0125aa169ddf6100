"""One stage of STREAM_DEVICES simulated devices (default 10,000; scripts/simulate_devices.py
over STREAM_CONNECTIONS MQTT connections, default 100; device identity on: every report signed
and verified) through ``fleet serve`` (SQLite) on a
local Mosquitto, timed at each end of the stream:

- first job document: when the first device received one, after the rollout's row was
  committed (``rollouts.created``, set in the transaction that inserts the row);
- job documents/s from the first to the last document the devices received;
- the database ``succeeded`` (``rollouts.finished``) after the last device's final status:
  both after the simulator handed it to its MQTT client and after the broker passed it on (a
  ``mosquitto_sub`` observer on the job status topics: the simulator's one connection queues
  its statuses on a busy host);
- the service's peak RSS (VmHWM) and CPU seconds.

    STREAM_DEVICES=50000 python scripts/benchmarks/fleet_stream.py
"""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for path in (ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "scripts", "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

import fleet_scale  # noqa: E402
from simulate_devices import SimulatedFleet  # noqa: E402

DEVICES = int(os.environ.get("STREAM_DEVICES", "10000"))
# The devices spread over this many simulator connections (one paho client each): a single
# connection carrying 50,000 devices stalls in the broker and the simulator themselves.
CONNECTIONS = int(os.environ.get("STREAM_CONNECTIONS", "100"))
FP16 = fleet_scale.FP16


class _Fleet(SimulatedFleet):
    """The simulator on its own connection, subscribed to its own devices' job topics only,
    subscribing again after a reconnection (a clean session loses the subscriptions), and
    recording when it sent each final status."""

    def start(self):
        subs = [(self.topics.prefix + "/devices/{}/jobs/+".format(d), 1) for d in self.devices]
        self.connects = 0
        self.last_final = None
        subscribe = self.client.subscribe

        def own(topics, *args, **kwargs):
            return [subscribe(subs[i:i + 500]) for i in range(0, len(subs), 500)]

        def on_connect(client, userdata, *rest):
            self.connects += 1
            if self.connects > 1:
                own(subs)

        self.client.on_connect = on_connect
        self.client.subscribe = own  # SimulatedFleet.start's wildcards: its devices' topics
        SimulatedFleet.start(self)

    def _finish(self, dev, job_id, kind):
        SimulatedFleet._finish(self, dev, job_id, kind)
        self.last_final = time.time()


def _observer(port, path):
    """mosquitto_sub printing each final job status as it passes the broker."""
    out = open(path, "w")
    return subprocess.Popen(
        [shutil.which("mosquitto_sub") or "/usr/bin/mosquitto_sub", "-p", str(port), "-q", "0",
         "-t", "jetson-agent/devices/+/jobs/+/status", "-F", "%U %p"],
        stdout=out, stderr=subprocess.DEVNULL)


def _last_final_seen(path):
    last = None
    with open(path, errors="replace") as f:
        for line in f:
            if '"SUCCEEDED"' in line or '"FAILED"' in line:
                last = float(line.split(" ", 1)[0])
    return last


def run_once(n, timeout=3600):
    work = tempfile.mkdtemp(prefix="fleet-stream-")
    mosq, port = fleet_scale.broker(work)
    db_path = os.path.join(work, "fleet.db")
    db = "sqlite:///" + db_path
    per = -(-n // CONNECTIONS)
    fleets = [_Fleet("127.0.0.1", port, min(per, n - i * per), name="sim{:03d}".format(i),
                     identity=True) for i in range(CONNECTIONS) if i * per < n]
    serve = observer = None
    load0 = os.getloadavg()
    try:
        for fleet in fleets:
            fleet.start()
        keys = os.path.join(work, "device-keys")
        with open(keys, "w") as f:
            for fleet in fleets:
                for signer in fleet.signers.values():
                    f.write(signer.key.public_base64 + "\n")
        env = dict(os.environ, PYTHONPATH=ROOT)
        serve = subprocess.Popen(
            [sys.executable, "-m", "agent", "fleet", "serve", "--broker",
             "mqtt://127.0.0.1:{}".format(port), "--db", db, "--admission", "keys",
             "--admission-keys", keys],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(work, "serve.log"), "w"))
        deadline = time.monotonic() + timeout
        # Every device registered, and the service started (its first heartbeat comes after
        # its start-up: the retained births and the roll call).
        while fleet_scale.count(db_path, "SELECT COUNT(*) FROM devices") < n or \
                fleet_scale.count(db_path, "SELECT COUNT(*) FROM services") < 1:
            assert time.monotonic() < deadline and serve.poll() is None, "registry"
            time.sleep(0.5)
        observer = _observer(port, os.path.join(work, "finals.txt"))
        time.sleep(1.0)
        cpu0, _ = fleet_scale.proc_usage(serve.pid)
        load1 = os.getloadavg()
        out = fleet_scale.cli(["rollout", "--model", os.path.join(FP16, "model.onnx"),
                               "--inputs", os.path.join(FP16, "inputs.json"), "--golden",
                               os.path.join(FP16, "golden.json"), "--precision", "fp16",
                               "--match", "sim*", "--rollout-id", "stream", "--submit",
                               "--detach", "--timeout", str(timeout)], db)
        assert out.returncode == 0, out.stderr
        while fleet_scale.count(db_path, "SELECT COUNT(*) FROM rollouts WHERE state = "
                                "'succeeded'") < 1:
            assert time.monotonic() < deadline and serve.poll() is None, (
                "rollout: {} of {} succeeded".format(sum(f.succeeded for f in fleets), n))
            time.sleep(0.2)
        cpu1, rss = fleet_scale.proc_usage(serve.pid)
        time.sleep(0.5)
        con = sqlite3.connect(db_path, timeout=30)
        created, finished = con.execute(
            "SELECT created, finished FROM rollouts WHERE rollout_id = 'stream'").fetchone()
        ok = con.execute("SELECT COUNT(*) FROM jobs WHERE state = 'SUCCEEDED'").fetchone()[0]
        con.close()
        seen = _last_final_seen(os.path.join(work, "finals.txt"))
        first_doc = min(f.first_doc for f in fleets if f.first_doc)
        last_doc = max(f.last_doc for f in fleets if f.last_doc)
        last_final = max(f.last_final for f in fleets if f.last_final)
        return {"devices": n, "succeeded": ok, "connections": len(fleets),
                "first_doc_s": first_doc - created,
                "docs_per_s": n / max(1e-6, last_doc - first_doc),
                "db_after_last_final_sent_s": finished - last_final,
                "db_after_last_final_at_broker_s": finished - seen if seen else None,
                "rss_mib": rss / 2.0 ** 20, "cpu_s": cpu1 - cpu0,
                "sim_connects": sum(f.connects for f in fleets), "load_before": load0,
                "load_at_submit": load1, "load_after": os.getloadavg(), "cores": os.cpu_count()}
    finally:
        for proc in (observer,):
            if proc is not None:
                proc.terminate()
        for fleet in fleets:
            fleet.stop()
        if serve is not None and serve.poll() is None:
            serve.terminate()
            serve.wait(30)
        mosq.terminate()
        mosq.wait(10)
        if os.environ.get("STREAM_KEEP_LOG"):
            shutil.copy(os.path.join(work, "serve.log"), os.environ["STREAM_KEEP_LOG"])
        shutil.rmtree(work, ignore_errors=True)


def run():
    r = run_once(DEVICES)
    return [
        {"name": "{} simulated devices, one stage, identity on: SUCCEEDED".format(DEVICES),
         "ours": r["succeeded"], "unit": "devices", "goal": "all"},
        {"name": "first job document after the rollout's row was committed",
         "ours": r["first_doc_s"], "unit": "s", "goal": "<= 2"},
        {"name": "job documents/s, first -> last, as the devices received them",
         "ours": r["docs_per_s"], "unit": "docs/s", "goal": ">= 1000"},
        {"name": "database succeeded after the last final status passed the broker",
         "ours": r["db_after_last_final_at_broker_s"], "unit": "s", "goal": "<= 10"},
        {"name": "database succeeded after the simulator sent the last final status",
         "ours": r["db_after_last_final_sent_s"], "unit": "s", "goal": "<= 10"},
        {"name": "service peak RSS", "ours": r["rss_mib"], "unit": "MiB", "goal": "<= 250"},
        {"name": "service CPU", "ours": r["cpu_s"], "unit": "CPU s"},
        {"name": "load average (1 min) at submission, {} cores".format(r["cores"]),
         "ours": r["load_at_submit"][0], "unit": ""},
    ]


if __name__ == "__main__":
    print(json.dumps(run_once(DEVICES), indent=1))
