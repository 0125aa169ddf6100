"""The daemon's parts used alone against a real Mosquitto, without the daemon: the status
publisher (a real journal's outbox out, deleted on PUBACK; birth and offline status) and the
device commands (a diag answered), each driven by the test in place of the main loop."""

import functools
import queue
import time
import types

import pytest

from agent import platform
from agent.device import config
from agent.device.daemon_state import DaemonState
from agent.device.device_commands import DeviceCommands
from agent.device.journal.store import Journal
from agent.device.status_publisher import StatusPublisher, status_platform
from agent.device.telemetry_publisher import TelemetryPublisher
from agent.errors import AgentError
from agent.wire.mqtt import MESSAGE, PUBLISHED, MqttClient
from agent.wire.topics import Topics


@pytest.fixture
def device(mosquitto, tmp_path):
    """A connected device client, a real journal, and the publisher over them."""
    events = queue.Queue()
    mqtt = MqttClient("dev1", mosquitto.host, mosquitto.port, reconnect_min=0.2,
                      reconnect_max=1.0, events=events)
    topics = Topics()
    for topic, qos in topics.device_subscriptions("dev1"):
        mqtt.subscribe(topic, qos)
    mqtt.start()
    mqtt.wait_connected(10)
    journal = Journal(str(tmp_path / "journal.sqlite3"))
    shared = DaemonState()
    host = platform.detect(str(tmp_path / "no-root"))
    ended = []
    publisher = StatusPublisher(journal, mqtt, topics, "dev1", 7, str(tmp_path),
                                functools.partial(status_platform, host, "onnxruntime", None),
                                shared.counters, on_job_end=lambda: ended.append(True))
    yield types.SimpleNamespace(events=events, mqtt=mqtt, topics=topics, journal=journal,
                                shared=shared, host=host, publisher=publisher, ended=ended)
    mqtt.stop()
    journal.close()


def pump(device, until, timeout=10.0, on_message=None):
    """The main loop's part in this: hand PUBLISHED events to the publisher (and MESSAGE
    events to ``on_message``) until ``until()``."""
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, "timed out"
        try:
            ev = device.events.get(timeout=0.1)
        except queue.Empty:
            continue
        if ev.kind == PUBLISHED:
            device.publisher.on_published(ev)
        elif ev.kind == MESSAGE and on_message is not None:
            on_message(ev)
        device.publisher.flush()


def test_the_publisher_sends_the_outbox_and_forgets_what_the_broker_acked(device, controller):
    pub, journal = device.publisher, device.journal
    pub.publish_birth()
    birth = controller.wait_online("dev1")
    assert birth["boot"] == 7 and birth["platform"]["backend"] == "onnxruntime"
    journal.add_job({"job_id": "j1", "kind": "deploy"}, emit=pub.emit)
    pub.outbox_changed()
    pub.set_state("j1", "IN_PROGRESS", stage="checking")
    assert device.ended == []
    pub.set_state("j1", "FAILED", error=AgentError("worker_crashed", "the worker died").to_dict())
    assert device.ended == [True]  # a terminal state: the job's end hook ran once
    assert journal.outbox_count() >= 1
    pump(device, lambda: journal.outbox_count() == 0)  # each entry deleted on its PUBACK
    final = controller.wait_state("j1", "FAILED", 10)
    assert final["error"]["code"] == "worker_crashed" and not pub.inflight
    handle = pub.publish_offline()
    assert handle.wait(10)
    offline = controller.wait_for(
        lambda: next((s for s in controller.device_status if not s["online"]), None), 10,
        "offline status")
    assert offline["reason"] == "shutdown"


def test_device_commands_answer_a_diag_through_the_broker(device, controller, tmp_path):
    cfg = config.load(None, overrides={("device_id",): "dev1", ("state_dir",): str(tmp_path)})
    telemetry = TelemetryPublisher(None, 30.0, device.mqtt, device.topics, "dev1", 7)
    cancels = []

    def cancel(job_id):
        cancels.append(job_id)
        return "CANCELED"

    commands = DeviceCommands(cfg, "dev1", device.topics, device.mqtt, device.journal,
                              device.host, device.shared, device.publisher, telemetry, cancel)
    device.publisher.publish_birth()
    controller.wait_online("dev1")
    controller.command({"command": "diag", "request_id": "r1"})
    controller.command({"command": "cancel", "request_id": "r2", "job_id": "j9"})

    def replied():
        return {r.get("request_id") for r in controller.replies} >= {"r1", "r2"}

    pump(device, replied, on_message=commands.on_command)
    replies = {r["request_id"]: r for r in controller.replies}
    diag = replies["r1"]["result"]
    assert replies["r1"]["ok"] and diag["boot"] == 7 and diag["current_job"] is None
    assert diag["platform"]["kind"] == "host" and diag["outbox"] == 0
    assert replies["r2"]["result"] == {"job_id": "j9", "state": "CANCELED"}
    assert cancels == ["j9"]
