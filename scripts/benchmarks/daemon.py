"""The device daemon: idle footprint, and artifact transfer throughput over loopback.

- Idle RSS and CPU: ``jetson-agent run`` (the systemd command line) connected to a local
  Mosquitto, telemetry every 5 s, measured from /proc over IDLE_S seconds after it is ready.
  Baseline: a bare paho client that connects and idles (the least an MQTT agent in Python
  costs).
- Transfer: a random artifact of TRANSFER_MB MiB fetched by the daemon in 128 KiB blocks
  (requests with a want-bitmap, QoS 1, written and fsync'd into the store, verified by sha256)
  from a controller serving it with agent.wire.block_server.BlockServer, timed from the job
  document to the verified file in the store. Baseline: the same bytes as one message from
  ``mosquitto_pub`` to ``mosquitto_sub`` through the same broker (no blocks, no resume, no
  verification).
"""

import os
import queue
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

IDLE_S = 20.0
TELEMETRY_S = 5
TRANSFER_MB = 32
REPEATS = 5
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
TICKS = os.sysconf("SC_CLK_TCK")

BARE_CLIENT = r"""
import sys, time
import paho.mqtt.client as mqtt
try:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bare", protocol=mqtt.MQTTv5)
except AttributeError:
    c = mqtt.Client(client_id="bare", protocol=mqtt.MQTTv5)
c.connect(sys.argv[1], int(sys.argv[2]), 30)
c.subscribe("bare/#", 1)
c.loop_start()
print("ready", flush=True)
time.sleep(3600)
"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("broker did not start on port {}".format(port))


def _rss_mb(pid):
    with open("/proc/{}/status".format(pid)) as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def _cpu_s(pid):
    with open("/proc/{}/stat".format(pid)) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / float(TICKS)


def _idle(pid, seconds):
    cpu0, t0 = _cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    cpu1, t1 = _cpu_s(pid), time.monotonic()
    return _rss_mb(pid), 100.0 * (cpu1 - cpu0) / (t1 - t0)


class _Broker:
    def __init__(self, workdir):
        self.port = _free_port()
        conf = os.path.join(workdir, "mosquitto.conf")
        with open(conf, "w") as f:
            f.write("listener {} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                    "max_queued_messages 100000\nmessage_size_limit 0\n"
                    # as systemd/mosquitto/jetson-fleet.conf: Nagle off on client sockets
                    "set_tcp_nodelay true\n".format(self.port))
        self.proc = subprocess.Popen([MOSQUITTO, "-c", conf], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        _wait_port(self.port)

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def _start_agent(workdir, port):
    config = os.path.join(workdir, "agent.yaml")
    with open(config, "w") as f:
        f.write("device_id: bench1\nstate_dir: {}\nbackend: onnxruntime\n"
                "telemetry_interval: {}\nbroker:\n  host: 127.0.0.1\n  port: {}\n"
                # A loopback lab broker: the benchmark's jobs are unsigned.
                "security:\n  allow_unsigned: true\n".format(
                    os.path.join(workdir, "state"), TELEMETRY_S, port))
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("JETSON_AGENT_STATE_DIR", None)
    exe = shutil.which("jetson-agent", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "agent"]
    log = open(os.path.join(workdir, "agent.log"), "wb")
    proc = subprocess.Popen(cmd + ["run", "--config", config], stdout=log,
                            stderr=subprocess.STDOUT, env=env)
    log.close()
    return proc


class _Controller:
    def __init__(self, port):
        from agent.wire import mqtt, protocol
        from agent.wire.device.transfer import BlockServer
        from agent.wire.topics import Topics

        self.mqtt, self.protocol = mqtt, protocol
        self.topics = Topics()
        self.client = mqtt.MqttClient("bench-ctl", "127.0.0.1", port, events=queue.Queue())
        self.server = BlockServer(lambda t, p, q=1, r=False: self.client.publish(t, p, q, r),
                                  self.topics)
        self.online = threading.Event()
        self.ended = set()  # job ids that reached a terminal state
        for topic, qos in self.topics.controller_subscriptions():
            self.client.subscribe(topic, qos)
        self.client.start()
        self.client.wait_connected(10)
        self.stopping = False
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self):
        while not self.stopping:
            try:
                ev = self.client.events.get(timeout=0.2)
            except queue.Empty:
                continue
            if ev.kind != self.mqtt.MESSAGE:
                continue
            info = self.topics.parse(ev.topic)
            if info.kind == "artifact_request":
                self.server.handle_request(ev.topic, ev.payload)
            elif info.kind == "status" and ev.payload and b'"online":true' in ev.payload:
                self.online.set()
            elif info.kind == "job_status" and ev.payload:
                msg = self.protocol.decode("job_status", ev.payload)
                if self.protocol.is_terminal(msg["state"]):
                    self.ended.add(msg["job_id"])

    def send_job(self, doc):
        doc = dict(doc, protocol=1, device="bench1")
        self.client.publish(self.topics.job("bench1", doc["job_id"]),
                            self.protocol.encode(doc), qos=1, retain=True).wait(10)

    def close(self):
        self.stopping = True
        self.client.stop()


def device_seconds(workdir, job_id, timeout=30.0):
    """The daemon's own transfer time for ``job_id``: from asking for its artifacts to the
    last one verified in the store (its log line, agent.device.artifact_downloads)."""
    pattern = re.compile(r"job {}: downloaded and verified (\d+) bytes in ([0-9.]+) s".format(
        re.escape(job_id)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(os.path.join(workdir, "agent.log"), errors="replace") as f:
            found = pattern.search(f.read())
        if found:
            return float(found.group(2))
        time.sleep(0.05)
    raise RuntimeError("the daemon did not log the transfer of job {}".format(job_id))


def timed_transfer(workdir, ctl, job_id, ref):
    """Send a bench job for the artifact ``ref``; (seconds from the job document to the
    verified file in the daemon's store as this process saw it, the daemon's own seconds from
    download start to verified)."""
    stored = os.path.join(workdir, "state", "artifacts", ref["sha256"][:2], ref["sha256"])
    started = time.perf_counter()
    ctl.send_job({"job_id": job_id, "kind": "bench", "artifacts": {"model": ref},
                  "plan": {"precision": "fp32"}})
    deadline = time.monotonic() + 300
    while not os.path.exists(stored):
        if time.monotonic() > deadline:
            raise RuntimeError("the transfer did not finish")
        time.sleep(0.005)
    seconds = time.perf_counter() - started
    device = device_seconds(workdir, job_id)
    while job_id not in ctl.ended and time.monotonic() < deadline:
        time.sleep(0.05)  # the (random) model is then rejected: wait for the daemon to idle
    return seconds, device


def _transfer_ours(workdir, ctl, index):
    """MB/s of one plain transfer (no fan-out, no per-block hashes), timed at the device."""
    path = os.path.join(workdir, "artifact-{}.bin".format(index))
    with open(path, "wb") as f:
        f.write(os.urandom(TRANSFER_MB << 20))
    sha = ctl.server.add_file(path)
    _, seconds = timed_transfer(workdir, ctl, "xfer-{}".format(index),
                                {"sha256": sha, "size": TRANSFER_MB << 20})
    os.unlink(path)
    return (TRANSFER_MB << 20) / seconds / 1e6


def _transfer_raw(workdir, port):
    """MB/s of the same bytes as one QoS 1 message, ``mosquitto_pub -f`` to ``mosquitto_sub``,
    timed at the subscriber: from starting the publisher to the subscriber's own receive
    timestamp (``-F %U``), the payload's length checked."""
    path = os.path.join(workdir, "raw.bin")
    with open(path, "wb") as f:
        f.write(os.urandom(TRANSFER_MB << 20))
    # stdbuf: its debug lines (-d) unbuffered, so that its SUBACK can be waited for
    sub = subprocess.Popen(["stdbuf", "-oL", "mosquitto_sub", "-h", "127.0.0.1", "-p",
                            str(port), "-t", "raw/x", "-C", "1", "-q", "1", "--nodelay", "-F",
                            "%U %l", "-d"], stdout=subprocess.PIPE)
    assert sub.stdout is not None
    for line in sub.stdout:  # -d: the client's debug lines, up to its SUBACK
        if b"SUBACK" in line:
            break
    started = time.time()
    subprocess.run(["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-t", "raw/x",
                    "-q", "1", "--nodelay", "-f", path], check=True)
    out, _ = sub.communicate(timeout=120)
    stamp = length = None
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            stamp, length = float(parts[0]), int(parts[1])
    assert length == TRANSFER_MB << 20, out[-500:]
    return (TRANSFER_MB << 20) / (stamp - started) / 1e6


def run():
    workdir = tempfile.mkdtemp(prefix="bench-daemon-")
    broker = _Broker(workdir)
    rows = []
    agent = bare = ctl = None
    try:
        ctl = _Controller(broker.port)
        agent = _start_agent(workdir, broker.port)
        if not ctl.online.wait(30):
            raise RuntimeError("the daemon did not come online")
        time.sleep(2.0)  # past start-up
        bare = subprocess.Popen([sys.executable, "-c", BARE_CLIENT, "127.0.0.1",
                                 str(broker.port)], stdout=subprocess.PIPE)
        assert bare.stdout is not None and bare.stdout.readline().strip() == b"ready"
        results = {}

        def measure(name, pid):
            results[name] = _idle(pid, IDLE_S)

        threads = [threading.Thread(target=measure, args=("agent", agent.pid)),
                   threading.Thread(target=measure, args=("bare", bare.pid))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows.append({"name": "idle RSS (telemetry every {} s)".format(TELEMETRY_S),
                     "ours": round(results["agent"][0], 1),
                     "baseline": round(results["bare"][0], 1), "unit": "MB",
                     "goal": "<= 60 MB (baseline: bare paho client)"})
        rows.append({"name": "idle CPU over {:.0f} s".format(IDLE_S),
                     "ours": round(results["agent"][1], 3),
                     "baseline": round(results["bare"][1], 3), "unit": "% of a core",
                     "goal": "< 1% (baseline: bare paho client)"})
        pairs = [(_transfer_ours(workdir, ctl, i), _transfer_raw(workdir, broker.port))
                 for i in range(REPEATS)]  # interleaved: both see the same host load
        ours = statistics.median(p[0] for p in pairs)
        raw = statistics.median(p[1] for p in pairs)
        rows.append({"name": "artifact transfer, {} MiB over loopback, timed at the device "
                     "(median of {} interleaved pairs)".format(TRANSFER_MB, REPEATS),
                     "ours": round(ours, 1), "baseline": round(raw, 1), "unit": "MB/s",
                     "ratio": statistics.median(p[0] / p[1] for p in pairs),
                     "goal": ">= 0.5x raw mosquitto_pub -> mosquitto_sub"})
    finally:
        for proc in (agent, bare):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if ctl is not None:
            ctl.close()
        broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
