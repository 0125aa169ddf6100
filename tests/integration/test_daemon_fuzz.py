"""Thousands of random and mutated payloads at every topic the daemon subscribes to (job
documents, artifact blocks, commands): the daemon keeps serving (a later valid job succeeds),
its earlier state is intact (jobs, versions, the active engine) and its journal is sound."""

import json
import random
import sqlite3
import time

from agent.device.daemon import journal_path
from agent.wire import protocol
from tests.integration.fuzzing import WEIRD_VALUES, mutate_bytes, mutate_doc

N_PAYLOADS = 2500
GATE = {"atol": 0.5, "rtol": 0.5, "check_error_stat": "mean", "min_top1": 0.9}


def special_payloads():
    deep = b"[" * 5000 + b"]" * 5000
    return [b"", b"null", b"[]", b"{}", b"NaN", b'{"job_id": NaN}', b'{"a":1,"a":2}', deep,
            b'{"x": ' + b"1" * 5000 + b"}", b"\xff" * 100, b"{" * 100, b'"\\ud800"',
            b"x" * 40000, json.dumps({"kind": "cancel"}).encode()]


def payloads(rng, base_doc, base_cmd, n):
    specials = special_payloads()
    for i in range(n):
        r = rng.random()
        if i < len(specials):
            yield specials[i]
        elif r < 0.02:
            yield protocol.encode(rng.choice([base_doc, base_cmd, {"command": "diag"}]))
        elif r < 0.25:
            yield bytes(rng.getrandbits(8) for _ in range(rng.randint(0, 200)))
        elif r < 0.5:
            yield mutate_bytes(rng, protocol.encode(rng.choice([base_doc, base_cmd])))
        elif r < 0.85:
            yield json.dumps(mutate_doc(rng, rng.choice([base_doc, base_cmd]))).encode()
        else:
            yield json.dumps(rng.choice(WEIRD_VALUES)).encode()


def snapshot(state_dir):
    db = sqlite3.connect(journal_path(state_dir))
    try:
        jobs = db.execute("SELECT job_id, state, version, result FROM jobs WHERE job_id "
                          "IN ('deploy-ok')").fetchall()
        engines = db.execute("SELECT name, version, state, engine_key FROM models "
                             "ORDER BY name, version").fetchall()
        check = db.execute("PRAGMA integrity_check").fetchone()[0]
    finally:
        db.close()
    return jobs, engines, check


def test_fuzz_every_subscribed_topic(controller, agent_factory, digits_files):
    agent = agent_factory(extra_config="limits:\n  job_timeout_s: 5\n").start()
    controller.wait_online()
    artifacts = {role: controller.add_artifact(p) for role, p in digits_files.items()}
    good = {"job_id": "deploy-ok", "kind": "deploy", "artifacts": artifacts,
            "plan": {"precision": "int8", "calibration": {"algorithm": "minmax"}},
            "gate": GATE, "bench": {"iterations": 20, "warmup": 2}}
    controller.send_job(good)
    assert controller.wait_state("deploy-ok", protocol.TERMINAL_STATES, 120)["state"] == \
        "SUCCEEDED"
    before = snapshot(agent.state_dir)
    assert before[2] == "ok" and before[1]

    rng = random.Random(1234)
    base_doc = dict(good, protocol=1, device="dev1", job_id="fz")
    # Documents that happen to be valid name an artifact nobody serves: they would wait for
    # it (bounded by the job timeout); the test cancels whatever is left afterwards.
    base_doc["artifacts"] = {"model": {"sha256": "f" * 64, "size": 1000}}
    base_cmd = {"protocol": 1, "command": "cancel", "request_id": "r1", "job_id": "deploy-ok"}
    t = controller.topics
    shas = [a["sha256"] for a in artifacts.values()] + ["f" * 64, "0" * 64]
    started = time.monotonic()
    handles = []
    for i, payload in enumerate(payloads(rng, base_doc, base_cmd, N_PAYLOADS)):
        kind = i % 4
        if kind == 0:
            job_id = rng.choice(["deploy-ok", "fz-{}".format(i), "fz-{}".format(i % 50)])
            topic = t.job("dev1", job_id)
        elif kind == 1:
            topic = t.block("dev1", rng.choice(shas), rng.randint(0, 3))
        elif kind == 2:
            topic = t.commands("dev1")
        else:
            topic = t.job("dev1", "fz-{}".format(i))
            if payload.startswith(b'{"artifacts"'):  # an intact document: give it its topic
                payload = payload.replace(b'"job_id":"fz"', '"job_id":"fz-{}"'.format(i).encode())
        handles.append(controller.send_raw(topic, payload, qos=rng.choice([0, 1])))
    for h in handles:
        h.wait(30)
    sent_in = time.monotonic() - started
    assert sent_in < 30

    # The daemon still answers, and its earlier state is untouched.
    diag = controller.diag(timeout=60)
    assert diag["ok"], diag
    assert agent.alive(), agent.log_tail()
    with agent.journal() as journal:
        leftovers = [r["job_id"] for r in journal.unfinished_jobs()]
        assert any(r["job_id"].startswith("fz-") and r["kind"] == "deploy"
                   for r in journal.jobs())  # some fuzz documents were valid jobs
    for job_id in leftovers:
        controller.command({"command": "cancel", "job_id": job_id})
    controller.send_job(dict(good, job_id="deploy-after"))
    msg = controller.wait_state("deploy-after", protocol.TERMINAL_STATES, 120)
    assert msg["state"] == "SUCCEEDED", (msg, agent.log_tail())
    after = snapshot(agent.state_dir)
    assert after[0] == before[0]  # the earlier job: same state, version and result
    assert after[2] == "ok"
    assert {e[2] for e in after[1]} == {e[2] for e in before[1]}  # same engine (a cache hit)
    assert "Traceback" not in agent.log_tail(200000)
    assert agent.stop() == 0
