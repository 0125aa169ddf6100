"""Interruptions: the broker killed mid-transfer and while statuses are pending, the agent
SIGKILLed mid-download and mid-job, the same job id sent twice. Jobs complete (or end FAILED
with a reason), no block is downloaded twice beyond what was in flight, no corrupt file enters
the store or the cache, and no status is lost (the outbox drains to zero)."""

import os
import time

from agent.engines.cache import EngineCache
from agent.wire import protocol

# Small blocks and a small window: the transfer spans many requests, so it can be cut.
SMALL_BLOCKS = "transfer:\n  block_size: 1024\n  window: 8\n  timeout_s: 2\n"
GATE = {"atol": 0.5, "rtol": 0.5, "check_error_stat": "mean", "min_top1": 0.9}


def deploy_doc(controller, files, job_id, bench_iterations=50):
    return {"job_id": job_id, "kind": "deploy",
            "artifacts": {role: controller.add_artifact(path) for role, path in files.items()},
            "plan": {"precision": "int8",
                     "calibration": {"algorithm": "minmax", "batch_size": 64}},
            "gate": GATE, "bench": {"iterations": bench_iterations, "warmup": 5}}


def total_blocks(doc, block_size=1024):
    return sum(protocol.block_count(a["size"], block_size) for a in doc["artifacts"].values())


def sent(controller):
    with controller.lock:
        return sum(controller.blocks_sent.values())


def assert_sound(agent):
    """Every stored artifact matches its hash; every cache entry verifies; outbox empty."""
    agent.assert_store_sound()
    report = EngineCache(os.path.join(agent.state_dir, "engines")).verify()
    assert report["checked"] >= 1 and not report["corrupt"], report


def test_broker_killed_mid_transfer_and_with_statuses_pending(mosquitto, controller,
                                                              agent_factory, digits_files):
    agent = agent_factory(extra_config=SMALL_BLOCKS).start()
    doc = deploy_doc(controller, digits_files, "cut-broker", bench_iterations=3000)
    blocks = total_blocks(doc)
    controller.served_limit = blocks // 3  # stop answering a third of the way in
    controller.send_job(doc)
    controller.wait_for(lambda: sent(controller) >= blocks // 3, 30, "a third of the blocks")
    time.sleep(0.5)
    mosquitto.stop()  # killed (SIGKILL) mid-transfer
    time.sleep(1.0)
    mosquitto.start()
    controller.served_limit = None
    controller.serve = True
    controller.client.wait_connected(15)
    controller.send_job(doc)  # the broker lost the retained document: a duplicate, ignored
    # Once the worker runs, cut the broker again and keep it down until the job has ended:
    # its final statuses must wait in the outbox and arrive after the restart.
    agent.wait_journal(lambda j: (j.job("cut-broker") or {}).get("stage") in (
        "checking", "calibrating", "building", "verifying", "benchmarking", "activating")
        or protocol.is_terminal((j.job("cut-broker") or {}).get("state", "QUEUED")),
        60, "the worker stages")
    mosquitto.stop()
    row = agent.wait_journal(lambda j: protocol.is_terminal(j.job("cut-broker")["state"])
                       and j.job("cut-broker"), 90, "the job to end")
    with agent.journal() as journal:
        pending = journal.outbox_count()
    assert pending >= 1  # the final status waits for the broker
    mosquitto.start()
    final = controller.wait_state("cut-broker", protocol.TERMINAL_STATES, timeout=60)
    assert final["state"] == "SUCCEEDED", (final, agent.log_tail())
    assert final["version"] == row["version"]
    agent.wait_journal(lambda j: j.outbox_count() == 0, 30, "the outbox to drain")
    # Blocks re-sent: only those in flight when the broker died (at most a window or two).
    duplicates = sum(n - 1 for n in controller.blocks_sent.values())
    assert len(controller.blocks_sent) == blocks
    assert duplicates <= 2 * 8, duplicates
    assert agent.stop() == 0
    assert_sound(agent)


def test_agent_sigkilled_mid_download_and_mid_job(controller, agent_factory, digits_files):
    agent = agent_factory(extra_config=SMALL_BLOCKS).start()
    doc = deploy_doc(controller, digits_files, "cut-agent", bench_iterations=5000)
    blocks = total_blocks(doc)
    controller.served_limit = blocks // 2
    controller.send_job(doc)
    controller.wait_for(lambda: sent(controller) >= blocks // 2, 30, "half of the blocks")
    time.sleep(1.5)  # the device persists its bitmap about every half second
    agent.kill()
    controller.serve = True
    controller.served_limit = None
    agent.start()
    # mid-job: the worker is benchmarking (5000 iterations over 540 rows take seconds)
    agent.wait_journal(lambda j: j.job("cut-agent")["stage"] == "benchmarking", 90,
                 "benchmarking")
    agent.kill()
    with agent.journal() as journal:
        row = journal.job("cut-agent")
    assert row["state"] == "IN_PROGRESS" and row["details"].get("worker") == "started"
    agent.start()
    final = controller.wait_state("cut-agent", protocol.TERMINAL_STATES, timeout=120)
    assert final["state"] == "SUCCEEDED", (final, agent.log_tail())
    assert final["statusDetails"]["attempt"] == "2"
    assert final["result"]["cache_hit"] is True  # the first worker's engine was published
    # Nothing downloaded twice but what was in flight at the kill.
    duplicates = sum(n - 1 for n in controller.blocks_sent.values())
    assert len(controller.blocks_sent) == blocks
    assert duplicates <= 8, duplicates
    agent.wait_journal(lambda j: j.outbox_count() == 0, 30, "the outbox to drain")
    assert agent.stop() == 0
    assert_sound(agent)


def test_job_interrupted_twice_fails_with_a_reason(controller, agent_factory, digits_files):
    agent = agent_factory().start()
    doc = deploy_doc(controller, digits_files, "cut-twice", bench_iterations=200000)
    controller.send_job(doc)
    for attempt in (1, 2):
        agent.wait_journal(lambda j, attempt=attempt: j.job("cut-twice") is not None
                     and j.job("cut-twice")["stage"] == "benchmarking"
                     and j.job("cut-twice")["attempts"] == attempt, 90,
                     "benchmarking, attempt {}".format(attempt))
        agent.kill()
        agent.start()
    final = controller.wait_state("cut-twice", protocol.TERMINAL_STATES, timeout=60)
    assert final["state"] == "FAILED"
    assert final["error"]["code"] == "worker_crashed"
    assert "2 times" in final["error"]["message"]
    # The agent carries on: the next job runs.
    doc2 = deploy_doc(controller, digits_files, "after-twice")
    controller.send_job(doc2)
    assert controller.wait_state("after-twice", protocol.TERMINAL_STATES, 90)["state"] == \
        "SUCCEEDED"


def test_same_job_id_twice_runs_once(controller, agent_factory, digits_files):
    agent = agent_factory().start()
    doc = deploy_doc(controller, digits_files, "twice")
    controller.send_job(doc)
    controller.send_job(doc, retain=False)
    first = controller.wait_state("twice", protocol.TERMINAL_STATES, timeout=90)
    assert first["state"] == "SUCCEEDED"
    # A resend after the end, and a different document under the same id: still once.
    controller.send_job(dict(doc, plan={"precision": "fp32"}))
    time.sleep(1.5)
    with agent.journal() as journal:
        row = journal.job("twice")
        assert row["attempts"] == 1
        assert row["state"] == "SUCCEEDED"
    assert controller.last_status("twice")["version"] == first["version"]
    assert agent.log_tail(20000).count("worker ") <= 3  # started + exited, once
    with agent.journal() as journal:
        assert len(journal.jobs()) == 1
