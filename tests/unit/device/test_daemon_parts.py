"""The daemon's parts used alone, without the daemon: job intake and the job scheduler over a
real journal and a real status publisher. Its MQTT client is never started here, so what would
go out stays in the outbox, where the tests read it."""

import types

import pytest

from agent import platform
from agent.device import config
from agent.device.daemon_state import DaemonState
from agent.device.jobs.end import JobEnding
from agent.device.jobs.intake import JobIntake
from agent.device.jobs.scheduler import JobScheduler
from agent.device.journal.store import Journal
from agent.device.status_publisher import StatusPublisher, status_platform
from agent.wire import protocol
from agent.wire.mqtt import MqttClient
from agent.wire.topics import Topics

SHA = "ab" * 32


@pytest.fixture
def parts(tmp_path):
    cfg = config.load(None, overrides={("device_id",): "dev1", ("state_dir",): str(tmp_path),
                                       ("security", "allow_unsigned"): True})
    journal = Journal(str(tmp_path / "journal.sqlite3"))
    shared = DaemonState()
    host = platform.detect(str(tmp_path / "no-root"))  # a CPU host: onnxruntime
    publisher = StatusPublisher(journal, MqttClient("dev1", "127.0.0.1", 1),
                                Topics(cfg.topic_prefix), "dev1", 1, str(tmp_path),
                                lambda: status_platform(host, "onnxruntime", None),
                                shared.counters)
    stopped, cancelled, started = [], [], []
    ending = JobEnding(shared, publisher, cancelled.append, lambda: None)
    intake = JobIntake(cfg, "dev1", journal, shared, publisher, stopped.append, ending)
    scheduler = JobScheduler(cfg, journal, host, "onnxruntime", None, shared, publisher,
                             started.append, ending.fail, intake.run_cancel_job, lambda: None)
    yield types.SimpleNamespace(cfg=cfg, journal=journal, shared=shared, publisher=publisher,
                                intake=intake, scheduler=scheduler, stopped=stopped,
                                started=started)
    journal.close()


def send(intake, doc):
    doc = dict(doc, protocol=1, device="dev1")
    intake.on_job_doc(doc["job_id"], protocol.encode(doc))


def deploy(job_id, size=100):
    return {"job_id": job_id, "kind": "deploy", "plan": {"precision": "fp32"},
            "artifacts": {"model": {"sha256": SHA, "size": size, "name": "m.onnx"}}}


def outbox_states(journal, job_id):
    topic = Topics("jetson-agent").job_status("dev1", job_id)
    return [protocol.decode("job_status", item.payload)["state"]
            for item in journal.outbox_pending() if item.topic == topic]


def test_intake_queues_a_valid_document_once(parts):
    send(parts.intake, deploy("d1"))
    send(parts.intake, deploy("d1"))  # a replay: answered with its status, never queued again
    assert parts.journal.job("d1")["state"] == "QUEUED"
    assert outbox_states(parts.journal, "d1") == ["QUEUED"]
    assert parts.shared.counters["jobs"] == 1 and parts.publisher.dirty


def test_intake_rejects_a_document_that_fails_validation(parts):
    parts.intake.on_job_doc("bad1", b'{"protocol": 1, "job_id": "bad1", "kind": "deploy"')
    row = parts.journal.job("bad1")
    assert row["state"] == "REJECTED" and row["error"]["code"] == "bad_message"
    assert outbox_states(parts.journal, "bad1") == ["REJECTED"]
    assert parts.shared.counters["rejected_messages"] == 1


def test_a_cancel_job_cancels_a_queued_job(parts):
    send(parts.intake, deploy("d1"))
    send(parts.intake, {"job_id": "c1", "kind": "cancel", "cancel": {"job_id": "d1"}})
    assert parts.journal.job("d1")["state"] == "CANCELED"
    done = parts.journal.job("c1")
    assert done["state"] == "SUCCEEDED" and done["result"] == {"job_id": "d1",
                                                               "state": "CANCELED"}
    send(parts.intake, {"job_id": "c2", "kind": "cancel", "cancel": {"job_id": "nope"}})
    assert parts.journal.job("c2")["error"]["code"] == "unknown_job"
    assert parts.stopped == []  # no worker ran


def test_the_scheduler_checks_the_oldest_job_and_hands_it_to_the_downloads(parts):
    send(parts.intake, deploy("d1"))
    send(parts.intake, deploy("d2"))
    parts.scheduler.schedule()
    run = parts.shared.run
    assert parts.started == [run] and run.job_id == "d1"
    assert run.needed == {"model": (SHA, 100)} and run.details["precision"] == "fp32"
    row = parts.journal.job("d1")
    assert row["state"] == "IN_PROGRESS" and row["stage"] == "checking"
    parts.scheduler.schedule()  # busy: d2 waits
    assert parts.started == [run] and parts.journal.job("d2")["state"] == "QUEUED"


def test_the_scheduler_rejects_an_artifact_over_the_limit_before_any_download(parts):
    send(parts.intake, deploy("big", size=parts.cfg.limits.max_artifact_bytes + 1))
    parts.scheduler.schedule()
    row = parts.journal.job("big")
    assert row["state"] == "REJECTED" and row["error"]["code"] == "bad_argument"
    assert "limits.max_artifact_bytes" in row["error"]["message"]
    assert parts.started == [] and parts.shared.run is None
