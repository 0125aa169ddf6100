"""One stage of STREAM_DEVICES simulated devices (default 10,000; scripts/simulate_devices.py
in STREAM_SIM_PROCESSES processes, default 2, over STREAM_CONNECTIONS MQTT connections in all,
default 100, each process's served by one network thread; device identity on: every report
signed and verified) through ``fleet serve`` (SQLite) on a local Mosquitto, timed at each end
of the stream:

- first job document: when the first device received one, after the rollout's row was
  committed (``rollouts.created``, set in the transaction that inserts the row);
- job documents/s from the first to the last document the devices received;
- the database ``succeeded`` (``rollouts.finished``) after the last device's final status:
  both after the simulator handed it to its MQTT client and after the broker passed it on (a
  ``mosquitto_sub`` observer on the job status topics: a busy simulator queues its
  statuses);
- the service's peak RSS (VmHWM) and CPU seconds; the simulator's and the broker's CPU and
  the host's idle CPU over the same window (``STREAM_TIMELINE=1``: the service's RSS every
  second from its launch; ``STREAM_PROFILE=FILE`` / ``STREAM_PROFILE_SIM=FILE``: py-spy).

A second shape (STREAM_SHAPE=service-first): one simulator process (this one) over the same
100 connections, the service started first on an empty registry, the births arriving while it
serves (acknowledged, agent.wire.rollcall), then a roll call from the broker by another client
(``fleet devices --json`` without ``--db``) counting every device, then the rollout.

The broker runs with the shipped queue limits (systemd/mosquitto/jetson-fleet.conf;
``--big-queue`` or FLEET_BIG_QUEUE=1: a queue nothing fills, for comparison) and the service
signs its job documents (``--signing-key``), as devices require by default.

    STREAM_DEVICES=50000 python scripts/benchmarks/fleet_stream.py [--big-queue]
"""

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
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
# Simulator processes sharing the devices and connections: one Python process (one GIL)
# signing three statuses a device was the slower end at 50,000 (its network thread 93 % busy,
# documents waiting in its sockets before they counted as received).
PROCESSES = int(os.environ.get("STREAM_SIM_PROCESSES", "2"))
SHAPE = os.environ.get("STREAM_SHAPE", "births-first")  # or service-first (one process)
FP16 = fleet_scale.FP16


class _RssSampler(threading.Thread):
    """The service's resident memory every 0.2 s, to place its peak: start-up, streaming the
    documents, or ingesting the last statuses."""

    def __init__(self, pid):
        threading.Thread.__init__(self, daemon=True)
        self.pid, self.samples, self.stopping = pid, [], threading.Event()

    def run(self):
        while not self.stopping.wait(0.2):
            try:
                with open("/proc/{}/status".format(self.pid)) as f:
                    rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
            except (OSError, StopIteration):
                return
            self.samples.append((time.time(), rss / 1024.0))

    def peak(self, start, end):
        return max([m for t, m in self.samples if start <= t <= end] or [0.0])


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


class _SimulatorProcesses(object):
    """``scripts/simulate_devices.py`` in ``processes`` processes (devices ``sim0-...``,
    ``sim1-...``), the connections split between them; what ``run_once`` reads of a
    ``SimulatedFleet``, gathered from their ``--stats`` files when they stop."""

    def __init__(self, port, n, work, processes, connections):
        self.procs, self.work = [], work
        self.counts = [n // processes + (1 if k < n % processes else 0)
                       for k in range(processes)]
        self.conns = [max(1, connections // processes) for _ in range(processes)]
        self.port = port
        self.first_doc = self.last_doc = self.last_final = None
        self.succeeded = self.connects = 0
        self.clients = [None] * sum(self.conns)

    def start(self):
        script = os.path.join(ROOT, "scripts", "simulate_devices.py")
        for k, (count, conns) in enumerate(zip(self.counts, self.conns)):
            out = open(os.path.join(self.work, "sim{}.out".format(k)), "w")
            self.procs.append(subprocess.Popen(
                [sys.executable, script, "--broker", "mqtt://127.0.0.1:{}".format(self.port),
                 "--count", str(count), "--name", "sim{}".format(k), "--connections",
                 str(conns), "--identity", os.path.join(self.work, "keys{}".format(k)),
                 "--stats", os.path.join(self.work, "stats{}.json".format(k))],
                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=ROOT)))
        deadline = time.monotonic() + 300
        for k, proc in enumerate(self.procs):
            while "online" not in open(os.path.join(self.work, "sim{}.out".format(k))).read():
                assert proc.poll() is None and time.monotonic() < deadline, "simulator {}".format(k)
                time.sleep(0.2)

    def write_keys(self, path):
        with open(path, "w") as f:
            for k in range(len(self.procs)):
                f.write(open(os.path.join(self.work, "keys{}".format(k))).read())
        return path

    def alive(self):
        return all(p.poll() is None for p in self.procs)

    def cpu(self):
        return sum(fleet_scale.proc_usage(p.pid)[0] for p in self.procs if p.poll() is None)

    def stop(self):
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        stats = []
        for k, proc in enumerate(self.procs):
            proc.wait(60)
            path = os.path.join(self.work, "stats{}.json".format(k))
            if os.path.exists(path):
                stats.append(json.load(open(path)))
        firsts = [st["first_doc"] for st in stats if st["first_doc"]]
        self.first_doc = min(firsts) if firsts else None
        for key in ("last_doc", "last_final"):
            values = [st[key] for st in stats if st[key]]
            setattr(self, key, max(values) if values else None)
        self.succeeded = sum(st["succeeded"] for st in stats)
        self.connects = sum(st["connects"] for st in stats)


def _others_cpu(broker_pid, fleet):
    """(the simulator's CPU s; the broker's; the host's idle CPU s; wall s)."""
    if isinstance(fleet, _SimulatorProcesses):
        sim = fleet.cpu()
    else:  # this process
        mine = os.times()
        sim = mine.user + mine.system
    with open("/proc/stat") as f:
        idle = int(f.readline().split()[4]) / float(fleet_scale.TICKS)
    return sim, fleet_scale.proc_usage(broker_pid)[0], idle, time.monotonic()


def run_once(n, timeout=3600):
    work = tempfile.mkdtemp(prefix="fleet-stream-")
    limits = None if fleet_scale.big_queue() else fleet_scale.shipped_limits()
    mosq, port = fleet_scale.broker(work, limits)
    db_path = os.path.join(work, "fleet.db")
    db = "sqlite:///" + db_path
    service_first = SHAPE == "service-first"
    if PROCESSES > 1 and not service_first:
        fleet = _SimulatorProcesses(port, n, work, PROCESSES, min(CONNECTIONS, n))
    else:
        fleet = SimulatedFleet("127.0.0.1", port, n, name="sim", identity=True,
                               connections=min(CONNECTIONS, n))
    serve = observer = profiler = None
    profilers_sim = []
    load0 = os.getloadavg()
    roll_call = None
    try:
        if not service_first:
            fleet.start()
        keys = fleet.write_keys(os.path.join(work, "device-keys"))
        from agent.wire import job_signer

        signing = job_signer.generate_keypair(work, "bench-signing")["private_key"]
        env = dict(os.environ, PYTHONPATH=ROOT)
        # STREAM_CPROFILE=FILE: the service under cProfile (written when it exits), for the
        # cost per document by function.
        cprof = ["-m", "cProfile", "-o", os.environ["STREAM_CPROFILE"]] \
            if os.environ.get("STREAM_CPROFILE") else []
        if os.environ.get("STREAM_CPROFILE_CPU"):  # the same by the main thread's CPU time
            cprof = [os.path.join(ROOT, "scripts", "benchmarks", "_cprofile_cpu.py"),
                     os.environ["STREAM_CPROFILE_CPU"]]
        serve = subprocess.Popen(
            [sys.executable] + cprof + ["-m", "agent", "fleet", "serve", "--broker",
             "mqtt://127.0.0.1:{}".format(port), "--db", db, "--admission", "keys",
             "--admission-keys", keys, "--signing-key", signing],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(work, "serve.log"), "w"))
        sampler = _RssSampler(serve.pid)
        sampler.start()
        launched = time.time()
        deadline = time.monotonic() + timeout
        if service_first:  # births into a serving service
            while fleet_scale.count(db_path, "SELECT COUNT(*) FROM services") < 1:
                assert time.monotonic() < deadline and serve.poll() is None, "service start"
                time.sleep(0.2)
            fleet.start()
        # Every device registered, and the service's start-up (the retained births and the
        # roll call) over: it logs its line once serving (its services row comes earlier).
        log_path = os.path.join(work, "serve.log")
        while fleet_scale.count(db_path, "SELECT COUNT(*) FROM devices") < n or \
                "INFO agent.fleet: fleet service " not in open(log_path, errors="replace").read():
            assert time.monotonic() < deadline and serve.poll() is None, "registry"
            time.sleep(0.5)
        serving = time.time()
        if service_first:  # a roll call from the broker by another client, before the rollout
            t0 = time.monotonic()
            out = subprocess.run(
                [sys.executable, "-m", "agent", "fleet", "devices", "--json", "--broker",
                 "mqtt://127.0.0.1:{}".format(port)], env=dict(os.environ, PYTHONPATH=ROOT),
                cwd=ROOT, capture_output=True, text=True, timeout=timeout)
            assert out.returncode == 0, out.stderr
            roll_call = {"devices": len(json.loads(out.stdout)),
                         "seconds": time.monotonic() - t0}
        observer = _observer(port, os.path.join(work, "finals.txt"))
        time.sleep(1.0)
        cpu0, _ = fleet_scale.proc_usage(serve.pid)
        others0 = _others_cpu(mosq.pid, fleet)
        load1 = os.getloadavg()
        if os.environ.get("STREAM_PROFILE_SIM"):  # the simulator's time: FILE, FILE.1, ...
            pids = [p.pid for p in fleet.procs] if isinstance(fleet, _SimulatorProcesses) \
                else [os.getpid()]
            profilers_sim = [subprocess.Popen(
                ["py-spy", "record", "--pid", str(pid), "--format", "raw", "--rate", "50",
                 "--nonblocking", "-o", os.environ["STREAM_PROFILE_SIM"] + (
                     ".{}".format(k) if k else "")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for k, pid in enumerate(pids)]
        if os.environ.get("STREAM_PROFILE"):  # where the service's time goes: py-spy, raw stacks
            profiler = subprocess.Popen(
                ["py-spy", "record", "--pid", str(serve.pid), "--format", "raw", "--rate", "50",
                 "--nonblocking", "-o", os.environ["STREAM_PROFILE"]] +
                (["--idle"] if os.environ.get("STREAM_PROFILE_IDLE") else []),
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out = fleet_scale.cli(["rollout", "--model", os.path.join(FP16, "model.onnx"),
                               "--inputs", os.path.join(FP16, "inputs.json"), "--golden",
                               os.path.join(FP16, "golden.json"), "--precision", "fp16",
                               "--match", "sim*", "--rollout-id", "stream", "--submit",
                               "--detach", "--timeout", str(timeout)], db)
        assert out.returncode == 0, out.stderr
        while fleet_scale.count(db_path, "SELECT COUNT(*) FROM rollouts WHERE state = "
                                "'succeeded'") < 1:
            assert time.monotonic() < deadline and serve.poll() is None and \
                getattr(fleet, "alive", lambda: True)(), (
                "rollout: {} of {} succeeded".format(fleet_scale.count(
                    db_path, "SELECT COUNT(*) FROM jobs WHERE state = 'SUCCEEDED'"), n))
            time.sleep(0.2)
        cpu1, rss = fleet_scale.proc_usage(serve.pid)
        others1 = _others_cpu(mosq.pid, fleet)
        time.sleep(0.5)
        con = sqlite3.connect(db_path, timeout=30)
        created, finished = con.execute(
            "SELECT created, finished FROM rollouts WHERE rollout_id = 'stream'").fetchone()
        ok = con.execute("SELECT COUNT(*) FROM jobs WHERE state = 'SUCCEEDED'").fetchone()[0]
        con.close()
        seen = _last_final_seen(os.path.join(work, "finals.txt"))
        if isinstance(fleet, _SimulatorProcesses):
            fleet.stop()  # they say what they saw as they exit
        first_doc, last_doc, last_final = fleet.first_doc, fleet.last_doc, fleet.last_final
        sampler.stopping.set()
        phases = {"start-up (births, admission, roll call)": sampler.peak(launched, serving),
                  "serving, before submission": sampler.peak(serving, created),
                  "streaming (to the last document)": sampler.peak(created, last_doc),
                  "the last statuses (to succeeded)": sampler.peak(last_doc, finished + 1)}
        return {"devices": n, "shape": SHAPE, "registry_s": serving - launched,
                "roll_call": roll_call, "succeeded": ok, "connections": len(fleet.clients),
                "first_doc_s": first_doc - created,
                "docs_per_s": n / max(1e-6, last_doc - first_doc),
                "db_after_last_final_sent_s": finished - last_final,
                "db_after_last_final_at_broker_s": finished - seen if seen else None,
                "rss_mib": rss / 2.0 ** 20, "rss_peak_mib_by_phase": phases, "cpu_s": cpu1 - cpu0,
                # The same window (submission -> succeeded): what else used the two cores.
                "simulator_cpu_s": others1[0] - others0[0], "broker_cpu_s": others1[1] - others0[1],
                "host_idle_s": others1[2] - others0[2], "window_s": others1[3] - others0[3],
                "rss_timeline": [(round(t - launched, 1), round(m)) for t, m in
                                 sampler.samples[::5]] if os.environ.get("STREAM_TIMELINE")
                else None,
                "sim_connects": fleet.connects, "load_before": load0,
                "queue": limits or fleet_scale.BIG_QUEUE,
                "load_at_submit": load1, "load_after": os.getloadavg(), "cores": os.cpu_count()}
    finally:
        for p in profilers_sim:
            p.send_signal(2)
            p.wait(60)
        if profiler is not None:
            profiler.send_signal(2)  # SIGINT: py-spy writes what it recorded
            profiler.wait(60)
        for proc in (observer,):
            if proc is not None:
                proc.terminate()
        fleet_scale.stop(fleet, serve, mosq)
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
         "ours": r["docs_per_s"], "unit": "docs/s", "goal": ">= 1200"},
        {"name": "database succeeded after the last final status passed the broker",
         "ours": r["db_after_last_final_at_broker_s"], "unit": "s", "goal": "<= 10"},
        {"name": "database succeeded after the simulator sent the last final status",
         "ours": r["db_after_last_final_sent_s"], "unit": "s", "goal": "<= 10"},
        {"name": "service peak RSS", "ours": r["rss_mib"], "unit": "MiB", "goal": "<= 200"},
        {"name": "service CPU", "ours": r["cpu_s"], "unit": "CPU s"},
        {"name": "load average (1 min) at submission, {} cores".format(r["cores"]),
         "ours": r["load_at_submit"][0], "unit": ""},
    ]


if __name__ == "__main__":
    print(json.dumps(run_once(DEVICES), indent=1))
