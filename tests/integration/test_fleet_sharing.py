"""Fleet engine sharing with real agents (onnxruntime backend), a real Mosquitto and a real
``fleet serve --http ... --share-engines``: three devices of one class build one engine
between them (the first builds and uploads it, the other two adopt it from their signed job
documents); then a builder that offers a tampered engine (a well-formed container whose bytes
are no engine) makes the devices of its class fall back to building, and say why.
"""

import hashlib
import json
import time
import urllib.request

from agent.engines import share as engine_share
from agent.fleet.database.store import Store
from agent.wire.topics import Topics
from tests.integration.test_fleet_rollout import retained_jobs, wait_status
from tests.integration.test_fleet_service import (
    Service,
    fleet_cli,
    fp16_args,
    wait_registered,
    wait_rollout,
)


def share_service(mosquitto, db, tmp_path):
    service = Service(mosquitto, db, tmp_path)
    service.args += ["--http", "127.0.0.1:0", "--http-min-bytes", "1", "--share-engines",
                     "--share-wait", "90"]
    return service.start()


def test_one_build_two_adoptions_then_a_tampered_engine_falls_back(
        mosquitto, agent_factory, tmp_path):
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    names = ["sh-a", "sh-b", "sh-c"]
    agents = [agent_factory(n).start() for n in names]
    wait_status(mosquitto, names, agents=agents)
    service = share_service(mosquitto, db, tmp_path)
    try:
        wait_registered(db, names, service)
        out = fleet_cli(["rollout"] + fp16_args() + ["--devices"] + names + [
            "--rollout-id", "ro-share", "--db", db, "--submit", "--json"], timeout=180)
        assert out.returncode == 0, out.stderr + service.tail()
        rows = {r["device"]: r for r in json.loads(out.stdout)["devices"]}
        assert all(r["state"] == "SUCCEEDED" for r in rows.values()), rows
        modes = {d: r["share"]["mode"] for d, r in rows.items()}
        assert modes == {"sh-a": "built", "sh-b": "adopted", "sh-c": "adopted"}, rows
        assert rows["sh-a"]["share"]["offered"] is True and rows["sh-a"]["share"]["role"] == \
            "builder"
        store = Store(db)
        try:
            keys = {j["device"]: (j.get("result") or {}).get("engine_key")
                    for j in store.rollout_jobs("ro-share")}
        finally:
            store.close()
        key = keys["sh-a"]
        assert key and keys["sh-b"] == keys["sh-c"] == key, keys

        # A builder offering a tampered engine: "sh-0" (stopped, so the test answers for it)
        # uploads a container with the right key whose engine bytes are garbage.
        evil = agent_factory("sh-0").start()
        fresh = [agent_factory(n).start() for n in ("sh-d", "sh-e")]
        wait_status(mosquitto, ["sh-0", "sh-d", "sh-e"], agents=[evil] + fresh)
        assert evil.stop() == 0
        wait_status(mosquitto, ["sh-0"], online=False)
        wait_registered(db, ["sh-0", "sh-d", "sh-e"], service)
        out = fleet_cli(["rollout"] + fp16_args() + [
            "--devices", "sh-0", "sh-d", "sh-e", "--rollout-id", "ro-bad", "--db", db,
            "--submit", "--detach"])
        assert out.returncode == 0, out.stderr
        deadline = time.monotonic() + 30
        doc = None
        while doc is None:
            doc = retained_jobs(mosquitto).get(("sh-0", "ro-bad"))
            assert time.monotonic() < deadline, service.tail()
        waiting = wait_rollout(db, "ro-bad", lambda r: True, service)
        assert [r["state"] for r in waiting["devices"]] == ["QUEUED", "PENDING", "PENDING"]
        bad = tmp_path / "bad.share"
        garbage = tmp_path / "garbage"
        garbage.write_bytes(b"not an engine " * 64)
        engine_share.write_container(str(bad), key, str(garbage), {}, "sh-0")
        # A compromised builder has its own device key: it signs what it uploads and
        # reports (anyone else's upload is refused: tests/unit/test_share_uploads.py).
        from agent.wire import device_identity

        evil_key = device_identity.load_device_key(evil.key_path)
        reg = Store(db)
        evil_class = (reg.device("sh-0")["platform"] or {}).get("engine_class")
        reg.close()
        data = bad.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        sig = device_identity.sign_engine(evil_key, device_identity.engine_statement(
            "sh-0", "ro-bad", sha, len(data), evil_class))
        req = urllib.request.Request(doc["share"]["offer"], data=data, method="PUT", headers={
            "X-Content-Sha256": sha, "X-Engine-Signature": sig})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 201
        topic = Topics().job_status("sh-0", "ro-bad")
        status = {"protocol": 1, "job_id": "ro-bad", "device": "sh-0", "kind": "deploy",
                  "state": "SUCCEEDED", "version": 1, "ts": time.time(), "statusDetails": {},
                  "result": {"engine_key": key, "share": {"mode": "built", "offered": True}}}
        host, port = mosquitto.url.split("://")[-1].rsplit(":", 1)
        from agent.wire.mqtt import MqttClient

        payload = json.dumps(status).encode()
        client = MqttClient("evil-sh-0", host, int(port), clean_start=True, session_expiry=0)
        client.start()
        client.wait_connected(10)
        assert client.publish(topic, payload, user_properties=device_identity.ReportSigner(
            evil_key, "sh-0", 1000).properties(topic, payload)).wait(10)
        client.stop()
        report = wait_rollout(db, "ro-bad", lambda r: r["state"] in (
            "succeeded", "failed", "aborted"), service, timeout=180)
        rows = {r["device"]: r for r in report["devices"]}
        for dev in ("sh-d", "sh-e"):
            assert rows[dev]["state"] == "SUCCEEDED", rows
            assert rows[dev]["share"]["mode"] == "built", rows
            assert "does not load here" in rows[dev]["share"]["reason"], rows
        text = fleet_cli(["rollouts", "show", "ro-bad", "--db", db]).stdout
        assert "sh-d: built its own engine: the shared engine does not load here" in text, text
        text = fleet_cli(["rollouts", "show", "ro-share", "--db", db]).stdout
        assert text.count("(shared engine)") == 2, text
    finally:
        service.kill()
    for agent in agents + fresh:
        agent.assert_store_sound()


def test_sharing_over_https_and_a_device_without_the_ca(mosquitto, agent_factory, tmp_path):
    """``fleet serve --http ... --http-tls-cert/--http-tls-key --share-engines``: the job
    documents carry https:// URLs; devices given the CA (``transfer.http_ca_file``) fetch their
    artifacts over HTTPS and the builder uploads its engine over HTTPS, which the other
    adopts; a device without the CA refuses the server (``server_untrusted``): its artifacts
    come over MQTT blocks and, as a builder, its engine is not offered."""
    from tests.integration.pki import Pki

    pki = Pki(tmp_path / "pki")
    cert, key = pki.server("fleet-http")
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    with_ca = "transfer:\n  http_ca_file: {}\n".format(pki.ca_file)
    agents = [agent_factory(n, extra_config=with_ca).start() for n in ("tls-a", "tls-b")]
    blind = agent_factory("tls-0").start()  # no CA (and no broker TLS): the system's CAs
    names = ["tls-a", "tls-b", "tls-0"]
    wait_status(mosquitto, names, agents=agents + [blind])
    service = Service(mosquitto, db, tmp_path)
    service.args += ["--http", "127.0.0.1:0", "--http-tls-cert", cert, "--http-tls-key", key,
                     "--http-min-bytes", "1", "--share-engines", "--share-wait", "90"]
    service.start()
    try:
        wait_registered(db, names, service)
        out = fleet_cli(["rollout"] + fp16_args() + ["--devices", "tls-a", "tls-b",
                                                     "--rollout-id", "ro-tls", "--db", db,
                                                     "--submit", "--json"], timeout=180)
        assert out.returncode == 0, out.stderr + service.tail()
        rows = {r["device"]: r for r in json.loads(out.stdout)["devices"]}
        assert all(r["state"] == "SUCCEEDED" for r in rows.values()), rows
        assert {d: r["share"]["mode"] for d, r in rows.items()} == {
            "tls-a": "built", "tls-b": "adopted"}, rows
        assert rows["tls-a"]["share"]["offered"] is True, rows
        for agent in agents:
            assert "over HTTP from https://127.0.0.1:" in agent.log_tail(40000)
        assert "server_untrusted" not in agents[0].log_tail(40000) + agents[1].log_tail(40000)

        # The device without the CA, alone in its rollout: its class's builder.
        out = fleet_cli(["rollout"] + fp16_args() + ["--devices", "tls-0", "--rollout-id",
                                                     "ro-blind", "--db", db, "--submit",
                                                     "--json"], timeout=180)
        assert out.returncode == 0, out.stderr + service.tail()
        row = json.loads(out.stdout)["devices"][0]
        assert row["state"] == "SUCCEEDED", row
        assert row["share"]["offered"] is False, row
        assert "[server_untrusted]" in row["share"]["reason"], row
        log = blind.log_tail(60000)
        assert "HTTPS fetch of artifact" in log and "[server_untrusted]" in log, log[-3000:]
        assert "CERTIFICATE_VERIFY_FAILED" in log and "fetching its blocks over MQTT" in log
        tail = service.tail(200000)
        assert "TLS handshake failed" in tail and "does not trust this certificate" in tail
        assert "Traceback" not in tail, tail[-3000:]
    finally:
        service.kill()
    for agent in agents + [blind]:
        agent.assert_store_sound()
