"""A real Mosquitto broker per test: started on a free loopback port, persistence off.

``mosquitto`` yields a ``Broker`` (host, port, url, restart(), stop(), start()). Tests that kill
the broker mid-transfer call ``broker.stop()`` / ``broker.start()`` (same port) or
``broker.restart()``.
"""

import os
import shutil
import socket
import subprocess
import time

import pytest

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_accepting(host, port, timeout=10.0, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError("mosquitto exited with status {}".format(proc.returncode))
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("mosquitto did not accept on {}:{} within {} s".format(host, port, timeout))


class Broker:
    host = "127.0.0.1"

    def __init__(self, workdir, port=None, message_size_limit=0):
        self.workdir = str(workdir)
        self.port = port or free_port()
        self.config = os.path.join(self.workdir, "mosquitto.conf")
        self.log = os.path.join(self.workdir, "mosquitto.log")
        with open(self.config, "w") as f:
            f.write("listener {} 127.0.0.1\n".format(self.port))
            f.write("allow_anonymous true\n")
            f.write("persistence false\n")
            f.write("max_queued_messages 10000\n")
            f.write("set_tcp_nodelay true\n")  # as systemd/mosquitto/jetson-fleet.conf
            f.write("message_size_limit {}\n".format(message_size_limit))
        self.proc = None

    @property
    def url(self):
        return "mqtt://{}:{}".format(self.host, self.port)

    def start(self):
        assert self.proc is None or self.proc.poll() is not None
        deadline = time.monotonic() + 10
        while True:
            logf = open(self.log, "ab")
            self.proc = subprocess.Popen([MOSQUITTO, "-c", self.config], stdout=logf,
                                         stderr=subprocess.STDOUT)
            logf.close()
            try:
                wait_accepting(self.host, self.port, timeout=10, proc=self.proc)
                return self
            except RuntimeError:
                # The port may still be in TIME_WAIT right after a kill: try again shortly.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self, kill=True):
        if self.proc is not None and self.proc.poll() is None:
            if kill:
                self.proc.kill()
            else:
                self.proc.terminate()
            self.proc.wait(10)

    def restart(self, down_s=0.0):
        self.stop()
        if down_s:
            time.sleep(down_s)
        return self.start()


@pytest.fixture
def mosquitto(tmp_path):
    if not os.path.exists(MOSQUITTO):
        pytest.skip("mosquitto is not installed")
    workdir = tmp_path / "broker"
    workdir.mkdir()
    broker = Broker(workdir).start()
    try:
        yield broker
    finally:
        broker.stop(kill=False)


# --- a device daemon in a subprocess, and a minimal controller ------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class AgentProcess:
    """``jetson-agent run`` as a real subprocess (SIGKILL-able, restartable on its state).
    ``security``: the body of its security section (default: a lab device taking unsigned
    jobs); ``broker_extra``: more lines of its broker section (TLS, credentials)."""

    def __init__(self, broker, workdir, device="dev1", extra_config="", security=None,
                 broker_extra=""):
        self.broker = broker
        self.device = device
        self.workdir = str(workdir)
        self.state_dir = os.path.join(self.workdir, "state")
        self.config = os.path.join(self.workdir, "agent.yaml")
        self.log = os.path.join(self.workdir, "agent.log")
        with open(self.config, "w") as f:
            f.write(
                "device_id: {dev}\n"
                "state_dir: {state}\n"
                "backend: onnxruntime\n"
                "telemetry_interval: 1\n"
                "broker:\n  host: {host}\n  port: {port}\n  reconnect_min: 0.2\n"
                "  reconnect_max: 1.0\n  keepalive: 10\n".format(
                    dev=device, state=self.state_dir, host=broker.host, port=broker.port))
            f.write(broker_extra)
            f.write("security:\n" + ("  allow_unsigned: true\n" if security is None
                                       else security))
            f.write(extra_config)
        self.proc = None

    def start(self, *args, env_extra=None):
        import sys

        env = dict(os.environ)
        env.update(env_extra or {})
        env["PYTHONPATH"] = ROOT
        env.pop("JETSON_AGENT_STATE_DIR", None)
        logf = open(self.log, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent", "-v", "run", "--config", self.config] + list(args),
            stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=self.workdir)
        logf.close()
        return self

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, timeout=30):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                raise
        return self.proc.returncode if self.proc else None

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n=4000):
        try:
            with open(self.log, "rb") as f:
                return f.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def journal(self):
        from agent.device.daemon import journal_path
        from agent.device.journal import Journal

        return Journal(journal_path(self.state_dir))

    def assert_store_sound(self):
        """Every artifact in this agent's store hashes to its name (partials aside)."""
        import hashlib

        root = os.path.join(self.state_dir, "artifacts")
        for dirpath, _, names in os.walk(root):
            if os.path.basename(dirpath) == "partial":
                continue
            for name in names:
                with open(os.path.join(dirpath, name), "rb") as f:
                    assert hashlib.sha256(f.read()).hexdigest() == name, name

    def wait_journal(self, predicate, timeout, what):
        """Poll this agent's journal until ``predicate(journal)`` is truthy; return its value."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.journal() as journal:
                value = predicate(journal)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError("timed out waiting for " + what + "\n" + self.log_tail())


class Controller:
    """What a fleet controller does, minimally: serve artifact blocks, send jobs and commands,
    record device, job and telemetry messages. Uses agent.wire.mqtt and agent.wire.transfer."""

    def __init__(self, broker, device="dev1", signer=None, **client_kwargs):
        import queue
        import threading
        import uuid

        from agent.wire.mqtt import MqttClient
        from agent.wire.topics import Topics
        from agent.wire.transfer import BlockServer

        self.device = device
        self.signer = signer  # agent.wire.job_signer.Signer: send_job signs the documents
        self.topics = Topics()
        self.client = MqttClient("ctl-" + uuid.uuid4().hex[:8], broker.host, broker.port,
                                 reconnect_min=0.2, reconnect_max=1.0, events=queue.Queue(),
                                 **client_kwargs)
        self.server = BlockServer(self._publish_block, self.topics)
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.job_status = {}  # job_id -> list of status messages, arrival order
        self.device_status = []
        self.telemetry = []
        self.replies = []
        self.requests = []  # decoded artifact requests
        self.blocks_sent = {}  # (sha, index) -> times sent
        self.serve = True  # False: requests are recorded but not answered
        self.served_limit = None  # stop answering after this many blocks (then serve=False)
        self.errors = []
        for topic, qos in self.topics.controller_subscriptions():
            self.client.subscribe(topic, qos)
        self._stop = False
        self.client.start()
        self.client.wait_connected(10)
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _publish_block(self, topic, payload, qos=1, retain=False):
        info = self.topics.parse(topic)
        key = (info.sha256, info.index)
        self.blocks_sent[key] = self.blocks_sent.get(key, 0) + 1
        self.client.publish(topic, payload, qos=qos, retain=retain)

    def _pump(self):
        import queue

        from agent.wire import mqtt, protocol

        while not self._stop:
            try:
                ev = self.client.events.get(timeout=0.2)
            except queue.Empty:
                continue
            if ev.kind != mqtt.MESSAGE:
                continue
            try:
                info = self.topics.parse(ev.topic)
                if info.kind == "artifact_request":
                    msg = protocol.decode("artifact_request", ev.payload)
                    with self.lock:
                        self.requests.append(msg)
                        serve = self.serve
                        if self.served_limit is not None:
                            if sum(self.blocks_sent.values()) >= self.served_limit:
                                self.serve = serve = False
                    if serve:
                        self.server.handle_request(ev.topic, ev.payload)
                    continue
                if not ev.payload:
                    continue
                msg = protocol.decode(info.kind, ev.payload)
                with self.cond:
                    if info.kind == "job_status":
                        self.job_status.setdefault(info.job_id, []).append(msg)
                    elif info.kind == "status":
                        self.device_status.append(msg)
                    elif info.kind == "telemetry":
                        self.telemetry.append(msg)
                    elif info.kind == "command_reply":
                        self.replies.append(msg)
                    self.cond.notify_all()
            except Exception as exc:  # noqa: BLE001 - recorded; the test asserts on it
                self.errors.append("{}: {!r}".format(ev.topic, exc))

    def add_artifact(self, path, name=None):
        sha = self.server.add_file(str(path))
        return {"sha256": sha, "size": os.path.getsize(str(path)),
                "name": name or os.path.basename(str(path))}

    def send_job(self, doc, retain=True):
        from agent.wire import protocol

        doc = dict(doc)
        doc.setdefault("protocol", 1)
        doc.setdefault("device", self.device)
        if self.signer is not None:
            doc = self.signer.sign(doc)
        h = self.client.publish(self.topics.job(self.device, doc["job_id"]),
                                protocol.encode(doc), qos=1, retain=retain)
        assert h.wait(10), "job document not acknowledged by the broker"
        return doc

    def send_raw(self, topic, payload, qos=1, retain=False):
        return self.client.publish(topic, payload, qos=qos, retain=retain)

    def command(self, cmd):
        from agent.wire import protocol

        cmd = dict(cmd)
        cmd.setdefault("protocol", 1)
        h = self.client.publish(self.topics.commands(self.device), protocol.encode(cmd), qos=1)
        assert h.wait(10)

    def wait_for(self, predicate, timeout, what="condition"):
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("timed out after {} s waiting for {}".format(
                        timeout, what))
                self.cond.wait(min(left, 0.5))

    def wait_online(self, device=None, timeout=30):
        """Until the device's birth message (online) has arrived: it is subscribed by then."""
        device = device or self.device
        return self.wait_for(
            lambda: next((s for s in reversed(self.device_status)
                          if s["device"] == device and s["online"]), None),
            timeout, "device {} online".format(device))

    def last_status(self, job_id):
        with self.lock:
            msgs = self.job_status.get(job_id) or []
            return msgs[-1] if msgs else None

    def wait_state(self, job_id, states, timeout=60):
        states = (states,) if isinstance(states, str) else tuple(states)

        def done():
            last = self.last_status(job_id)
            return last if last is not None and last["state"] in states else None

        return self.wait_for(done, timeout, "job {} to reach {} (last: {})".format(
            job_id, states, self.last_status(job_id)))

    def wait_stage(self, job_id, stages, timeout=60):
        stages = (stages,) if isinstance(stages, str) else tuple(stages)

        def seen():
            with self.lock:
                return any(m.get("stage") in stages for m in self.job_status.get(job_id, []))

        return self.wait_for(seen, timeout, "job {} stage {}".format(job_id, stages))

    def diag(self, timeout=20):
        import uuid

        rid = "r" + uuid.uuid4().hex[:8]
        self.command({"command": "diag", "request_id": rid})
        return self.wait_for(
            lambda: next((r for r in self.replies if r.get("request_id") == rid), None),
            timeout, "diag reply")

    def close(self):
        self._stop = True
        self.client.stop()
        self.thread.join(5)


@pytest.fixture
def controller(mosquitto):
    ctl = Controller(mosquitto)
    try:
        yield ctl
    finally:
        ctl.close()


@pytest.fixture
def agent_factory(mosquitto, tmp_path):
    """agent_factory(device="dev1", extra_config="") -> AgentProcess (not started)."""
    made = []

    def make(device="dev1", extra_config="", workdir=None, **kwargs):
        wd = workdir or tmp_path / ("agent-" + device)
        os.makedirs(str(wd), exist_ok=True)
        agent = AgentProcess(mosquitto, wd, device, extra_config, **kwargs)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        try:
            agent.stop(timeout=20)
        except Exception:  # noqa: BLE001
            agent.kill()


@pytest.fixture(scope="session")
def digits_files(tmp_path_factory):
    """The int8 digits deploy set: model.onnx, calibration (train rows), inputs + goldens (fp32
    outputs on the test rows, computed with ONNX Runtime) and the true labels."""
    import numpy as np
    import onnxruntime as ort

    from tests.models import digits_classifier, save

    d = tmp_path_factory.mktemp("digits")
    model, (x_train, _y_train, x_test, y_test) = digits_classifier()
    files = {"model": save(model, d / "digits.onnx")}
    np.savez(str(d / "calib.npz"), input=x_train[:512])
    files["calibration"] = str(d / "calib.npz")
    np.savez(str(d / "inputs.npz"), input=x_test)
    files["inputs"] = str(d / "inputs.npz")
    sess = ort.InferenceSession(files["model"], providers=["CPUExecutionProvider"])
    logits = sess.run(["logits"], {"input": x_test})[0]
    np.savez(str(d / "goldens.npz"), logits=logits)
    files["goldens"] = str(d / "goldens.npz")
    np.save(str(d / "labels.npy"), y_test)
    files["labels"] = str(d / "labels.npy")
    return files
