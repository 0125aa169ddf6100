"""The fault suite (``suite.py``): what an attacker does to a daemon with signed jobs on a real
broker (oversized statuses, a refusing broker, unserved artifacts, a client-id takeover,
anonymous job documents, junk block floods); after each the daemon must take a genuine job."""

import json
import os
import random
import subprocess
import sys
import time

import pytest

from agent.wire import protocol
from tests.integration.faults.suite import (
    MODEL,
    REPORT,
    SEED,
    SMALL_BLOCKS,
    _forged,
    _send_raw_job,
    audit,
    fault,
    finish,
    read,
    started,
)

# ---------------------------------------------------------------------------- attacks

# What an attacker did to a daemon with signed jobs on a real broker (the hardening issue),
# one class per test; after each the daemon must complete a genuine job within 30 s.
AFTER_ATTACK_S = 30

WORKER_FAULTS = """#!{python}
# Fault injection: the worker of a job whose id starts with a key below prints the error
# given (as the real worker prints its errors) and exits 2; other jobs run the real worker.
import json, os, sys

NAMES = ["output_{{}}".format(i) for i in range(30000)]
ERRORS = {{
    "huge-name": {{"code": "bad_golden_file", "message": "golden output {{!r}} is not an output of "
                  "the model".format("o" * (2 << 20))}},
    "gate-30000": {{"code": "accuracy_gate_failed", "message": "the engine fails the accuracy "
                   "gate: output(s) {{}} outside atol/rtol".format(NAMES),
                   "details": {{"accuracy": {{"passed": False, "failed_outputs": NAMES}}}}}},
    "big-status": {{"code": "bad_golden_file", "message": "x" * 20000}},
}}
if "--job" not in sys.argv:  # the daemon's start-up probe of the backend: the real Python
    os.execv(sys.executable, [sys.executable] + sys.argv[1:])
spec = sys.argv[sys.argv.index("--job") + 1]
job_id = os.path.basename(os.path.dirname(spec))
for key, error in ERRORS.items():
    if job_id.startswith(key):
        sys.stdout.write(json.dumps({{"type": "error", "error": error}}) + "\\n")
        sys.exit(2)
os.execv(sys.executable, [sys.executable] + sys.argv[1:])
"""


def worker_faults(tmp_path):
    path = tmp_path / "worker-faults"
    path.write_text(WORKER_FAULTS.format(python=sys.executable))
    path.chmod(0o755)
    return "worker_python: {}\n".format(path)


def genuine_job(controller, keys, signer, job_id, agent):
    """A signed bench job sent after an attack: it must succeed within AFTER_ATTACK_S."""
    _send_raw_job(controller, _forged(controller, keys, signer, job_id))
    try:
        msg = controller.wait_state(job_id, protocol.TERMINAL_STATES, AFTER_ATTACK_S)
    except AssertionError:
        msg = {"state": "no answer"}
    if msg["state"] != "SUCCEEDED":
        REPORT["devices_out_of_service"] += 1
    assert msg["state"] == "SUCCEEDED", (msg, agent.log_tail())


def shipped_max_packet_size():
    from tests.integration.pki import FLEET_CONF

    with open(FLEET_CONF) as f:
        for line in f:
            if line.startswith("max_packet_size "):
                return int(line.split()[1])
    raise AssertionError("the shipped Mosquitto config sets no max_packet_size")


def limit_packets(broker, limit):
    """Restart the test broker with a max_packet_size (larger packets: it disconnects the
    sender)."""
    broker.stop()
    with open(broker.config, "a") as f:
        f.write("max_packet_size {}\n".format(limit))
    broker.start()


@pytest.fixture
def shipped_limit(mosquitto):
    limit = shipped_max_packet_size()
    limit_packets(mosquitto, limit)
    return limit


def disconnects(agent):
    return read(agent.log).count("disconnected from ")


def test_oversized_statuses_never_reach_the_broker(shipped_limit, fleet, keys, signer,
                                                   digits_files, tmp_path):
    """A worker error naming a 2 MB output and a gate failure listing 30,000 outputs become
    statuses under the per-topic limit (texts cut with a marker, lists summarised): the
    device keeps its connection and takes the next job."""
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent(extra_config=worker_faults(tmp_path))
    controller.wait_online()
    assert 2 << 20 > shipped_limit
    for job_id in ("huge-name", "gate-30000"):
        _send_raw_job(controller, _forged(controller, keys, signer, job_id))
        msg = controller.wait_state(job_id, protocol.TERMINAL_STATES, AFTER_ATTACK_S)
        assert msg["state"] in ("FAILED", "REJECTED"), (msg, agent.log_tail())
        assert msg["error"]["code"] in ("bad_golden_file", "accuracy_gate_failed")
        assert len(protocol.encode(msg)) <= protocol.MAX_BYTES["job_status"]
    assert "more characters cut]" in controller.last_status("huge-name")["error"]["message"]
    gate = controller.last_status("gate-30000")["error"]
    assert "more characters cut]" in gate["message"]
    failed = gate["details"]["accuracy"]["failed_outputs"]  # summarised, the count kept
    assert failed[-1].endswith("more items]") and len(failed) < 1000, failed[-3:]
    fault("oversized_status", 2)
    genuine_job(controller, keys, signer, "after-oversized", agent)
    assert disconnects(agent) == 0, agent.log_tail()
    result = audit(agent, controller, ["huge-name", "gate-30000", "after-oversized"])
    assert not result["lost"] and not result["pending"], result


def test_a_status_the_broker_keeps_refusing_goes_out_short(mosquitto, agent_factory, keys,
                                                           signer, digits_files, tmp_path):
    """A broker whose max_packet_size is below a (valid, 20 KB) status and that advertises
    none (MQTT 3.1.1): it drops the connection on every try; after a bounded number of tries
    the outbox sends the status's short form, and the device works on."""
    from tests.integration.controller import Controller

    limit_packets(mosquitto, 8000)
    controller = Controller(mosquitto, signer=signer)
    agent = agent_factory("dev1", extra_config=SMALL_BLOCKS + worker_faults(tmp_path),
                          security=keys["security"], broker_extra="  protocol: v3.1.1\n")
    try:
        started(agent)
        MODEL[:] = [digits_files["model"]]
        controller.wait_online()
        _send_raw_job(controller, _forged(controller, keys, signer, "big-status"))
        msg = controller.wait_state("big-status", protocol.TERMINAL_STATES, AFTER_ATTACK_S)
        assert msg["state"] == "REJECTED" and msg["error"]["code"] == "bad_golden_file", msg
        assert msg["statusDetails"].get("truncated") == "true", msg  # the short form
        tries = disconnects(agent)
        assert 1 <= tries <= 10, agent.log_tail()
        fault("refused_status", tries)
        genuine_job(controller, keys, signer, "after-refused", agent)
        result = audit(agent, controller, ["big-status", "after-refused"])
        assert not result["lost"] and not result["pending"], result
    finally:
        finish(agent)
        controller.close()


def _status_json(agent):
    proc = subprocess.run([sys.executable, "-m", "agent", "status", "--state-dir",
                           agent.state_dir, "--json"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_unserved_artifacts_leave_no_partials(fleet, keys, signer, digits_files):
    """Jobs naming large artifacts nobody serves, one killed -9 mid-download: their
    pre-allocated partials count against the store budget, show in ``status``, and are
    reclaimed when the jobs end, so the next job does not fail disk_full."""
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    budget = 4 << 20
    agent = make_agent(extra_config="limits:\n  max_store_bytes: {}\n".format(budget))
    controller.wait_online()
    ids = []
    for i, size in enumerate((budget - 4096, budget // 2)):
        job_id = "unserved-{}".format(i)
        ids.append(job_id)
        doc = {k: v for k, v in _forged(controller, keys, signer, job_id).items()
               if k != "signature"}
        doc["artifacts"] = {"model": {"sha256": "{:02x}".format(i + 1) * 32, "size": size,
                                      "name": "unserved.onnx"}}
        doc["timeout_s"] = 4
        _send_raw_job(controller, controller.signer.sign(doc))
        controller.wait_stage(job_id, ["downloading"], 30)
        partial = [p for p in _status_json(agent)["transfers"] if p["size"] == size]
        assert partial and partial[0]["referenced"], _status_json(agent)
        if i == 0:
            agent.kill()  # restarts included: the unfinished job resumes, then times out
            fault("agent_kill_9")
            started(agent)
        msg = controller.wait_state(job_id, protocol.TERMINAL_STATES, 30)
        assert msg["state"] == "TIMED_OUT", msg
    fault("unserved_artifact", len(ids))
    assert _status_json(agent)["transfers"] == []
    assert os.listdir(os.path.join(agent.state_dir, "artifacts", "partial")) == []
    genuine_job(controller, keys, signer, "after-unserved", agent)
    result = audit(agent, controller, ids + ["after-unserved"])
    assert not result["lost"] and not result["corrupt"], result


def test_a_client_id_takeover_is_surfaced(fleet, mosquitto, keys, signer, digits_files):
    """On a broker that does not bind client ids to identities (the shipped one does:
    test_acl), a client connecting with the device's id knocks it off: the daemon says so in
    its log and in ``status``, reconnects, and works on once the intruder is gone."""
    import queue

    from agent.wire.mqtt import DISCONNECTED, MqttClient

    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent()
    controller.wait_online()
    intruder = MqttClient("dev1", mosquitto.host, mosquitto.port, clean_start=False,
                          reconnect_min=0.5, reconnect_max=0.5, events=queue.Queue())
    intruder.start()
    try:
        agent.wait_journal(lambda j: (j.note("connection") or {}).get("taken_over"), 20,
                           "the takeover to be recorded")
    finally:
        intruder.stop()
    kicked = 0
    while not intruder.events.empty():
        kicked += intruder.events.get_nowait().kind == DISCONNECTED
    fault("session_takeover", 1 + kicked)
    assert "session_taken_over" in read(agent.log)
    status = _status_json(agent)["connection"]
    assert status["taken_over"] >= 1 and status["client_id"] == "dev1", status
    genuine_job(controller, keys, signer, "after-takeover", agent)
    audit(agent, controller, ["after-takeover"])


def test_anonymous_job_documents_claim_nothing(fleet, keys, signer, digits_files):
    """One byte on the job id the controller is about to use, then 3,000 garbage documents:
    none claims a job id, leaves a journal row or a retained status, or costs a disk write;
    the genuine documents run."""
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent()
    controller.wait_online()
    t = controller.topics
    assert controller.send_raw(t.job("dev1", "about-to-use"), b"x", retain=True).wait(10)
    fault("anonymous_job_claim")
    genuine_job(controller, keys, signer, "about-to-use", agent)
    rng = random.Random(SEED)
    unsigned = {k: v for k, v in _forged(controller, keys, signer, "u").items()
                if k != "signature"}
    started_at = time.monotonic()
    handles = []
    for i in range(3000):
        job_id = "garbage-{}".format(i)
        payload = rng.choice([b"x", b"{}", bytes(rng.getrandbits(8) for _ in range(64)),
                              protocol.encode(dict(unsigned, job_id=job_id))])
        handles.append(controller.send_raw(t.job("dev1", job_id), payload, retain=True))
    for h in handles:
        assert h.wait(60)
    counters = controller.diag(timeout=60)["result"]["counters"]
    print("\n3,000 garbage job documents handled in {:.1f} s".format(
        time.monotonic() - started_at))
    fault("garbage_job_document", 3000)
    assert counters["unauthenticated_jobs"] >= 3001, counters
    genuine_job(controller, keys, signer, "after-garbage", agent)
    with agent.journal() as journal:
        assert [r["job_id"] for r in journal.jobs()] == ["about-to-use", "after-garbage"]
    assert not [j for j in controller.job_status if j.startswith("garbage-")]
    audit(agent, controller, ["about-to-use", "after-garbage"])


def _rss_kb(pid):
    with open("/proc/{}/status".format(pid)) as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_junk_block_floods_and_stray_reply_topics(fleet, keys, signer, digits_files):
    """200 junk blocks of 512 KiB (100 MiB): the event queue is bounded by bytes, so the
    daemon's memory stays bounded and comes back down; a command's reply_to naming a job
    status is answered on the controller's reply topic instead; statuses name no absolute
    path of the device."""
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent()
    controller.wait_online()
    t = controller.topics
    before = _rss_kb(agent.proc.pid)
    junk = b"\0" * (512 << 10)
    handles = [controller.send_raw(t.block("dev1", "{:064x}".format(i), 0), junk)
               for i in range(200)]
    peak = before
    for h in handles:
        h.wait(60)
        peak = max(peak, _rss_kb(agent.proc.pid))
    fault("junk_block", len(handles))
    controller.diag(timeout=60)
    after = _rss_kb(agent.proc.pid)
    print("\ndaemon RSS: {} MB before, {} MB peak, {} MB after 100 MiB of junk blocks".format(
        before // 1024, peak // 1024, after // 1024))
    assert peak - before < 80 << 10 and after - before < 48 << 10, (before, peak, after)
    controller.command({"command": "diag", "request_id": "stray",
                        "reply_to": t.job_status("dev1", "forged-status")})
    fault("stray_reply_topic")
    controller.wait_for(lambda: any(r.get("request_id") == "stray" for r in controller.replies),
                        20, "the diag reply on the reply topic")
    assert "forged-status" not in controller.job_status
    genuine_job(controller, keys, signer, "after-junk", agent)
    for messages in controller.job_status.values():
        assert all(agent.state_dir not in json.dumps(m) for m in messages)
    audit(agent, controller, ["after-junk"])
