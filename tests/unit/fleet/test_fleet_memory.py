"""What a fleet service holds per device, and how it paces a large stage (issue 26):
a finished run keeps its seldom read fields as one JSON text until they are read again
(agent/fleet/rollouts/device_run.py ``freeze``), saving and loading freeze finished runs
(agent/fleet/rollouts/durable.py), a new stage's untouched jobs are not read back, admission
holds its rows without empty columns, documents wait for their devices' answers
(agent/fleet/rollouts/streaming.py ``Unanswered``), and a publish handle makes its event only
for a caller that waits (agent/wire/mqtt_types.py)."""

import threading

import pytest

from agent import fleet
from agent.fleet.admission import admission
from agent.fleet.database.store import Store
from agent.fleet.rollouts import durable, streaming
from agent.fleet.rollouts.device_run import FROZEN_FIELDS, PENDING, DeviceRun
from agent.fleet.rollouts.rollout import Rollout
from agent.wire.mqtt_types import PublishHandle
from agent.wire.topics import Topics

ARTIFACTS = {"model": {"sha256": "a" * 64, "size": 10, "name": "m.onnx"}}


def docs(device, job_id, kind, layers):
    return fleet.job_document(job_id, kind, device, ARTIFACTS, {"precision": "fp16"},
                              created=1.0)


def status(device, state, version, result=None):
    msg = {"protocol": 1, "job_id": "r1", "device": device, "kind": "deploy", "state": state,
           "version": version, "statusDetails": {}}
    if result is not None:
        msg["result"] = result
    return msg


@pytest.fixture
def store(tmp_path):
    s = Store("sqlite:///" + str(tmp_path / "fleet.db"))
    yield s
    s.close()


def test_a_new_run_holds_no_containers_until_one_is_read():
    run = DeviceRun("d1", 0)
    assert run._frozen == b"{}"
    assert run.versions == {} and run.published == [] and run.result is None
    assert run._frozen is None  # read: thawed, with each field's empty value
    run.versions["r1"] = 2
    assert run.to_dict()["versions"] == {"r1": 2}


def test_a_frozen_run_gives_back_exactly_what_it_held():
    run = DeviceRun("d1", 0)
    run.state, run.job_id = "SUCCEEDED", "r1"
    run.result = {"precision": "fp16", "latency_ms": {"median": 1.5}}
    run.versions, run.kinds, run.sent_layers = {"r1": 3}, {"r1": "deploy"}, {"conv": "float32"}
    before = run.to_dict()
    run.freeze()
    assert run._frozen is not None and len(run._frozen) < 200
    assert run.state == "SUCCEEDED"  # the scalar fields stay as they are
    assert run.to_dict() == before
    run.freeze()
    run.freeze()  # twice: once frozen it stays so
    assert run.to_dict() == before


def test_a_field_set_while_frozen_is_kept_when_the_rest_comes_back():
    run = DeviceRun("d1", 0)
    run.versions = {"r1": 3}
    run.freeze()
    run.result = {"new": True}  # set, not read: newer than the frozen text
    assert run.versions == {"r1": 3} and run.result == {"new": True}


def test_save_freezes_finished_runs_and_load_gives_them_back(store):
    stage = ["d{}".format(i) for i in range(5)]
    store.insert_rollout("r1", {"precision": "fp16", "artifacts": ARTIFACTS}, [stage],
                         deadline=0)
    ro = Rollout("r1", [stage], docs)
    ro.start()
    durable.save(store, ro, [])
    actions = ro.on_job_status("d0", status("d0", "SUCCEEDED", 2, {"throughput_qps": 5.0}))
    actions += ro.on_job_status("d1", status("d1", "IN_PROGRESS", 2))
    durable.save(store, ro, durable.messages(Topics(), ro, actions))  # the clear of d0's doc
    assert ro.runs["d0"]._frozen is not None  # finished, nothing left at the broker
    assert ro.runs["d1"]._frozen is None  # still running: its document may be sent again
    assert ro.runs["d0"].result == {"throughput_qps": 5.0}
    again = durable.load(store, "r1", docs)  # as a service takes it over
    frozen = again.runs["d0"]
    assert frozen._frozen is not None and frozen.state == "SUCCEEDED"
    assert frozen.__slots__ and all(not _set(frozen, k) for k in FROZEN_FIELDS)
    assert frozen.result == {"throughput_qps": 5.0}
    assert again.runs["d1"].state == "IN_PROGRESS" and again.runs["d1"].docs
    assert durable.republish(Topics(), again)  # d1's document; no PENDING run thawed
    assert all(not _set(r, "published") for r in again.runs.values() if r.state == PENDING)
    view = durable.load(store, "r1")  # a read-only view (reloaded often): not frozen
    assert _set(view.runs["d0"], "result") and view.runs["d0"].result == {"throughput_qps": 5.0}


def _set(run, name):
    try:
        object.__getattribute__(run, name)
        return True
    except AttributeError:
        return False


def test_a_new_stage_reads_no_job_rows_back(store):
    stage = ["d{}".format(i) for i in range(50)]
    store.insert_rollout("r1", {"precision": "fp16", "artifacts": ARTIFACTS}, [stage],
                         deadline=0)
    assert list(store.rollout_job_states("r1")) == []  # all PENDING, nothing saved
    ro = durable.load(store, "r1")
    assert ro is not None and all(r.state == PENDING for r in ro.runs.values())


def test_admission_holds_its_rows_without_empty_columns(store):
    gate = admission.Admission(store, "manual", {})
    gate._pin("d1", b"k" * 32, "test")
    row = gate.rows["d1"]
    assert row["state"] == "admitted" and row.get("pending_key_id") is None
    assert "pending_key_id" not in row and "pending_status" not in row
    gate.refresh(force=True)
    assert "pending_status" not in gate.rows["d1"] and gate.rows["d1"]["state"] == "admitted"
    assert store.device_keys()["d1"]["pending_status"] is None  # the table is unchanged


def test_documents_wait_for_answers_and_silent_devices_stop_counting():
    waiting = streaming.Unanswered(window_s=10.0)
    for i in range(5):
        waiting.sent("d{}".format(i), "r1", now=100.0)
    assert waiting.quota(100.0, max_unanswered=8) == 3
    waiting.answered("d0", "r1")
    waiting.answered("d0", "r1")  # a second status of the same device: nothing more
    waiting.answered("x", "r1")  # not one we sent
    assert waiting.quota(100.0, max_unanswered=8) == 4
    waiting.sent("d9", "r1", now=105.0)
    assert waiting.count(109.0) == 5
    assert waiting.count(110.5) == 1  # the silent ones sent at 100 s are out of the window
    assert waiting.quota(120.0, max_unanswered=8) == 8


def test_a_publish_handle_wakes_a_waiter_and_answers_one_that_comes_late():
    handle = PublishHandle("t", None)
    assert not handle.acked and not handle.wait(0.01)
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(handle.wait(10)))
    waiter.start()
    handle._finish(True, "Success")
    waiter.join(10)
    assert woke == [True] and handle.acked and handle.ok
    assert handle.wait(0)  # after the acknowledgement: at once


def test_frozen_fields_are_the_container_fields():
    run = DeviceRun("d1", 0)
    run.freeze()
    for name in FROZEN_FIELDS:
        getattr(run, name)
    assert run._frozen is None
