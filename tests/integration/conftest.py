"""A real Mosquitto broker per test: started on a free loopback port, persistence off.

``mosquitto`` yields a ``Broker`` (host, port, url, restart(), stop(), start()). Tests that kill
the broker mid-transfer call ``broker.stop()`` / ``broker.start()`` (same port) or
``broker.restart()``.
"""

import contextlib
import os
import shutil
import socket
import subprocess
import time

import pytest

from tests.integration.controller import Controller

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


# --- device identity: every test daemon has its own key, every test controller admits by
# --- the pre-provisioned list of those keys (docs/security.md, "Admission")

@pytest.fixture(autouse=True)
def admission_keys(tmp_path_factory, monkeypatch):
    """The keys file the fleet commands of this test admit devices by
    (``--admission keys``, through its environment defaults); ``AgentProcess`` adds each
    daemon's public key to it. Outside the test's tmp_path, which tests find empty."""
    path = tmp_path_factory.mktemp("admission") / "admission-keys"
    path.write_text("# device public keys of this test\n")
    monkeypatch.setenv("JETSON_AGENT_FLEET_ADMISSION", "keys")
    monkeypatch.setenv("JETSON_AGENT_FLEET_ADMISSION_KEYS", str(path))
    return str(path)


def provision_device_key(workdir, keys_file=None, device=None):
    """``device.key`` in ``workdir`` (beside its agent.yaml: the default place) and its public
    key appended to the keys file (default: this test's, from the environment), bound to
    ``device`` when given (an ``ID KEY`` line)."""
    from agent.wire.device_identity import create_device_key

    key_path = os.path.join(str(workdir), "device.key")
    key = create_device_key(key_path) if not os.path.exists(key_path) else None
    keys_file = keys_file or os.environ.get("JETSON_AGENT_FLEET_ADMISSION_KEYS")
    if key is not None and keys_file:
        with open(keys_file, "a") as f:
            f.write((device + " " if device else "") + key.public_base64 + "\n")
    return key_path


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


@contextlib.contextmanager
def limited_broker(tmp_path, max_queued, max_inflight):
    """A broker whose session queue holds ``max_queued`` messages (``max_inflight`` in flight):
    what does not fit is dropped, as Mosquitto does (the shipped config, or one tighter)."""
    if not os.path.exists(MOSQUITTO):
        pytest.skip("mosquitto is not installed")
    workdir = tmp_path / "broker"
    workdir.mkdir()
    broker = Broker(workdir, max_queued=max_queued, max_inflight=max_inflight)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop(kill=False)


class Broker:
    host = "127.0.0.1"

    def __init__(self, workdir, port=None, message_size_limit=0, max_queued=10000,
                 max_inflight=None):
        self.workdir = str(workdir)
        self.port = port or free_port()
        self.config = os.path.join(self.workdir, "mosquitto.conf")
        self.log = os.path.join(self.workdir, "mosquitto.log")
        with open(self.config, "w") as f:
            f.write("listener {} 127.0.0.1\n".format(self.port))
            f.write("allow_anonymous true\n")
            f.write("persistence false\n")
            f.write("max_queued_messages {}\n".format(max_queued))
            if max_inflight is not None:
                f.write("max_inflight_messages {}\n".format(max_inflight))
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
                 broker_extra="", identity=True):
        self.broker = broker
        self.device = device
        self.workdir = str(workdir)
        self.state_dir = os.path.join(self.workdir, "state")
        self.config = os.path.join(self.workdir, "agent.yaml")
        self.log = os.path.join(self.workdir, "agent.log")
        self.key_path = provision_device_key(self.workdir, device=device) if identity else None
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
        from agent.device.journal.store import Journal

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


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    """A fleet Store on a fresh SQLite file and on the real PostgreSQL (a test module that
    takes it imports the ``postgres`` fixture)."""
    from agent.fleet.database.store import Store

    s = Store("sqlite:///" + str(tmp_path / "fleet.db")) if request.param == "sqlite" else \
        Store(request.getfixturevalue("postgres").url)
    try:
        yield s
    finally:
        s.close()


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
