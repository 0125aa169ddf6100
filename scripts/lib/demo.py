"""The demo (run by ./scripts/demo): a local Mosquitto on a free loopback port, two agents on
the onnxruntime backend with throw-away state directories, and two staged rollouts of the
bundled examples through ``jetson-agent fleet``:

1. the digits classifier in int8 (calibrated on the device, gated on top-1 agreement with the
   fp32 goldens; the table shows its label accuracy next to fp32's);
2. the FP16_MAX model in fp16 with a ``minimal`` precision search (the table shows the layers
   kept in fp32);
3. the example inference app (``examples/app``, driven by ``examples/app/demo_flow.py``) on
   each device under load: ``digits`` v1, then v2 (committed by the app), then a broken v3
   the app reports unhealthy and the agent rolls back to v2; the table shows each device's
   ``name@version`` and the app's switch times and failed requests (``--no-app``: without).

Everything it starts is stopped on the way out, also on Ctrl-C or a failure. Exit status 0
when the rollouts ended as planned on both devices (v3 rolled back).
"""

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DEVICES = ("jetson-a", "jetson-b")
EXAMPLES = os.path.join(ROOT, "examples")
APP = os.path.join(EXAMPLES, "app")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mosquitto_binary() -> str:
    found = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not os.path.exists(found):
        raise SystemExit("demo: mosquitto is not installed (./scripts/demo installs it)")
    return found


class Children(object):
    """Background processes (broker, agents), each in its own session so a Ctrl-C on the
    terminal reaches only the demo and the fleet command, which then stop them in order."""

    def __init__(self, workdir: str) -> None:
        self.workdir = workdir
        self.procs: List[Tuple[str, "subprocess.Popen[bytes]", str]] = []

    def start(self, name: str, argv: List[str], env: Optional[Dict[str, str]] = None
              ) -> "subprocess.Popen[bytes]":
        log_path = os.path.join(self.workdir, name + ".log")
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                    cwd=self.workdir, start_new_session=True)
        self.procs.append((name, proc, log_path))
        return proc

    def check_alive(self) -> None:
        for name, proc, log_path in self.procs:
            if proc.poll() is not None:
                raise RuntimeError("{} exited with status {}:\n{}".format(
                    name, proc.returncode, tail(log_path)))

    def stop_all(self, timeout: float = 20.0) -> None:
        # Agents first (they publish their offline status), the broker last.
        for name, proc, _ in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    print("demo: {} did not stop within {:.0f} s; killing it".format(
                        name, timeout), file=sys.stderr)
                    proc.kill()
                    proc.wait(5)


def tail(path: str, limit: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            return f.read()[-limit:].decode("utf-8", "replace")
    except OSError:
        return ""


def wait_accepting(port: int, proc: "subprocess.Popen[bytes]", timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("mosquitto exited with status {}".format(proc.returncode))
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("mosquitto did not accept connections on port {}".format(port))


class WireRecorder(object):
    """Listens to every message under the prefix and records its size per message kind
    (the numbers docs/fleet.md quotes)."""

    def __init__(self, broker_port: int) -> None:
        import queue

        from agent.wire.mqtt import MqttClient
        from agent.wire.topics import Topics

        self.topics = Topics()
        self.client = MqttClient("demo-recorder", "127.0.0.1", broker_port, clean_start=True,
                                 session_expiry=0, events=queue.Queue())
        self.client.subscribe(self.topics.prefix + "/#", 1)
        self.sizes: Dict[str, List[Tuple[int, int]]] = {}
        self._stop = False
        self.client.start()
        self.client.wait_connected(10)
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self) -> None:
        import queue

        from agent.errors import AgentError
        from agent.wire import mqtt

        while not self._stop:
            try:
                ev = self.client.events.get(timeout=0.2)
            except queue.Empty:
                continue
            if ev.kind != mqtt.MESSAGE:
                continue
            try:
                kind = self.topics.parse(ev.topic).kind
            except AgentError:
                kind = "other"
            if ev.retain:
                kind += " (retained copy)"
            elif kind == "job" and not ev.payload:
                kind = "job (cleared)"
            self.sizes.setdefault(kind, []).append((len(ev.payload),
                                                    len(ev.topic.encode("utf-8"))))

    def close(self) -> None:
        self._stop = True
        self.client.stop()
        self.thread.join(2)

    def report(self) -> str:
        rows = []
        for kind in sorted(self.sizes):
            entries = self.sizes[kind]
            payloads = [p for p, _ in entries]
            rows.append([kind, str(len(entries)), str(min(payloads)),
                         str(int(round(sum(payloads) / float(len(payloads))))),
                         str(max(payloads)), str(max(t for _, t in entries))])
        from agent.fleet import format_table

        return format_table(["MESSAGE", "COUNT", "MIN B", "AVG B", "MAX B", "TOPIC B"], rows)


def wait_online(port: int, devices: Tuple[str, ...], children: Children,
                timeout: float = 45.0) -> None:
    from agent import fleet

    deadline = time.monotonic() + timeout
    conn = fleet.FleetConnection("mqtt://127.0.0.1:{}".format(port)).connect()
    try:
        fleet.discover(conn)
        while True:
            online = [d for d in devices
                      if (conn.directory.status.get(d) or {}).get("online") is True]
            if len(online) == len(devices):
                return
            children.check_alive()
            if time.monotonic() > deadline:
                raise RuntimeError("agents not online within {:.0f} s: {}".format(
                    timeout, sorted(set(devices) - set(online))))
            conn.pump(lambda info, msg: None, 0.3)
    finally:
        conn.close()


def run_cli(argv: List[str], env: Dict[str, str]) -> int:
    shown = ["jetson-agent"] + [os.path.relpath(a, ROOT) if a.startswith(ROOT) else a
                                for a in argv]
    print("\n$ " + " ".join(shlex.quote(a) for a in shown), flush=True)
    # Its own session: a Ctrl-C reaches the demo only, which passes exactly one on.
    proc = subprocess.Popen([sys.executable, "-m", "agent"] + argv, env=env, cwd=ROOT,
                            start_new_session=True)
    try:
        return proc.wait()
    except KeyboardInterrupt:
        # Let the fleet command cancel what it queued and print its table.
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            proc.kill()
            proc.wait(5)
        raise


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true",
                        help="keep the work directory (logs, agent state) for a look")
    parser.add_argument("--search", default="minimal",
                        choices=("minimal", "bisect", "linear", "worst-first"),
                        help="precision search mode for the FP16_MAX model (default minimal)")
    parser.add_argument("--timeout", type=float, default=90.0,
                        help="rollout timeout in seconds (default 90)")
    parser.add_argument("--no-app", action="store_true",
                        help="leave out the example app's part (v1 -> v2 -> broken v3)")
    args = parser.parse_args(argv)
    if APP not in sys.path:
        sys.path.insert(0, APP)
    import demo_flow

    with_app = not args.no_app

    started = time.monotonic()
    workdir = tempfile.mkdtemp(prefix="jetson-agent-demo-")
    children = Children(workdir)
    recorder: Optional[WireRecorder] = None

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    # Also when started in the background with SIGINT ignored (children inherit SIG_IGN).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("JETSON_AGENT_STATE_DIR", None)
    env["JETSON_AGENT_TELEMETRY_INTERVAL"] = "2"
    codes: List[int] = []
    try:
        port = free_port()
        conf = os.path.join(workdir, "mosquitto.conf")
        with open(conf, "w") as f:
            f.write("listener {} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                    "max_queued_messages 10000\nset_tcp_nodelay true\n".format(port))
        broker = "mqtt://127.0.0.1:{}".format(port)
        print("demo: Mosquitto on {}; agents {} on the onnxruntime backend (work dir {})".format(
            broker, " and ".join(DEVICES), workdir), flush=True)
        wait_accepting(port, children.start("mosquitto", [mosquitto_binary(), "-c", conf]))
        recorder = WireRecorder(port)
        # A throw-away signing key: the agents run only jobs signed with it (docs/security.md).
        from agent.wire import job_signer

        key = job_signer.generate_keypair(os.path.join(workdir, "keys"), "demo")
        # Each device has its own identity key (install-jetson makes it on a Jetson); the
        # controller admits exactly these, pre-provisioned (fleet --admission keys).
        from agent.wire.device_identity import create_device_key

        admitted = os.path.join(workdir, "keys", "admitted-devices")
        env.update(JETSON_AGENT_FLEET_ADMISSION="keys",
                   JETSON_AGENT_FLEET_ADMISSION_KEYS=admitted)
        for dev in DEVICES:
            device_key = create_device_key(os.path.join(workdir, "keys", dev + ".key"))
            with open(admitted, "a") as f:
                f.write(device_key.public_base64 + "\n")
            agent_conf = os.path.join(workdir, dev + ".yaml")
            with open(agent_conf, "w") as f:
                f.write("security:\n  trusted_keys: [{}]\n  device_key: {}\n".format(
                    key["public_key"], device_key.path))
                if with_app:
                    f.write(demo_flow.AGENT_APP_CONFIG)
            children.start(dev, [sys.executable, "-m", "agent", "run", "--config", agent_conf,
                                 "--broker", broker, "--device-id", dev, "--state-dir",
                                 os.path.join(workdir, dev), "--backend", "onnxruntime"],
                           env=env)
        wait_online(port, DEVICES, children)
        common = ["--broker", broker, "--devices"] + list(DEVICES) + [
            "--batch", "1", "--abort-failure-rate", "0.5", "--timeout", str(args.timeout),
            "--signing-key", key["private_key"],
            "--sequence-file", os.path.join(workdir, "keys", "sequence.json")]
        codes.append(run_cli(["fleet", "devices", "--broker", broker, "--wait", "2.5"], env))
        digits = os.path.join(EXAMPLES, "digits")
        codes.append(run_cli([
            "fleet", "rollout", "--model", os.path.join(digits, "model.onnx"),
            "--calib", os.path.join(digits, "calib"),
            "--inputs", os.path.join(digits, "inputs.json"),
            "--golden", os.path.join(digits, "golden.json"),
            "--labels", os.path.join(digits, "labels.npy"),
            "--precision", "int8", "--atol", "0.5", "--rtol", "0.5",
            "--check-error-stat", "mean", "--min-top1", "0.95"] + common, env))
        fp16 = os.path.join(EXAMPLES, "fp16_max")
        codes.append(run_cli([
            "fleet", "rollout", "--model", os.path.join(fp16, "model.onnx"),
            "--inputs", os.path.join(fp16, "inputs.json"),
            "--golden", os.path.join(fp16, "golden.json"),
            "--precision", "fp16", "--search", args.search, "--check-error-stat", "median",
            ] + common, env))
        if with_app:
            codes.extend(demo_flow.run_app_flow(
                broker, {dev: {"models_dir": os.path.join(workdir, dev, "models"),
                               "socket": os.path.join(workdir, dev, "app.sock")}
                         for dev in DEVICES}, common, run_cli, env, workdir))
        else:
            print("\ndemo: the example app's part is left out (--no-app)")
        # Every model each device holds, as name@version (state).
        codes.append(run_cli(["fleet", "devices", "--broker", broker, "--wait", "2.5"], env))
        recorder.close()
        print("\nMessages on the wire during the demo (payload and topic bytes; an MQTT "
              "PUBLISH adds a few bytes of header):")
        print(recorder.report())
    except KeyboardInterrupt:
        print("\ndemo: interrupted; stopping everything", file=sys.stderr)
        codes.append(130)
    except Exception as exc:  # noqa: BLE001 - say what failed, then clean up
        print("demo: failed: {}".format(exc), file=sys.stderr)
        for name, _, log_path in children.procs:
            print("--- {} log (tail) ---\n{}".format(name, tail(log_path, 1500)),
                  file=sys.stderr)
        codes.append(1)
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if recorder is not None:
            recorder.close()
        children.stop_all()
        if args.keep:
            print("demo: work directory kept: {}".format(workdir), file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    failed = [c for c in codes if c != 0]
    verdict = (("OK: every device SUCCEEDED in both rollouts" + (
                   "; the app committed digits v2 and v3 was rolled back to v2"
                   if with_app else "")) if not failed else
               "interrupted" if 130 in failed else "FAILED")
    print("\ndemo: {} in {:.0f} s".format(verdict, time.monotonic() - started))
    if 130 in failed:
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
