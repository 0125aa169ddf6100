"""TLS to the broker with the shipped fleet configuration (systemd/mosquitto/jetson-fleet.conf):
the broker verified against a CA file, client certificates (mutual TLS, the certificate's CN is
the MQTT identity the ACL applies to), the daemon and the fleet CLI over it with signed jobs,
and a wrong CA answered with a clear ``broker_unreachable``. Certificates are made by the test
with ``cryptography`` (tests/integration/pki.py)."""

import json
import os
import queue
import subprocess
import sys
import time
import uuid

import pytest

from agent.errors import AgentError
from agent.wire import job_signer, protocol
from agent.wire.mqtt import CONNECT_FAILED, MqttClient
from agent.wire.mqtt_types import TlsOptions
from agent.wire.topics import Topics
from tests.integration.conftest import MOSQUITTO, ROOT, AgentProcess
from tests.integration.pki import FleetBroker, Pki

T = Topics()


@pytest.fixture
def mtls(tmp_path):
    if not os.path.exists(MOSQUITTO):
        pytest.skip("mosquitto is not installed")
    pki = Pki(tmp_path / "pki")
    broker = FleetBroker(tmp_path / "broker", pki).start()
    yield broker
    broker.stop(kill=False)


@pytest.fixture
def tls_agents(mtls, tmp_path):
    """make(device, **AgentProcess kwargs) -> an agent of the mutual-TLS broker."""
    made = []

    def make(device, **kwargs):
        workdir = tmp_path / ("agent-" + device)
        workdir.mkdir()
        agent = AgentProcess(mtls, workdir, device, **kwargs)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        try:
            agent.stop(timeout=20)
        except Exception:  # noqa: BLE001
            agent.kill()


def client(broker, ca_file, cert=None, protocol_version="v5"):
    cert_file, key_file = cert if cert else (None, None)
    c = MqttClient("t-" + uuid.uuid4().hex[:8], broker.host, broker.port,
                   protocol=protocol_version,
                   tls=TlsOptions(ca_file=ca_file, cert_file=cert_file, key_file=key_file),
                   clean_start=True, session_expiry=0, reconnect_min=0.2, reconnect_max=0.5,
                   events=queue.Queue())
    c.start()
    return c


def refused(c, timeout=5.0):
    """The AgentError wait_connected raises once the first attempt has failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not c.last_error:
        try:
            if c.events.get(timeout=0.05).kind == CONNECT_FAILED:
                break
        except queue.Empty:
            pass
    with pytest.raises(AgentError) as exc:
        c.wait_connected(0.1)
    return exc.value


def test_mutual_tls_identities(mtls, tmp_path):
    pki = mtls.pki
    dev_a = client(mtls, pki.ca_file, pki.client("dev-a"))
    try:
        dev_a.wait_connected(10)
        # The certificate's CN is the user name the ACL applies to.
        own = dev_a.publish(T.status("dev-a"), b"{}", qos=1)
        other = dev_a.publish(T.status("dev-b"), b"{}", qos=1)
        assert own.wait(5) and own.ok
        assert other.wait(5) and not other.ok and "authori" in other.reason.lower()
    finally:
        dev_a.stop()
    # No client certificate, or one from another CA: the handshake fails.
    no_cert = client(mtls, pki.ca_file)
    other_pki = Pki(tmp_path / "other", name="other-ca")
    foreign = client(mtls, pki.ca_file, other_pki.client("dev-a"))
    try:
        for c, says in ((no_cert, "requires a client certificate"),
                        (foreign, "refused the client certificate")):
            err = refused(c)
            assert err.code == "broker_unreachable"
            assert "{}:{}".format(mtls.host, mtls.port) in err.message
            assert says in err.message, err.message
    finally:
        no_cert.stop()
        foreign.stop()


def test_a_wrong_ca_is_a_clear_broker_unreachable(mtls, tmp_path):
    other = Pki(tmp_path / "other", name="other-ca")
    c = client(mtls, other.ca_file, mtls.pki.client("dev-a"))
    try:
        err = refused(c)
    finally:
        c.stop()
    assert err.code == "broker_unreachable"
    assert "certificate verify failed" in err.message, err.message
    assert "broker.tls.ca_file" in err.message  # says what to check
    # The fleet CLI says the same, and exits 2 without a traceback.
    cert, key = mtls.pki.client("controller")
    proc = subprocess.run(
        [sys.executable, "-m", "agent", "fleet", "devices", "--broker", mtls.url,
         "--ca-file", other.ca_file, "--cert-file", cert, "--key-file", key,
         "--connect-timeout", "5"],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
        env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 2, proc
    assert "broker_unreachable" in proc.stderr and "certificate verify failed" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_daemon_and_fleet_cli_over_mutual_tls_with_signed_jobs(mtls, tmp_path, tls_agents,
                                                               digits_files):
    from tests.integration.controller import Controller

    pki = mtls.pki
    keys = job_signer.generate_keypair(str(tmp_path / "keys"), "fleet")
    # The device's certificate and key as systemd credentials (LoadCredential=): the config
    # names them relative to $CREDENTIALS_DIRECTORY.
    creds = tmp_path / "credentials"
    creds.mkdir()
    cert, key = pki.client("dev-a")
    os.rename(cert, str(creds / "mqtt-client.crt"))
    os.rename(key, str(creds / "mqtt-client.key"))
    agent = tls_agents("dev-a", security="  trusted_keys: [{}]\n".format(keys["public_key"]),
                          broker_extra=("  tls:\n    ca_file: {}\n    cert_file: mqtt-client.crt\n"
                                        "    key_file: mqtt-client.key\n").format(pki.ca_file))
    with open(agent.config) as f:
        text = f.read()
    assert "port: {}".format(mtls.port) in text
    agent.start(env_extra={"CREDENTIALS_DIRECTORY": str(creds)})
    signer = job_signer.Signer(keys["private_key"], str(tmp_path / "seq.json"))
    ctl_cert, ctl_key = pki.client("controller")
    ctl = Controller(mtls, device="dev-a", signer=signer,
                     tls=TlsOptions(ca_file=pki.ca_file, cert_file=ctl_cert, key_file=ctl_key))
    try:
        ctl.wait_online("dev-a", timeout=30)
        model = ctl.add_artifact(digits_files["model"])
        ctl.send_job({"job_id": "over-tls", "kind": "bench", "artifacts": {"model": model},
                      "plan": {"precision": "fp32"}, "bench": {"iterations": 5, "warmup": 0}})
        final = ctl.wait_state("over-tls", protocol.TERMINAL_STATES, 60)
        assert final["state"] == "SUCCEEDED", (final, agent.log_tail())
        diag = ctl.diag()
        security = diag["result"]["security"]
        assert security["tls"] is True and security["client_certificate"] is True
        assert security["signing"] == "required"
        assert security["trusted_keys"] == [keys["key_id"]]
        assert not security["problems"]
        # The controller's CLI over mutual TLS.
        proc = subprocess.run(
            [sys.executable, "-m", "agent", "fleet", "devices", "--json", "--wait", "0",
             "--broker", mtls.url, "--ca-file", pki.ca_file, "--cert-file", ctl_cert,
             "--key-file", ctl_key], capture_output=True, text=True, cwd=ROOT, timeout=60,
            env=dict(os.environ, PYTHONPATH=ROOT))
        assert proc.returncode == 0, proc.stderr
        rows = json.loads(proc.stdout)
        assert [(r["device"], r["online"]) for r in rows] == [("dev-a", True)]
    finally:
        ctl.close()
    assert agent.stop() == 0


def test_the_daemon_reports_a_wrong_ca_in_its_log(mtls, tmp_path, tls_agents):
    other = Pki(tmp_path / "other", name="other-ca")
    cert, key = mtls.pki.client("dev-a")
    agent = tls_agents("dev-a", broker_extra=(
        "  tls:\n    ca_file: {}\n    cert_file: {}\n    key_file: {}\n").format(
            other.ca_file, cert, key)).start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and "certificate verify failed" not in agent.log_tail():
        time.sleep(0.2)
    log = agent.log_tail(20000)
    assert "broker_unreachable" in log and "certificate verify failed" in log, log
    assert agent.alive()  # it keeps retrying (a CA rotation may be under way)
    assert agent.stop() == 0


def test_diag_reports_the_security_posture(tmp_path):
    keys = job_signer.generate_keypair(str(tmp_path), "fleet")
    pki = Pki(tmp_path / "pki")
    lab = tmp_path / "lab.yaml"
    lab.write_text("security:\n  allow_unsigned: true\n")
    secure = tmp_path / "secure.yaml"
    secure.write_text("broker:\n  port: 8883\n  tls:\n    ca_file: {}\nsecurity:\n"
                      "  trusted_keys: [fleet.pub]\n".format(pki.ca_file))

    def diag(path):
        proc = subprocess.run([sys.executable, "-m", "agent", "diag", "--json", "--no-jtop",
                               "--config", str(path)], capture_output=True, text=True,
                              cwd=ROOT, timeout=60, env=dict(os.environ, PYTHONPATH=ROOT))
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    report = diag(lab)
    sec = report["security"]
    assert (sec["tls"], sec["signing"], sec["allow_unsigned"]) == (False, "off", True)
    flagged = [p["problem"] for p in report["problems"] if p["source"] == "security"]
    assert any("allow_unsigned" in p for p in flagged) and any("not encrypted" in p
                                                               for p in flagged)
    assert report["ok"] is False
    report = diag(secure)
    sec = report["security"]
    assert (sec["tls"], sec["verify_server"], sec["signing"]) == (True, True, "required")
    assert sec["trusted_keys"] == [keys["key_id"]] and sec["problems"] == []
    assert not [p for p in report["problems"] if p["source"] == "security"]


def test_fleet_keygen_and_a_signed_rollout_over_mutual_tls(mtls, tmp_path, tls_agents):
    """``fleet keygen``, then ``fleet rollout --signing-key`` over mutual TLS to a device that
    trusts the key and one that trusts another key only."""
    env = dict(os.environ, PYTHONPATH=ROOT, XDG_STATE_HOME=str(tmp_path / "xdg"))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "agent"] + list(args), capture_output=True,
                              text=True, cwd=ROOT, timeout=120, env=env)

    made = json.loads(cli("fleet", "keygen", "--out", str(tmp_path / "keys"), "--name", "fleet",
                          "--json").stdout)
    assert oct(os.stat(made["private_key"]).st_mode & 0o777) == "0o600"
    again = cli("fleet", "keygen", "--out", str(tmp_path / "keys"), "--name", "fleet")
    assert again.returncode == 2 and "already exists" in again.stderr
    other = job_signer.generate_keypair(str(tmp_path / "keys"), "other")
    pki = mtls.pki
    agents = []
    for device, key in (("dev-a", made["public_key"]), ("dev-b", other["public_key"])):
        cert, key_file = pki.client(device)
        agents.append(tls_agents(device, security="  trusted_keys: [{}]\n".format(key),
                                 broker_extra="  tls:\n    ca_file: {}\n    cert_file: {}\n"
                                              "    key_file: {}\n".format(pki.ca_file, cert,
                                                                          key_file)).start())
    cert, key_file = pki.client("controller")
    conn = ["--broker", mtls.url, "--ca-file", pki.ca_file, "--cert-file", cert,
            "--key-file", key_file]
    deadline = time.monotonic() + 30
    while True:
        listed = cli("fleet", "devices", "--json", "--wait", "0", *conn)
        rows = json.loads(listed.stdout or "[]")
        if sum(1 for r in rows if r["online"]) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    digits = os.path.join(ROOT, "examples", "digits")
    proc = cli("fleet", "rollout", "--model", os.path.join(digits, "model.onnx"),
               "--precision", "fp32", "--inputs", os.path.join(digits, "inputs.json"),
               "--golden", os.path.join(digits, "golden.json"), "--atol", "0.001",
               "--devices", "dev-a", "dev-b", "--success-threshold", "0.5", "--timeout", "20",
               "--rollout-id", "signed-1",
               "--signing-key", made["private_key"], "--json", "-q", *conn)
    assert proc.returncode == 1, proc.stderr  # one device refused it
    report = json.loads(proc.stdout)
    assert report["signing_key"] == made["key_id"]
    rows = {r["device"]: r for r in report["devices"]}
    assert rows["dev-a"]["state"] == "SUCCEEDED", rows["dev-a"]
    # dev-b does not trust the key: the document proves no trusted origin, so it claims no
    # job id there and gets no answer (an open broker's anonymous publisher must not be able
    # to pre-empt a job id); dev-b's log says why.
    assert rows["dev-b"]["state"] != "SUCCEEDED", rows["dev-b"]
    with open(agents[1].log) as f:
        ignored = [line for line in f if "proves no trusted origin" in line]
    assert ignored and "bad_signature" in ignored[0] and made["key_id"] in ignored[0], ignored
    # The sequence file (under $XDG_STATE_HOME) numbered the signatures.
    with open(os.path.join(str(tmp_path / "xdg"), "jetson-agent", "fleet-sequence.json")) as f:
        assert json.load(f)[made["key_id"]] > 0
    for agent in agents:
        assert agent.stop() == 0
