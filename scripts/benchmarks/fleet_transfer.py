"""Artifact transfer to a real daemon, as the fleet service sends it, against the raw broker.

A random artifact of TRANSFER_MB MiB (scripts/benchmarks/daemon.py's set-up: a local
Mosquitto, ``jetson-agent run``, a controller with ``agent.wire.block_server.BlockServer``), timed
from the job document to the verified file in the device's store:

- over MQTT blocks (the device listens on the artifact's shared fan-out topic and says so;
  per-block hashes in the job, so every block is checked as it arrives);
- over HTTP Range requests from ``agent.fleet.transfer.http_source`` (the service's ``--http``).

Baseline: the same bytes as one message from ``mosquitto_pub`` to ``mosquitto_sub`` through the
same broker (no blocks, no resume, no verification). Best of REPEATS each.
"""

import hashlib
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

REPEATS = int(os.environ.get("FLEET_TRANSFER_REPEATS", "3"))


def _daemon_bench():
    """scripts/benchmarks/daemon.py (its broker, agent and controller set-up) as a module."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "lib"))
    from bench import load  # the benchmark runner's loader

    return load("daemon")


def _transfer(bd, workdir, ctl, index, http=None):
    from agent.wire.block_server import block_digests

    size = bd.TRANSFER_MB << 20
    path = os.path.join(workdir, "fleet-artifact-{}.bin".format(index))
    with open(path, "wb") as f:
        f.write(os.urandom(size))
    sha = ctl.server.add_file(path)
    digests = block_digests(path, 128 * 1024)
    list_path = path + ".blocks"
    with open(list_path, "wb") as f:
        f.write(digests)
    ctl.server.add_file(list_path)
    ref = {"sha256": sha, "size": size,
           "blocks": {"block_size": 128 * 1024, "sha256": hashlib.sha256(digests).hexdigest()}}
    if http is not None:
        ref["url"] = "http://127.0.0.1:{}/artifacts/{}".format(http.port, sha)
    seconds = bd.timed_transfer(workdir, ctl, "fx-{}".format(index), ref)
    os.unlink(path)
    return size / seconds / 1e6


def run():
    import shutil
    import tempfile

    from agent.fleet.transfer.http_source import HttpSource

    bd = _daemon_bench()
    workdir = tempfile.mkdtemp(prefix="bench-fleet-transfer-")
    broker = bd._Broker(workdir)
    agent = ctl = http = None
    try:
        ctl = bd._Controller(broker.port)
        agent = bd._start_agent(workdir, broker.port)
        if not ctl.online.wait(30):
            raise RuntimeError("the daemon did not come online")
        time.sleep(2.0)
        http = HttpSource("127.0.0.1", 0, ctl.server.files).start()
        mqtt = max(_transfer(bd, workdir, ctl, i) for i in range(REPEATS))
        over_http = max(_transfer(bd, workdir, ctl, 100 + i, http) for i in range(REPEATS))
        raw = max(bd._transfer_raw(workdir, broker.port) for _ in range(REPEATS))
    finally:
        if http is not None:
            http.stop()
        if agent is not None and agent.poll() is None:
            agent.terminate()
            agent.wait(30)
        if ctl is not None:
            ctl.close()
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    what = "{} MiB artifact to a daemon over loopback".format(bd.TRANSFER_MB)
    return [
        {"name": what + ", MQTT blocks (fan-out topic, per-block hashes)", "ours": mqtt,
         "baseline": raw, "unit": "MB/s", "ratio": mqtt / raw,
         "goal": ">= 0.8x raw mosquitto_pub -> mosquitto_sub"},
        {"name": what + ", HTTP Range requests", "ours": over_http, "baseline": raw,
         "unit": "MB/s", "ratio": over_http / raw, "goal": "(alternative source)"},
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
