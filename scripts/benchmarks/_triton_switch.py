"""Switching a real Triton between versions under load (docs/benchmarks.md, "Model switch"):
the ``triton`` hand-off against the ``tritonserver`` of the nvidia-pytriton wheel (explicit
model control, ``backend: python`` versions serving the host's engine through onnxruntime).

Load: ``THREADS`` clients, each a process of its own on its own kept-alive HTTP connection
(no client shares an interpreter with another or with the hand-off driven here, so the
latencies are Triton's, not this harness's), sending inference requests back to back to the
model's default (newest) version; every request's latency is recorded. One run, same server,
same load: first ``BASE_S`` seconds without switches (the baseline), then ``switches``
activations (prepare, switch, confirm: ready and one inference, commit), alternating two
versions, each committed before the next, ``JETSON_AGENT_TRITON_GAP_S`` seconds apart (default
0: back to back); the requests are sorted by the phase of a switch they started in, and with a
gap the requests between switches are a second baseline, taken in the same minutes as the
switches. Then, for comparison, a few switches whose load goes through Triton's HTTP load API
instead of gRPC. Before the load, ``CPU_SWITCHES`` switches with no request running measure
the CPU one switch costs Triton and its Python-backend stubs (their processes' CPU time, from
/proc).
Another tree's hand-off is measured by putting it first on PYTHONPATH (the tests and the
Triton launcher come from this one), e.g. the code before a change:
``git archive REV agent | tar -x -C /tmp/before && PYTHONPATH=/tmp/before JETSON_AGENT_SWITCHES=0
python scripts/benchmarks/model_switch.py``.
``JETSON_AGENT_TRITON_KEEP``: the hand-off's ``keep_versions`` (default 2: folders on disk);
``JETSON_AGENT_TRITON_LOADED``: its ``loaded_versions`` (default 1: versions Triton holds);
``JETSON_AGENT_TRITON_ARGS``: more ``tritonserver`` flags, space-separated (Triton runs with
``--disable-auto-complete-config``, as docs/using-models.md advises;
``JETSON_AGENT_TRITON_AUTO_COMPLETE=1`` leaves it out);
``JETSON_AGENT_TRITON_RATE``: requests a second per client (default 0: back to back).
"""

import array
import bisect
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after PYTHONPATH: a tree put there is the one measured

THREADS = 2
# Requests a second per client (JETSON_AGENT_TRITON_RATE; 0: back to back, which saturates a
# 2-core host so that any CPU the switch itself uses shows as latency).
RATE = float(os.environ.get("JETSON_AGENT_TRITON_RATE", "0"))
# Triton's auto-completion of model configurations on (JETSON_AGENT_TRITON_AUTO_COMPLETE=1);
# off by default, as docs/using-models.md advises: one Python-backend stub start fewer a load.
AUTO_COMPLETE = os.environ.get("JETSON_AGENT_TRITON_AUTO_COMPLETE") == "1"
# Seconds between one switch's commit and the next one's prepare (JETSON_AGENT_TRITON_GAP_S;
# 0: back to back, the harsh reading of "50 switches under load": a daemon switches a model
# once per job, minutes apart).
GAP_S = float(os.environ.get("JETSON_AGENT_TRITON_GAP_S", "0"))
BASE_S = 20.0
CPU_SWITCHES = 5
SLOW_S = 0.25  # the goal's max: how many requests took longer (a loaded host stalls some)
BODY = json.dumps({"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32",
                               "data": [1.0, 2.0, 3.0, 4.0]}]})


class Load:
    """Back-to-back requests from THREADS clients, each a process of its own (this file with
    ``--client``): no client shares an interpreter lock with another or with the hand-off
    driven here, so the latencies are Triton's, not this harness's. (start, latency, ok) per
    request, on CLOCK_MONOTONIC (one clock for every process of the host)."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.outs = [str(workdir / "client-{}.bin".format(i)) for i in range(THREADS)]
        self.port = port
        self.procs: List[subprocess.Popen] = []
        self.records: List[Tuple[float, float, bool]] = []

    def start(self) -> "Load":
        for out in self.outs:
            self.procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--client", str(self.port),
                 str(RATE), out], stdin=subprocess.PIPE, stdout=subprocess.PIPE))
        for proc in self.procs:  # each says "started" once its connection is open
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != b"started":
                raise RuntimeError("a load client did not start")
        return self

    def stop(self) -> None:
        """End of input: each client stops and writes its records (also on an error: no
        client is left sending requests)."""
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def finish(self) -> None:
        self.stop()
        for out in self.outs:
            values = array.array("d")
            with open(out, "rb") as f:
                values.frombytes(f.read())
            self.records += [(values[i], values[i + 1], values[i + 2] > 0)
                             for i in range(0, len(values), 3)]

    def window(self, start: float, end: float) -> List[Tuple[float, float, bool]]:
        return [r for r in self.records if start <= r[0] < end]


def client(port: int, rate: float, out: str) -> None:
    """One load client (``--client``): requests until its stdin ends, then the records."""
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.buffer.read(), stop.set()), daemon=True).start()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.connect()
    sys.stdout.write("started\n")
    sys.stdout.flush()
    values = array.array("d")
    gap = 1.0 / rate if rate > 0 else 0.0
    due = time.monotonic()
    while not stop.is_set():
        if gap:  # an app's steady stream (frames), not a saturating loop: wait for its slot
            due += gap
            wait = due - time.monotonic()
            if wait > 0:
                stop.wait(wait)
            else:
                due = time.monotonic()  # behind: no burst to catch up
        started = time.monotonic()
        try:
            conn.request("POST", "/v2/models/det/infer", body=BODY,
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            response.read()
            ok = response.status == 200
        except (OSError, http.client.HTTPException):
            ok = False
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        values.extend((started, time.monotonic() - started, 1.0 if ok else 0.0))
    with open(out, "wb") as f:
        values.tofile(f)


def percentile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def stats(records: List[Tuple[float, float, bool]]) -> Dict[str, Any]:
    lat = [r[1] for r in records]
    if not lat:
        return {"n": 0, "p50": None, "p99": None, "max": None, "failed": 0, "slow": 0}
    return {"n": len(lat), "p50": round(1000 * percentile(lat, 0.5), 2),
            "p99": round(1000 * percentile(lat, 0.99), 2), "max": round(1000 * max(lat), 1),
            "failed": sum(1 for r in records if not r[2]),
            "slow": sum(1 for x in lat if x > SLOW_S)}


def cpu_s(pid: int) -> float:
    """CPU seconds of process ``pid``, its reaped children (the stubs that ended) and its
    live children (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")

    def fields(p: str) -> List[str]:
        with open("/proc/{}/stat".format(p)) as f:
            return f.read().rsplit(")", 1)[1].split()

    total = sum(int(x) for x in fields(str(pid))[11:15])  # utime stime cutime cstime
    for p in os.listdir("/proc"):
        try:
            f = fields(p) if p.isdigit() else None
        except OSError:
            continue  # ended meanwhile: its time is in the parent's cutime now
        if f is not None and f[1] == str(pid):
            total += int(f[11]) + int(f[12])
    return total / tick


PHASES = ("prepare", "load", "confirm", "commit", "between")


def switch_all(adapter: Any, versions: List[Any], count: int, start: int = 0,
               gap_s: float = 0.0, marks: Optional[List[List[float]]] = None) -> List[float]:
    """``count`` switches, as the daemon makes them (prepare, switch, confirm, commit), the
    first from versions[start], ``gap_s`` apart; each switch's phase boundaries (PHASES) are
    appended to ``marks``."""
    times = []
    previous = versions[start % 2]
    for i in range(count):
        new = versions[(start + i + 1) % 2]
        started = time.monotonic()
        mark = [started]
        adapter.prepare(new, previous)
        mark.append(time.monotonic())
        adapter.switch(new, previous)
        mark.append(time.monotonic())
        if adapter.confirm(new) is not True:
            raise RuntimeError("switch {} to {} not confirmed".format(i + 1, new.version))
        mark.append(time.monotonic())
        if hasattr(adapter, "commit"):  # a tree from before the commit step has none
            adapter.commit(new, previous)
        mark.append(time.monotonic())
        times.append(mark[-1] - started)
        if gap_s and i + 1 < count:
            time.sleep(gap_s)  # the pace of switches (JETSON_AGENT_TRITON_GAP_S)
        mark.append(time.monotonic())
        if marks is not None:
            marks.append(mark)
        previous = new
    return times


def by_phase(records: List[Tuple[float, float, bool]], marks: List[List[float]]
             ) -> Dict[str, List[Tuple[float, float, bool]]]:
    """{phase: the requests started in it}: where in a switch the slow requests fall; with
    switches paced apart, "between" is a baseline taken in the same minutes as the switches
    (a shared host's load drifts between a baseline taken first and the switches after it)."""
    out: Dict[str, List[Tuple[float, float, bool]]] = {p: [] for p in PHASES}
    bounds = sorted((m[k], m[k + 1], PHASES[k]) for m in marks for k in range(len(PHASES)))
    starts = [b[0] for b in bounds]
    for record in records:
        i = bisect.bisect_right(starts, record[0]) - 1
        if i >= 0 and record[0] < bounds[i][1]:
            out[bounds[i][2]].append(record)
    return out


def onnx_bytes(model: Any) -> bytes:
    """The model at an IR version any onnxruntime of the last two years reads: the onnx package
    stamps its newest (a newer onnx than onnxruntime refuses the load); opset 17 needs IR 8."""
    model.ir_version = min(model.ir_version, 8)
    return model.SerializeToString()


def run_triton(switches: int, http_switches: int) -> Optional[Dict[str, Any]]:
    from agent.device.handoff.triton import from_config
    from tests.integration.test_triton_handoff import make_version, scale_model
    from tests.integration.triton_server import TritonServer, unavailable

    if unavailable():
        return None
    load_before = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="bench-triton-"))
    server = load = None
    try:
        repo = workdir / "repo"
        repo.mkdir()
        server = TritonServer(workdir, repo, os.environ.get(
            "JETSON_AGENT_TRITON_ARGS", "").split(), auto_complete=AUTO_COMPLETE).start()
        models = workdir / "models"
        versions = [make_version(models, v, onnx_bytes(scale_model(k)))
                    for v, k in (("v1", 1.0), ("v2", 2.0))]
        section = {"repository": str(repo), "url": server.url, "backend": "python",
                   "timeout_s": 120,
                   "keep_versions": int(os.environ.get("JETSON_AGENT_TRITON_KEEP", "2")),
                   "loaded_versions": int(os.environ.get("JETSON_AGENT_TRITON_LOADED", "1"))}
        ours = from_config(dict(section, grpc_url=server.grpc_target), "handoff[0]")
        ours.prepare(versions[0], None)
        ours.switch(versions[0], None)
        assert ours.confirm(versions[0]) is True
        cpu0, own0 = cpu_s(server.proc.pid), time.process_time()
        switch_all(ours, versions, CPU_SWITCHES)  # no load: what one switch costs in CPU
        cpu_per_switch = (cpu_s(server.proc.pid) - cpu0) / CPU_SWITCHES
        own_per_switch = (time.process_time() - own0) / CPU_SWITCHES  # the hand-off's own
        load = Load(server.port, workdir)
        load.start()
        t0 = time.monotonic()
        time.sleep(BASE_S)  # the baseline window: the same load, no switch
        t1 = time.monotonic()
        marks: List[List[float]] = []
        times = switch_all(ours, versions, switches, CPU_SWITCHES, GAP_S, marks)
        t2 = time.monotonic()
        http_times: List[float] = []
        if http_switches:
            plain = from_config(section, "handoff[0]")
            http_times = switch_all(plain, versions, http_switches, CPU_SWITCHES + switches)
        t3 = time.monotonic()
        load.finish()
        base = stats(load.window(t0, t1))
        phases = by_phase(load.window(t1, t2), marks)
        limit = (base["p99"] or 0) / 1000
        slow = {p: (len(r), sum(1 for x in r if x[1] > limit)) for p, r in phases.items()}
        during = [r for p, rs in phases.items() if p != "between" for r in rs]
        return {"base": base, "switching": stats(load.window(t1, t2)), "phases": slow,
                "during": stats(during), "between": stats(phases["between"]),
                "http": stats(load.window(t2, t3)) if http_switches else None,
                "switch_s": times, "http_switch_s": http_times, "cpu_s": cpu_per_switch,
                "own_cpu_s": own_per_switch,
                "load": (load_before, os.getloadavg()[0])}
    finally:
        if load is not None:
            load.stop()
        if server is not None:
            server.stop()
        shutil.rmtree(str(workdir), ignore_errors=True)


def rows(switches: int, http_switches: int) -> List[Dict[str, Any]]:
    result = run_triton(switches, http_switches)
    if result is None:
        return [{"name": "Triton switches (skipped: no tritonserver on this host)",
                 "ours": None, "baseline": None, "unit": "-", "ratio": "-", "goal": "-"}]
    base, sw, plain = result["base"], result["switching"], result["http"]
    out = [
        {"name": "Triton: {} switches under load (ours) vs the same load without "
                 "(baseline): requests".format(switches),
         "ours": sw["n"], "baseline": base["n"], "unit": "count", "ratio": "-", "goal": "-"},
        {"name": "Triton: request latency p50", "ours": sw["p50"], "baseline": base["p50"],
         "unit": "ms", "goal": "-"},
        {"name": "Triton: request latency p99", "ours": sw["p99"], "baseline": base["p99"],
         "unit": "ms", "goal": "<= 1.5x"},
        {"name": "Triton: request latency max", "ours": sw["max"], "baseline": base["max"],
         "unit": "ms", "goal": "ours <= 250 ms"},
        {"name": "Triton: requests over 250 ms", "ours": sw["slow"], "baseline": base["slow"],
         "unit": "count", "ratio": "-", "goal": "-"},
        {"name": "Triton: failed requests", "ours": sw["failed"], "baseline": base["failed"],
         "unit": "count", "ratio": "-", "goal": "0"},
        {"name": "Triton: CPU per switch, no request running (tritonserver and its stubs)",
         "ours": round(1000 * result["cpu_s"]), "baseline": None, "unit": "ms", "ratio": "-",
         "goal": "-"},
        {"name": "Triton: CPU per switch of the hand-off itself (prepare, the gRPC load call, "
                 "readiness, the inference check, commit: this process)",
         "ours": round(1000 * result["own_cpu_s"]), "baseline": None, "unit": "ms",
         "ratio": "-", "goal": "-"},
        {"name": "Triton: host load average (1 min) at the start / at the end (shared host?)",
         "ours": round(result["load"][0], 2), "baseline": round(result["load"][1], 2),
         "unit": "-", "ratio": "-", "goal": "-"},
        {"name": "Triton: switch time p50 / max (prepare -> committed: ready + 1 inference), "
                 "{} s apart".format(GAP_S),
         "ours": round(1000 * percentile(result["switch_s"], 0.5), 1),
         "baseline": round(1000 * max(result["switch_s"]), 1), "unit": "ms", "ratio": "-",
         "goal": "-"},
    ]
    if result["between"]["n"]:
        during, between = result["during"], result["between"]
        out += [{"name": "Triton: paced switches, request latency {} while a switch runs "
                         "(ours) vs between switches (baseline, the same minutes)".format(q),
                 "ours": during[q], "baseline": between[q], "unit": "ms",
                 "goal": "<= 1.5x" if q == "p99" else "-"} for q in ("p50", "p99", "max")]
    out += [{"name": "Triton: requests slower than the baseline's p99 while the switches were "
                     "in phase '{}': share (requests in it)".format(phase),
             "ours": round(100.0 * slow / n, 1) if n else None, "baseline": n, "unit": "%",
             "ratio": "-", "goal": "-"}
            for phase, (n, slow) in result["phases"].items() if n]
    if plain is not None:
        out.append({"name": "Triton: latency max / p99 with {} switches loading through the "
                            "HTTP load API instead of gRPC".format(len(result["http_switch_s"])),
                    "ours": plain["max"], "baseline": plain["p99"], "unit": "ms", "ratio": "-",
                    "goal": "-"})
    return out


if __name__ == "__main__" and sys.argv[1:2] == ["--client"]:
    client(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
