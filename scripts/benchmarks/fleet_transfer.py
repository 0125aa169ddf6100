"""Artifact transfer to a real daemon, as the fleet service sends it, against the raw broker.

A random artifact of TRANSFER_MB MiB (scripts/benchmarks/daemon.py's set-up: a local
Mosquitto, ``jetson-agent run``, a controller with ``agent.wire.block_server.BlockServer``), timed
at the device: the daemon's own time from asking for the artifact to the verified file in its
store (its log line); the job document's delivery is the controller's part, reported
separately:

- over MQTT blocks (the device listens on the artifact's shared fan-out topic and says so;
  per-block hashes in the job, so every block is checked as it arrives);
- over HTTP Range requests from ``agent.fleet.transfer.http_source`` (the service's ``--http``).

Baseline: the same bytes as one message from ``mosquitto_pub`` to ``mosquitto_sub`` through the
same broker (no blocks, no resume, no verification), timed at the subscriber (from starting the
publisher to the subscriber's receive timestamp). REPEATS interleaved pairs (ours, raw), the
median of each and of the pairs' ratios.
"""

import hashlib
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

REPEATS = int(os.environ.get("FLEET_TRANSFER_REPEATS", "5"))


def _daemon_bench():
    """scripts/benchmarks/daemon.py (its broker, agent and controller set-up) as a module."""
    sys.path.insert(0, os.path.join(ROOT, "scripts", "lib"))
    from bench import load  # the benchmark runner's loader

    return load("daemon")


def _transfer(bd, workdir, ctl, index, http=None, pid=None):
    """(MB/s at the device, MB/s from the job document, the daemon's CPU seconds)."""
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
    cpu = bd._cpu_s(pid) if pid else 0.0
    seconds, device = bd.timed_transfer(workdir, ctl, "fx-{}".format(index), ref)
    cpu = (bd._cpu_s(pid) if pid else 0.0) - cpu  # download, verify, then the job's end
    os.unlink(path)
    return size / device / 1e6, size / seconds / 1e6, cpu


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
        pairs = []  # (ours at the device, ours from the job document, raw, CPU), interleaved
        for i in range(REPEATS):
            at_device, from_doc, cpu = _transfer(bd, workdir, ctl, i, pid=agent.pid)
            pairs.append((at_device, from_doc, bd._transfer_raw(workdir, broker.port), cpu))
        over_http = statistics.median(_transfer(bd, workdir, ctl, 100 + i, http)[0]
                                      for i in range(REPEATS))
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
    what = "{} MiB artifact to a daemon over loopback, median of {} interleaved pairs".format(
        bd.TRANSFER_MB, REPEATS)
    raw = statistics.median(p[2] for p in pairs)
    for p in pairs:
        print("pair: at the device {:.1f} MB/s, from the job document {:.1f} MB/s, raw {:.1f} "
              "MB/s, ratio {:.2f}, daemon CPU {:.3f} s".format(p[0], p[1], p[2], p[0] / p[2],
                                                               p[3]), file=sys.stderr)
    return [
        {"name": what + ", MQTT blocks (fan-out topic, per-block hashes), timed at the device "
         "(download start -> verified)", "ours": statistics.median(p[0] for p in pairs),
         "baseline": raw, "unit": "MB/s",
         "ratio": statistics.median(p[0] / p[2] for p in pairs),
         "goal": ">= 0.8x raw mosquitto_pub -> mosquitto_sub (timed at the subscriber)"},
        {"name": what + ", MQTT blocks as above, from the job document (controller's view)",
         "ours": statistics.median(p[1] for p in pairs), "baseline": raw, "unit": "MB/s",
         "ratio": statistics.median(p[1] / p[2] for p in pairs), "goal": "(context)"},
        {"name": what + ", the daemon's CPU per transfer (download, verify, the job's end)",
         "ours": statistics.median(p[3] for p in pairs), "baseline": None, "unit": "CPU s",
         "goal": "(profile: what the device spends)"},
        {"name": what + ", HTTP Range requests, timed at the device", "ours": over_http,
         "baseline": raw, "unit": "MB/s", "ratio": over_http / raw,
         "goal": "(alternative source)"},
    ]


if __name__ == "__main__":
    for row in run():
        print(row)
