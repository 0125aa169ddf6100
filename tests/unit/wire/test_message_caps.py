"""Every message the agent builds fits its topic's limit by construction (issue: a 2 MB error
message, or a gate failure listing 30,000 outputs, wedged the device's connection)."""

import pytest

from agent.device.journal.store import Journal
from agent.errors import AgentError
from agent.wire import message_caps as caps
from agent.wire import protocol, status_messages
from agent.wire.topics import Topics, reply_topic

T = Topics()
NAMES = ["output_{}".format(i) for i in range(30000)]


def rows():
    yield {"job_id": "huge-name", "kind": "deploy", "state": "REJECTED", "version": 3,
           "updated": 1.0, "details": {"k" * 500: "v" * 5000, "stage": "checking"},
           "error": {"code": "bad_golden", "message": "output {} missing".format("x" * 2000000)}}
    yield {"job_id": "gate", "kind": "deploy", "state": "FAILED", "version": 9, "updated": 2.0,
           "error": {"code": "accuracy_gate_failed",
                     "message": "output(s) {} outside atol/rtol".format(NAMES),
                     "details": {"accuracy": {"failed_outputs": NAMES, "per_output": {
                         n: {"max_abs_error": 1.0, "values": list(range(20))} for n in NAMES}}}}}
    yield {"job_id": "result", "kind": "search", "state": "SUCCEEDED", "version": 4,
           "updated": 3.0, "result": {"layers_kept": {n: "fp32" for n in NAMES},
                                      "precision": "int8"}}
    yield {"job_id": "many-details", "kind": "bench", "state": "IN_PROGRESS", "version": 2,
           "updated": 4.0, "details": {"d{}".format(i): "x" * 2000 for i in range(500)}}


@pytest.mark.parametrize("row", list(rows()), ids=lambda r: r["job_id"])
def test_job_statuses_fit_by_construction(row):
    pub = status_messages.job_status_publication(T, "dev1", row)
    assert len(pub.payload) <= protocol.MAX_BYTES["job_status"] - caps.ENVELOPE
    msg = protocol.decode("job_status", pub.payload)  # valid for the controller too
    assert (msg["job_id"], msg["state"], msg["version"]) == (row["job_id"], row["state"],
                                                             row["version"])
    if row.get("error"):
        assert msg["error"]["code"] == row["error"]["code"]
    if row["job_id"] == "huge-name":
        assert "more characters cut]" in msg["error"]["message"]
    if row["job_id"] == "gate":
        failed = msg["error"]["details"]["accuracy"]["failed_outputs"]
        assert failed[-1].startswith("[... ") and "more items]" in failed[-1]


def test_small_messages_are_untouched():
    row = {"job_id": "j", "kind": "deploy", "state": "FAILED", "version": 2, "updated": 1.0,
           "error": {"code": "disk_full", "message": "no room", "details": {"free": 1}}}
    msg = status_messages.job_status_message("dev1", row)
    assert msg["error"] == row["error"]
    assert caps.cut_text("short", 10) == "short"
    cut = caps.cut_text("x" * 1000, 100)
    assert len(cut) <= 100 and cut.endswith("more characters cut]")


def test_the_outbox_never_stores_an_oversized_message(tmp_path):
    with Journal(str(tmp_path / "j.sqlite3")) as journal:
        big = protocol.encode({"protocol": 1, "job_id": "j1", "device": "dev1",
                               "kind": "deploy", "state": "FAILED", "version": 2,
                               "statusDetails": {},
                               "error": {"code": "internal_error", "message": "x" * 200000}})
        seq = journal.outbox_put(T.job_status("dev1", "j1"), big, retain=True)
        (item,) = journal.outbox_pending()
        assert item.seq == seq and len(item.payload) < 2048  # its short form
        short = protocol.decode("job_status", item.payload)
        assert short["error"]["code"] == "internal_error" and short["statusDetails"] == {
            "truncated": "true", "error_code": "internal_error"}
        with pytest.raises(AgentError) as exc:  # not a job status: refused, nothing stored
            journal.outbox_put("some/topic", b"y" * 100000)
        assert exc.value.code == "message_too_large" and journal.outbox_count() == 1
        assert journal.outbox_replace(seq, b'{"job_id":"j1"}') and \
            journal.outbox_pending()[0].payload == b'{"job_id":"j1"}'


def test_paths_under_the_state_dir_become_relative():
    value = {"message": "cannot read /var/lib/jetson-agent/work/j1/job.json",
             "details": {"paths": ["/var/lib/jetson-agent/artifacts/ab/abc", "/etc/x"]}}
    out = caps.relative_paths(value, "/var/lib/jetson-agent/")
    assert out == {"message": "cannot read work/j1/job.json",
                   "details": {"paths": ["artifacts/ab/abc", "/etc/x"]}}


def test_reply_topics_are_the_controllers_only():
    cmd = {"command": "diag", "reply_to": T.command_reply("dev1") + "/r-1"}
    assert reply_topic(T, "dev1", cmd) == T.command_reply("dev1") + "/r-1"
    for topic in (T.job_status("dev1", "j1"), T.status("dev2"), "ctl/replies"):
        with pytest.raises(AgentError):
            reply_topic(T, "dev1", {"command": "diag", "reply_to": topic})


def test_every_other_message_the_daemon_publishes_fits_too():
    engines = [{"model": "{:064x}".format(i), "engine_key": "k" * 200, "precision": "int8",
                "activated": 1.0, "job_id": "j{}".format(i)} for i in range(3000)]
    birth = status_messages.status_message("dev1", True, 3, agent_version="1",
                                           active_engines=engines)
    reply = status_messages.command_reply("dev1", {"command": "diag", "request_id": "r1"}, True,
                                          result={"transfers": [{"sha256": "a" * 64, "size": i}
                                                                for i in range(50000)],
                                                  "log": "y" * 500000})
    telemetry = {"protocol": 1, "device": "dev1", "ts": 1.0, "source": "host",
                 "metrics": {"m{}".format(i): float(i) for i in range(5000)}}
    for kind, msg in (("status", birth), ("command_reply", reply), ("telemetry", telemetry)):
        payload = caps.encode_fitted(kind, msg)
        assert len(payload) <= protocol.MAX_BYTES[kind], kind
        decoded = protocol.decode(kind, payload)
        assert decoded["device"] == "dev1"
    small = status_messages.command_reply("dev1", {"command": "diag"}, True, result={"a": 1})
    assert caps.encode_fitted("command_reply", small) == protocol.encode(small)
