"""Artifact egress with real agents: a transfer-only rollout (an fp32 model of EGRESS_MB MiB,
no accuracy gate) to EGRESS_AGENTS real agents (``jetson-agent run``, onnxruntime backend) at
once through a real ``fleet serve`` and a local Mosquitto. Egress is what the broker carried
on the block topics, counted by a separate subscriber to both the shared (fan-out) and the
per-device block topics (each publication once): the goal is one copy of the artifact per
rollout window (<= 1.1x its size), devices that miss a fan-out round joining the next.

    python scripts/lib/bench.py fleet_egress      (EGRESS_AGENTS=10,50; EGRESS_MB=16)
"""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for path in (ROOT, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "scripts", "benchmarks")):
    if path not in sys.path:
        sys.path.insert(0, path)

import fleet_sharing  # noqa: E402

from agent.wire.topics import DEFAULT_PREFIX  # noqa: E402

AGENTS = [int(n) for n in os.environ.get("EGRESS_AGENTS", "10,50").split(",") if n]
EGRESS_MB = float(os.environ.get("EGRESS_MB", "16"))


class _Counter(object):
    """Bytes on the block topics, each publication counted once."""

    def __init__(self, port, prefix=DEFAULT_PREFIX):
        import paho.mqtt.client as paho

        kwargs = {"client_id": "egress-counter", "protocol": paho.MQTTv5}
        if hasattr(paho, "CallbackAPIVersion"):
            kwargs["callback_api_version"] = paho.CallbackAPIVersion.VERSION2
        self.client = paho.Client(**kwargs)
        self.shared = self.own = 0
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *a, **k: self.ready.set()
        self.client.connect("127.0.0.1", port, 60)
        self.client.loop_start()
        self.client.subscribe([(prefix + "/artifacts/+/block/+", 0),
                               (prefix + "/devices/+/artifacts/+/block/+", 0)])
        assert self.ready.wait(10)

    def _on_message(self, client, userdata, message):
        with self.lock:
            if "/devices/" in message.topic:
                self.own += len(message.payload)
            else:
                self.shared += len(message.payload)

    def stop(self):
        self.client.loop_stop()
        self.client.disconnect()


def once(n):
    import fleet_scale

    from agent.fleet.database.store import Store

    bd = fleet_sharing._daemon_bench()
    workdir = tempfile.mkdtemp(prefix="bench-egress-")
    broker = bd._Broker(workdir)
    names = ["egr-{:02d}".format(i) for i in range(n)]
    agents, service, counter = [], None, None
    try:
        fleet_scale.BIG_MB = EGRESS_MB
        model = fleet_scale.big_model(workdir)
        size = os.path.getsize(model)
        agents = [fleet_sharing._agent(workdir, broker.port, name, sys.executable)
                  for name in names]
        db = "sqlite:///" + os.path.join(workdir, "fleet.db")
        service = subprocess.Popen(
            [sys.executable, "-m", "agent", "fleet", "serve", "--broker",
             "mqtt://127.0.0.1:{}".format(broker.port), "--db", db, "--admission", "open"],
            stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, "serve.log"), "w"),
            env=dict(os.environ, PYTHONPATH=ROOT), cwd=ROOT)
        deadline = time.monotonic() + 300
        while True:  # every agent registered with the service
            time.sleep(0.5)
            known = set()
            try:
                store = Store(db, schema="read")
            except Exception:  # noqa: BLE001 - not created yet
                continue
            known = {d["device"] for d in store.devices()}
            store.close()
            if set(names) <= known:
                break
            assert time.monotonic() < deadline, set(names) - known
        counter = _Counter(broker.port)
        started = time.perf_counter()
        out = fleet_sharing._fleet(["rollout", "--model", model, "--precision", "fp32",
                                    "--no-accuracy-gate", "--all", "--rollout-id", "egress",
                                    "--db", db, "--submit", "--json", "--quiet",
                                    "--timeout", "600"], timeout=900)
        seconds = time.perf_counter() - started
        assert out.returncode == 0, out.stderr[-2000:]
        import json

        ok = sum(1 for r in json.loads(out.stdout)["devices"] if r["state"] == "SUCCEEDED")
        time.sleep(1.0)  # the last blocks in flight reach the counter
        return {"agents": n, "succeeded": ok, "artifact_bytes": size,
                "shared_bytes": counter.shared, "own_bytes": counter.own,
                "ratio": (counter.shared + counter.own) / float(size), "seconds": seconds}
    finally:
        if counter is not None:
            counter.stop()
        fleet_sharing.stop(service, agents, broker)
        if os.environ.get("EGRESS_KEEP_LOG"):
            shutil.copy(os.path.join(workdir, "serve.log"), os.environ["EGRESS_KEEP_LOG"])
        shutil.rmtree(workdir, ignore_errors=True)


def run():
    rows = []
    for n in AGENTS:
        r = once(n)
        assert r["succeeded"] == n, r
        rows.append({"name": "block bytes on the broker, {} real agents, {:.1f} MiB model "
                     "(transfer-only)".format(n, r["artifact_bytes"] / 2 ** 20),
                     "ours": r["shared_bytes"] + r["own_bytes"], "ratio": r["ratio"],
                     "unit": "bytes (ratio: to the model's size; per-device topics: {})"
                     .format(r["own_bytes"]), "goal": "<= 1.1x"})
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
