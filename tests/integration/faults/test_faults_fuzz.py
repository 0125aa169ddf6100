"""The fault suite (``suite.py``): hostile bytes. Thousands of fuzzed payloads on each topic
the daemon subscribes to, and tampered blocks during a transfer."""

import collections
import json
import os
import random
import sqlite3

from agent.device.daemon import journal_path
from agent.wire import protocol
from tests.integration.faults.suite import (
    FUZZ_PER_TOPIC,
    SEED,
    SMALL_BLOCKS,
    _sent,
    audit,
    calib_file,
    deploy_doc,
    fault,
    submit,
)
from tests.integration.fuzzing import WEIRD_VALUES, mutate_bytes, mutate_doc

# ---------------------------------------------------------------------------- fuzz

# The shared odd values without the two the signed-job fuzz never drew, plus signature-shaped
# ones (the same list, in the same order, as before it was shared: a seed replays a run).
WEIRD = [v for v in WEIRD_VALUES if v not in (-1e308, {"a": {"b": {"c": []}}})] + [
    "ed25519", "AAAA=="]


def _mutate_bytes(rng, data):
    return mutate_bytes(rng, data, max_edits=6)


def _mutate_doc(rng, doc):
    return mutate_doc(rng, doc, weird=WEIRD, extra_keys=("extra", "signature", "kind", "seq"),
                      p_drop=0.08, p_replace=0.12, p_add=0.05)


def _payloads(rng, bases, n):
    specials = [b"", b"null", b"[]", b"{}", b"NaN", b'{"a":1,"a":2}', b"[" * 5000,
                b"\xff" * 64, b"x" * 40000, b'{"signature": {}}']
    for i in range(n):
        r = rng.random()
        if i < len(specials):
            yield specials[i]
        elif r < 0.02:
            yield protocol.encode(rng.choice(bases))
        elif r < 0.2:
            yield bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 300)))
        elif r < 0.5:
            yield _mutate_bytes(rng, protocol.encode(rng.choice(bases)))
        elif r < 0.9:
            yield json.dumps(_mutate_doc(rng, rng.choice(bases))).encode()
        else:
            yield json.dumps(rng.choice(WEIRD)).encode()


def _altered(rng, signed, job_id):
    """A schema-valid copy of a signed document with its signature kept and something the
    signature covers changed (a forgery only the signature check can catch)."""
    doc = json.loads(json.dumps(signed))
    doc["job_id"] = job_id
    change = rng.randrange(6)
    if change == 0:
        doc["plan"]["precision"] = rng.choice(["fp32", "fp16", "best"])
    elif change == 1:
        doc["artifacts"]["model"]["size"] = rng.randint(1, 1 << 30)
    elif change == 2:
        doc["gate"]["atol"] = rng.random()
    elif change == 3:
        doc["bench"] = {"iterations": rng.randint(1, 1000000)}
    elif change == 4:
        doc["signature"]["seq"] = rng.randint(1, 1 << 50)
    return doc  # change 5: only the job id (and the topic) differ


def test_fuzz_every_subscribed_topic(fleet, digits_files):
    controller, make_agent = fleet
    agent = make_agent()
    controller.wait_online()
    submit(controller, deploy_doc(controller, digits_files, "before-fuzz"))
    assert controller.wait_state("before-fuzz", protocol.TERMINAL_STATES, 90)["state"] == \
        "SUCCEEDED"
    with agent.journal() as journal:
        before = journal.job("before-fuzz")
    rng = random.Random(SEED)
    t = controller.topics
    # A correctly signed document (which may run: it is genuine) and its unsigned twin.
    signed = controller.signer.sign(dict(deploy_doc(controller, digits_files, "fz-signed"),
                                         protocol=1, device="dev1"))
    unsigned = dict(signed)
    unsigned.pop("signature")
    command = {"protocol": 1, "command": "cancel", "request_id": "r1", "job_id": "before-fuzz"}
    shas = [a["sha256"] for a in signed["artifacts"].values()] + ["f" * 64]
    handles, job_ids = [], set()
    for topic_kind in ("job", "block", "command"):
        bases = [signed, unsigned] if topic_kind != "command" else [command, {"command": "diag"}]
        for i, payload in enumerate(_payloads(rng, bases, FUZZ_PER_TOPIC)):
            if topic_kind == "job":
                job_id = rng.choice(["fz-signed", "before-fuzz", "fz-{}".format(i),
                                     "fz-{}".format(i % 40)])
                job_ids.add(job_id)
                topic = t.job("dev1", job_id)
                if rng.random() < 0.25:
                    payload = protocol.encode(_altered(rng, signed, job_id))
            elif topic_kind == "block":
                topic = t.block("dev1", rng.choice(shas), rng.choice([0, 1, 2, 9999, 1048575]))
            else:
                topic = t.commands("dev1")
            handles.append(controller.send_raw(topic, payload, qos=rng.choice([0, 1])))
        fault("fuzzed_payload_" + topic_kind, FUZZ_PER_TOPIC)
    for h in handles:
        h.wait(60)
    diag = controller.diag(timeout=120)
    assert diag["ok"] and agent.alive(), agent.log_tail()
    with agent.journal() as journal:
        rows = [journal.job(j) for j in sorted(job_ids - {"before-fuzz"})]
        after = journal.job("before-fuzz")
    ran = sorted(r["job_id"] for r in rows if r is not None and r["state"] != "REJECTED")
    assert set(ran) <= {"fz-signed"}, ran  # nothing but the genuine document ran
    codes = collections.Counter((r["error"] or {}).get("code") for r in rows
                                if r is not None and r["state"] == "REJECTED")
    ignored = diag["result"]["counters"]["unauthenticated_jobs"]
    print("\nfuzz: {} payloads; job documents ignored as unauthenticated: {}; recorded "
          "REJECTED: {}".format(3 * FUZZ_PER_TOPIC, ignored, dict(codes)))
    # Signing is required: no fuzzed document proves a trusted origin, so none claims a job
    # id or leaves a journal row; each is counted instead.
    assert not codes, codes
    assert ignored >= FUZZ_PER_TOPIC // 4, ignored  # the rest named a known job id
    assert (after["state"], after["version"], after["result"]) == \
        (before["state"], before["version"], before["result"])
    submit(controller, deploy_doc(controller, digits_files, "after-fuzz"))
    assert controller.wait_state("after-fuzz", protocol.TERMINAL_STATES, 90)["state"] == \
        "SUCCEEDED", agent.log_tail()
    db = sqlite3.connect(journal_path(agent.state_dir))
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()
    result = audit(agent, controller, ["before-fuzz", "after-fuzz"] + ran)
    assert not result["lost"] and not result["corrupt"], result


# ---------------------------------------------------------------------------- tampered blocks

def test_tampered_blocks(fleet, digits_files, tmp_path):
    controller, make_agent = fleet
    agent = make_agent(extra_config=SMALL_BLOCKS)
    calib = calib_file(tmp_path, 2000)
    tampered = tmp_path / "tampered.npz"
    data = bytearray(open(calib, "rb").read())
    for i in range(0, len(data), 997):
        data[i] ^= 0xFF  # same length, other bytes
    tampered.write_bytes(bytes(data))
    doc = deploy_doc(controller, digits_files, "tampered", calib=calib)
    real = doc["artifacts"]["calibration"]
    controller.server.add_file(str(tampered), sha256=real["sha256"])  # served under its sha
    submit(controller, doc)
    fault("tampered_artifact")
    msg = controller.wait_state("tampered", protocol.TERMINAL_STATES, 60)
    assert msg["state"] == "FAILED" and msg["error"]["code"] == "hash_mismatch", msg
    sha = real["sha256"]
    assert not os.path.exists(os.path.join(agent.state_dir, "artifacts", sha[:2], sha))
    assert not os.path.exists(os.path.join(agent.state_dir, "artifacts", "partial",
                                           sha + ".part"))
    # The honest file again, and junk blocks thrown at the transfer while it runs.
    controller.served_limit = _sent(controller) + 20
    submit(controller, deploy_doc(controller, digits_files, "honest", calib=calib))
    controller.wait_for(lambda: not controller.serve, 30, "the transfer to start")
    t = controller.topics
    junk = 0
    for i in range(60):
        for topic, payload in ((t.block("dev1", sha, i), b"short"),  # wrong length
                               (t.block("dev1", sha, 10 ** 6), b"\0" * 1024),  # no such block
                               (t.block("dev1", "e" * 64, i), b"\0" * 1024),  # not fetched
                               (t.block("dev1", sha, i), b"\0" * 4096)):  # too long
            controller.send_raw(topic, payload)
            junk += 1
    fault("junk_block", junk)
    controller.served_limit = None
    controller.serve = True
    msg = controller.wait_state("honest", protocol.TERMINAL_STATES, 90)
    assert msg["state"] == "SUCCEEDED", (msg, agent.log_tail())
    result = audit(agent, controller, ["tampered", "honest"])
    assert not result["lost"] and not result["corrupt"], result
