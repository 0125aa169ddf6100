"""The example app in ./scripts/demo: functions scripts/lib/demo.py calls (and the app's test and
the switch benchmark use) to start the app beside an agent, roll out three named versions of the
digits classifier, and print the app's side of it.

The flow (``run_app_flow``), on devices whose agents run with ``AGENT_APP_CONFIG`` and one app
each (``AppProcess``, under load from ``loadgen.LoadGen``):

1. ``digits`` v1 rolled out: the app takes it, checks it, reports it healthy;
2. v2 rolled out: the app switches without failing a request and reports it healthy (the app's
   report commits it);
3. v3 (``examples/digits_v3_broken``: passes the agent's gate on its own goldens) rolled out: the
   app's stored checks fail, it keeps serving v2 and reports v3 unhealthy, the agent rolls back to
   v2 automatically (the rollout ends FAILED ``handoff_rolled_back`` on every device);
4. the table: each device's ``name@version`` (its ``current`` link) and the app's switch times
   and failed requests.
"""

import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any, Callable, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
EXAMPLES = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)  # loadgen, fake_agent beside this file
NAME = "digits"
VERSIONS = (("v1", "digits"), ("v2", "digits_v2"), ("v3", "digits_v3_broken"))

# The agents' config for the app part (appended to the demo's agent.yaml): a new version stays
# pending until the app reports on it (the app runs as the agent's own user, which the socket
# always lets in); no report within the timeout rolls back.
AGENT_APP_CONFIG = """models:
  commit_timeout_s: 60
  app_confirms: [digits]
"""


class AppProcess(object):
    """examples/app/serve.py in a subprocess of its own session, with its port file, stats
    file and log in ``workdir``."""

    def __init__(self, workdir: str, name: str, models_dir: str,
                 socket_path: Optional[str] = None, extra: Optional[List[str]] = None) -> None:
        self.workdir = workdir
        self.name = name
        self.models_dir = models_dir
        self.socket_path = socket_path
        self.extra = list(extra or [])
        self.port_file = os.path.join(workdir, "app-port.json")
        self.stats_file = os.path.join(workdir, "app-stats.json")
        self.log = os.path.join(workdir, "app.log")
        self.proc: Optional["subprocess.Popen[bytes]"] = None
        self.url = ""

    def start(self, timeout: float = 30.0) -> "AppProcess":
        os.makedirs(self.workdir, exist_ok=True)
        argv = [sys.executable, os.path.join(HERE, "serve.py"), "--name", self.name,
                "--models-dir", self.models_dir, "--port-file", self.port_file,
                "--stats-file", self.stats_file] + self.extra
        if self.socket_path:
            argv += ["--socket", self.socket_path]
        else:
            argv += ["--no-report"]
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # serve.py finds the checkout's agent.client itself
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT,
                                         cwd=self.workdir, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.port_file):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the app did not start:\n" + self.log_tail())
            time.sleep(0.05)
        with open(self.port_file) as f:
            self.url = "http://127.0.0.1:{}".format(json.load(f)["port"])
        return self

    def stats(self) -> Dict[str, Any]:
        with urllib.request.urlopen(self.url + "/stats", timeout=10) as resp:
            return dict(json.loads(resp.read().decode("utf-8")))

    def wait(self, predicate: Callable[[Dict[str, Any]], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            found = predicate(stats)
            if found:
                return found
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError("the app exited:\n" + self.log_tail())
            if time.monotonic() > deadline:
                raise RuntimeError("the app: timed out waiting for {} (stats {})".format(
                    what, json.dumps(stats)[:2000]))
            time.sleep(0.05)

    def wait_serving(self, version: str, timeout: float = 60.0) -> Dict[str, Any]:
        """Until a request has been served by ``version`` (needs load on the app)."""
        return self.wait(lambda s: next((w for w in s["switches"] if w["version"] == version),
                                        None) if s["serving"] == version else None,
                         timeout, "{} serving".format(version))

    def log_tail(self, limit: int = 3000) -> str:
        try:
            with open(self.log, "rb") as f:
                return f.read()[-limit:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> Dict[str, Any]:
        """Stop it; its last stats (from the stats file it writes on the way out)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        try:
            with open(self.stats_file) as f:
                return dict(json.load(f))
        except (OSError, ValueError):
            return {}


def rollout_argv(version: str, broker: str, common: List[str]) -> List[str]:
    """``fleet rollout`` arguments of one named version of the digits example."""
    folder = dict(VERSIONS)[version]
    digits = os.path.join(EXAMPLES, "digits")
    argv = ["fleet", "rollout", "--name", NAME, "--version", version,
            "--model", os.path.join(EXAMPLES, folder, "model.onnx"),
            "--calib", os.path.join(digits, "calib"),
            "--inputs", os.path.join(digits, "inputs.json"),
            "--golden", os.path.join(EXAMPLES, folder, "golden.json"),
            "--precision", "int8", "--atol", "0.5", "--rtol", "0.5",
            "--check-error-stat", "mean", "--min-top1", "0.95"]
    if version != "v3":  # v3's operator ships goldens only (labels would show its accuracy)
        argv += ["--labels", os.path.join(digits, "labels.npy")]
    return argv + common


def current_version(models_dir: str, name: str = NAME) -> str:
    try:
        return os.path.basename(os.readlink(os.path.join(models_dir, name, "current")))
    except OSError:
        return "-"


def summarize(stats: Dict[str, Any], load: Dict[str, Any]) -> Dict[str, Any]:
    """The app's switches (its first version is a start, not a switch) and failed requests."""
    times = [w["switch_s"] for w in stats.get("switches", [])[1:]
             if w.get("switch_s") is not None]
    times.sort()
    return {"switches": len(times),
            "switch_p50_s": times[len(times) // 2] if times else None,
            "switch_max_s": times[-1] if times else None,
            "served": load.get("ok", 0), "failed": load.get("failed", 0) + stats.get("failed", 0),
            "rejected": [r["version"] for r in stats.get("rejected", [])],
            "by_version": load.get("by_version", {})}


def app_table(rows: List[Dict[str, Any]]) -> str:
    """DEVICE, MODEL (name@version of its current link), the app's switch times, failures."""
    def ms(v: Optional[float]) -> str:
        return "-" if v is None else "{:.0f} ms".format(v * 1000)

    table = [["DEVICE", "MODEL", "APP SERVES", "SWITCHES", "SWITCH P50", "SWITCH MAX",
              "REQUESTS", "FAILED", "APP REJECTED"]]
    for r in rows:
        table.append([r["device"], "{}@{}".format(NAME, r["current"]), str(r["serving"]),
                      str(r["switches"]), ms(r["switch_p50_s"]), ms(r["switch_max_s"]),
                      str(r["served"]), str(r["failed"]), ",".join(r["rejected"]) or "-"])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in table)


def run_app_flow(broker: str, devices: Dict[str, Dict[str, str]], common: List[str],
                 run_cli: Callable[[List[str], Dict[str, str]], int], env: Dict[str, str],
                 workdir: str) -> List[int]:
    """The demo's app part. ``devices``: device id -> {"models_dir", "socket"} of an agent
    started with ``app_config()``; ``common``: the demo's rollout arguments (broker, devices,
    signing key, ...); ``run_cli`` runs one ``jetson-agent`` command. Returns the exit codes
    that should fail the demo (v3's rollout is expected to end FAILED and is not among them)."""
    from loadgen import LoadGen

    apps, loads, codes, failed_before = {}, {}, [], {}
    try:
        for dev, where in sorted(devices.items()):
            apps[dev] = AppProcess(os.path.join(workdir, "app-" + dev), NAME,
                                   where["models_dir"], where["socket"]).start()
        codes.append(run_cli(rollout_argv("v1", broker, common), env))
        for dev in sorted(apps):  # the load starts once the app has a version to serve
            apps[dev].wait(lambda s: s["serving"] == "v1", 60, "v1 serving")
            failed_before[dev] = apps[dev].stats()["failed"]
            loads[dev] = LoadGen(apps[dev].url, threads=2, rate=50).start()
            apps[dev].wait_serving("v1", 60)
        codes.append(run_cli(rollout_argv("v2", broker, common), env))
        for dev in sorted(apps):
            apps[dev].wait_serving("v2", 60)
        # Every device gets v3 in one stage (its failures are the point: no abort after the
        # first), and the rollout ends FAILED (exit 1) when the devices roll it back.
        everyone = str(len(devices))
        code = run_cli(rollout_argv("v3", broker, common) + [
            "--batch", everyone, "--min-executed", everyone], env)
        if code != 1:
            print("demo: v3's rollout was expected to end FAILED (rolled back by the devices), "
                  "found exit status {}".format(code), file=sys.stderr)
            codes.append(1)
        for dev in sorted(apps):  # the agent's automatic rollback puts v2 back
            deadline = time.monotonic() + 90
            while current_version(devices[dev]["models_dir"]) != "v2":
                if time.monotonic() > deadline:
                    print("demo: {} did not go back to v2".format(dev), file=sys.stderr)
                    codes.append(1)
                    break
                time.sleep(0.2)
        rows = []
        for dev in sorted(apps):
            load = loads.pop(dev).stop()
            stats = apps[dev].stats()
            stats["failed"] -= failed_before[dev]
            row = summarize(stats, load)
            row.update(device=dev, current=current_version(devices[dev]["models_dir"]),
                       serving=stats.get("serving"))
            rows.append(row)
            if row["failed"]:
                codes.append(1)
        print("\nThe app on each device (switch: activation -> first request served by the "
              "new version):")
        print(app_table(rows))
    finally:
        for gen in loads.values():
            gen.stop()
        for app in apps.values():
            app.stop()
    return codes
