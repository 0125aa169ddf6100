"""A session takeover is surfaced: MQTT 5 DISCONNECT 0x8E ("Session taken over"), or, from a
broker that only closes the socket, connections closed right after being accepted."""

import logging

from agent.device import config
from agent.device.daemon import Daemon
from agent.device.journal import Journal
from agent.wire.mqtt import DISCONNECTED, SESSION_TAKEN_OVER
from agent.wire.mqtt_types import Event


class _Mqtt(object):
    address = "broker:8883"


def _daemon(tmp_path):
    cfg = config.load(None, overrides={("device_id",): "dev1",
                                       ("state_dir",): str(tmp_path)})
    d = Daemon(cfg)
    d.journal = Journal(str(tmp_path / "journal.sqlite3"))
    d.mqtt = _Mqtt()
    return d


def test_a_takeover_the_broker_announces_is_logged_and_recorded(tmp_path, caplog):
    d = _daemon(tmp_path)
    with caplog.at_level(logging.ERROR, "agent.device.daemon"):
        d._connection_lost(Event(DISCONNECTED, reason="Session taken over",
                                 code=SESSION_TAKEN_OVER, held_s=120.0))
    note = d.journal.note("connection")
    assert note["taken_over"] == 1 and note["confirmed"] and note["client_id"] == "dev1"
    assert "session_taken_over" in caplog.text and "0x8E" in caplog.text
    assert d.counters["session_taken_over"] == 1
    d.journal.close()


def test_quick_silent_closes_are_a_suspected_takeover(tmp_path):
    d = _daemon(tmp_path)
    closed = Event(DISCONNECTED, reason="connection closed", code=None, held_s=0.3)
    d._connection_lost(Event(DISCONNECTED, code=None, held_s=600.0))  # a normal drop
    d._connection_lost(closed)
    d._connection_lost(closed)
    assert d.journal.note("connection") is None
    d._connection_lost(closed)
    note = d.journal.note("connection")
    assert note["taken_over"] == 1 and not note["confirmed"]
    d.journal.close()
