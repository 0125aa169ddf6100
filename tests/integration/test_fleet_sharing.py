"""Fleet engine sharing with real agents (onnxruntime backend), a real Mosquitto and a real
``fleet serve --http ... --share-engines --builders ...``: three devices of one class build one
engine between them (the designated builder builds and uploads it, the other two adopt it from
their signed job documents); then a builder that offers a tampered engine (a well-formed
container whose bytes are no engine) makes the devices of its class fall back to building, and
say why. The insider trojan (an upload with the builder's stolen key that the builder itself did
not report, a non-builder's offer) is refused, and a revoked engine is rolled back from.
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


def share_service(mosquitto, db, tmp_path, builders="sh-a,sh-0", extra=()):
    service = Service(mosquitto, db, tmp_path)
    service.args += ["--http", "127.0.0.1:0", "--http-min-bytes", "1", "--share-engines",
                     "--share-wait", "90", "--builders", builders] + list(extra)
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
        # A compromised *designated* builder has its own device key: it signs what it
        # uploads and reports its sha256 (the residual risk docs/security.md states: the
        # adopters' own load and gate checks are what is left). Anyone else's upload is
        # refused (tests/unit/fleet/test_share_uploads.py), and so is an upload the builder did
        # not report (test_an_insider_trojan_is_refused_and_a_revoked_engine_rolled_back).
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
                  "result": {"engine_key": key, "share": {"mode": "built", "offered": True,
                                                          "sha256": sha}}}
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
                     "--http-min-bytes", "1", "--share-engines", "--share-wait", "90",
                     "--builders", "tls-a,tls-0"]
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


def _meta_with_builder(agent):
    """The models directory's meta.json documents of ``agent`` (not the engine cache's)."""
    import glob
    import os

    out = {}
    for path in glob.glob(os.path.join(agent.workdir, "**", "meta.json"), recursive=True):
        with open(path) as f:
            meta = json.load(f)
        if "built_by" in meta:  # a version's directory, maybe also seen through "current"
            out[(meta["name"], meta["version"])] = meta
    return list(out.values())


def test_an_insider_trojan_is_refused_and_a_revoked_engine_rolled_back(
        mosquitto, agent_factory, tmp_path):
    """The attack of issue 33: with the designated builder's own device key (stolen), an
    engine is uploaded to the builder's offer URL before the builder's own. The builder then
    uploads and reports its engine (signed, naming its sha256): the adopters take that one;
    the trojan is refused (``fleet engines ls`` says why). A device that is not a designated
    builder cannot offer. The adopters' meta.json names the builder and its key id; ``fleet
    engines revoke`` makes them roll back from the engine."""
    from agent.wire import device_identity
    from agent.wire.signing import key_id

    db = "sqlite:///" + str(tmp_path / "fleet.db")
    builder = agent_factory("in-b").start()
    adopters = [agent_factory(n).start() for n in ("in-c", "in-d")]
    names = ["in-b", "in-c", "in-d"]
    wait_status(mosquitto, names, agents=[builder] + adopters)
    service = share_service(mosquitto, db, tmp_path, builders="in-b")
    try:
        wait_registered(db, names, service)
        # A first version on the adopters, built by each (no designated builder among them):
        # what a revoked engine rolls back to.
        base = [a for a in fp16_args() if a not in ("Add:float32", "Sub:float32",
                                                    "--layer-precisions")]
        base[base.index("fp16")] = "fp32"
        out = fleet_cli(["rollout"] + base + ["--devices", "in-c", "in-d", "--rollout-id",
                                              "ro-base", "--db", db, "--submit", "--json"],
                        timeout=180)
        assert out.returncode == 0, out.stderr + service.tail()
        rows = {r["device"]: r for r in json.loads(out.stdout)["devices"]}
        assert {d: r["share"]["mode"] for d, r in rows.items()} == {
            "in-c": "built", "in-d": "built"}, rows
        assert "no designated builder" in rows["in-c"]["share"]["reason"], rows

        # The builder is away; the attacker holding its key races it to the offer URL.
        assert builder.stop() == 0
        wait_status(mosquitto, ["in-b"], online=False)
        out = fleet_cli(["rollout"] + fp16_args() + ["--devices"] + names + [
            "--rollout-id", "ro-ins", "--db", db, "--submit", "--detach"])
        assert out.returncode == 0, out.stderr
        deadline = time.monotonic() + 30
        doc = None
        while doc is None:
            doc = retained_jobs(mosquitto).get(("in-b", "ro-ins"))
            assert time.monotonic() < deadline, service.tail()
        url = doc["share"]["offer"]
        reg = Store(db)
        cls = (reg.device("in-b")["platform"] or {}).get("engine_class")
        reg.close()
        garbage = tmp_path / "garbage"
        garbage.write_bytes(b"trojan " * 64)
        bad = tmp_path / "trojan.share"
        engine_share.write_container(str(bad), "k" * 64, str(garbage), {}, "in-b")
        data = bad.read_bytes()
        trojan = hashlib.sha256(data).hexdigest()

        def put(key, device):
            sig = device_identity.sign_engine(key, device_identity.engine_statement(
                device, "ro-ins", trojan, len(data), cls))
            req = urllib.request.Request(url, data=data, method="PUT", headers={
                "X-Content-Sha256": trojan, "X-Engine-Signature": sig})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    return resp.status
            except urllib.error.HTTPError as exc:
                return exc.code

        # A non-builder offering (its own key, its own name or the builder's): refused.
        other = device_identity.load_device_key(adopters[0].key_path)
        assert put(other, "in-c") == 403
        assert put(other, "in-b") == 403
        stolen = device_identity.load_device_key(builder.key_path)
        assert put(stolen, "in-b") == 201  # signed by the builder's key: stored, not trusted
        builder.start()
        report = wait_rollout(db, "ro-ins", lambda r: r["state"] in (
            "succeeded", "failed", "aborted"), service, timeout=240)
        rows = {r["device"]: r for r in report["devices"]}
        assert all(r["state"] == "SUCCEEDED" for r in rows.values()), rows
        assert {d: r["share"]["mode"] for d, r in rows.items()} == {
            "in-b": "built", "in-c": "adopted", "in-d": "adopted"}, rows
        out = fleet_cli(["engines", "ls", "--db", db, "--json"])
        assert out.returncode == 0, out.stderr
        listed = {r["sha256"]: r for r in json.loads(out.stdout)}
        assert listed[trojan]["state"] == "refused", listed
        assert listed[trojan]["adopters"] == [], listed
        genuine = next(s for s, r in listed.items() if r["state"] == "accepted")
        assert "its builder in-b reported engine " + genuine[:16] in listed[trojan]["why"]
        assert listed[genuine]["adopters"] == ["in-c", "in-d"], listed
        assert "refused" in fleet_cli(["engines", "ls", "--db", db]).stdout
        text = fleet_cli(["rollouts", "show", "ro-ins", "--db", db]).stdout
        assert "in-b: engine upload {} refused: its builder in-b reported".format(
            trojan[:16]) in text, text

        kid = key_id(stolen.raw_public)
        for agent in adopters:
            shared = [m for m in _meta_with_builder(agent) if m["built_by"]]
            assert len(shared) == 1, shared
            assert shared[0]["built_by"]["device"] == "in-b"
            assert shared[0]["built_by"]["key_id"] == kid
            assert shared[0]["built_by"]["shared_sha256"] == genuine
            assert shared[0]["built_by"]["sig"]
            journal = agent.journal()
            try:  # the journal's row of the version records the builder too
                row = journal.model_version(shared[0]["name"], shared[0]["version"])
            finally:
                journal.close()
            assert row["info"]["built_by"] == shared[0]["built_by"], row

        # Revoked: no longer offered, and its adopters roll back to their previous version.
        out = fleet_cli(["engines", "revoke", genuine, "--reason", "test", "--db", db,
                         "--broker", mosquitto.url, "--wait", "30", "--json"], timeout=90)
        assert out.returncode == 0, out.stdout + out.stderr
        answer = json.loads(out.stdout)
        assert sorted(d["device"] for d in answer["devices"]) == ["in-c", "in-d"], answer
        for dev in answer["devices"]:
            [version] = dev["result"]["versions"]
            assert version["rolled_back"]["version"], dev
            assert version["cache_dropped"] is True, dev
        out = fleet_cli(["engines", "ls", "--db", db, "--json"])
        assert {r["sha256"]: r["state"] for r in json.loads(out.stdout)}[genuine] == "revoked"
        for agent in adopters:
            assert "revoked shared engine " + genuine[:16] in agent.log_tail(40000)
    finally:
        service.kill()
    for agent in [builder] + adopters:
        agent.assert_store_sound()


def test_a_quorum_of_two_builders_agrees_before_the_class_adopts(
        mosquitto, agent_factory, tmp_path):
    """``--share-quorum 2``: two designated builders build the engine independently and
    report the digest of its outputs on the rollout's inputs; the third device adopts only
    once both reports agree."""
    db = "sqlite:///" + str(tmp_path / "fleet.db")
    names = ["q-a", "q-b", "q-c"]
    agents = [agent_factory(n).start() for n in names]
    wait_status(mosquitto, names, agents=agents)
    service = share_service(mosquitto, db, tmp_path, builders="q-a,q-b",
                            extra=["--share-quorum", "2"])
    try:
        wait_registered(db, names, service)
        out = fleet_cli(["rollout"] + fp16_args() + ["--devices"] + names + [
            "--rollout-id", "ro-quorum", "--db", db, "--submit", "--json"], timeout=180)
        assert out.returncode == 0, out.stderr + service.tail()
        rows = {r["device"]: r for r in json.loads(out.stdout)["devices"]}
        assert {d: r["share"]["mode"] for d, r in rows.items()} == {
            "q-a": "built", "q-b": "built", "q-c": "adopted"}, rows
        store = Store(db)
        try:
            results = {j["device"]: j.get("result") or {} for j in
                       store.rollout_jobs("ro-quorum")}
        finally:
            store.close()
        digests = {d: results[d]["share"].get("outputs_sha256") for d in ("q-a", "q-b")}
        assert digests["q-a"] and digests["q-a"] == digests["q-b"], results
    finally:
        service.kill()
    for agent in agents:
        agent.assert_store_sound()
