"""A session takeover is surfaced: MQTT 5 DISCONNECT 0x8E ("Session taken over"), or, from a
broker that only closes the socket, connections closed right after being accepted."""

import logging

from agent.device.daemon_state import DaemonState
from agent.device.journal.store import Journal
from agent.device.status_publisher import StatusPublisher
from agent.wire.mqtt import DISCONNECTED, SESSION_TAKEN_OVER
from agent.wire.mqtt_types import Event
from agent.wire.topics import Topics


class _Mqtt(object):
    address = "broker:8883"


def _daemon(tmp_path):
    """The daemon's status publisher alone (it sees the connection drop), over a real journal."""
    journal = Journal(str(tmp_path / "journal.sqlite3"))
    return StatusPublisher(journal, _Mqtt(), Topics("jetson-agent"), "dev1", 1,
                           str(tmp_path), dict, DaemonState().counters)


def test_a_takeover_the_broker_announces_is_logged_and_recorded(tmp_path, caplog):
    d = _daemon(tmp_path)
    with caplog.at_level(logging.ERROR, "agent.device.daemon"):
        d.connection_lost(Event(DISCONNECTED, reason="Session taken over",
                                 code=SESSION_TAKEN_OVER, held_s=120.0))
    note = d.journal.note("connection")
    assert note["taken_over"] == 1 and note["confirmed"] and note["client_id"] == "dev1"
    assert "session_taken_over" in caplog.text and "0x8E" in caplog.text
    assert d.counters["session_taken_over"] == 1
    d.journal.close()


def test_quick_silent_closes_are_a_suspected_takeover(tmp_path):
    d = _daemon(tmp_path)
    closed = Event(DISCONNECTED, reason="connection closed", code=None, held_s=0.3)
    d.connection_lost(Event(DISCONNECTED, code=None, held_s=600.0))  # a normal drop
    d.connection_lost(closed)
    d.connection_lost(closed)
    assert d.journal.note("connection") is None
    d.connection_lost(closed)
    note = d.journal.note("connection")
    assert note["taken_over"] == 1 and not note["confirmed"]
    d.journal.close()
