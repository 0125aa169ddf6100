"""The MQTT client's send gate (agent.wire.send_gate) on a real Mosquitto: messages of a key
refused at the moment of writing are dropped from paho's queues (those not yet written and
those queued behind the in-flight window), never reach the broker, their handles fail; the
other keys' messages all go, the in-flight window they held is given back."""

import queue
import threading
import time

from agent.wire.mqtt import MESSAGE, MqttClient
from tests.integration.test_daemon_mqtt import client, next_event


def test_a_refused_key_is_dropped_at_the_write_and_the_others_go(mosquitto):
    closed = set()
    sender = client(mosquitto, "gate-sender")
    assert sender.set_gate(lambda key: key not in closed, lambda: "own")
    watcher = client(mosquitto, "gate-watcher")
    seen = {"a": 0, "b": 0}
    got_all = threading.Event()
    try:
        watcher.start()
        watcher.wait_connected(10)
        watcher.subscribe("gate/#")
        next_event(watcher, "subscribed")
        sender.start()
        sender.wait_connected(10)
        # Held: paho's thread cannot write (as when this process is stopped), so 300 + 50
        # messages queue up: 100 handed to the in-flight window, the rest behind it.
        with sender._gate.lock:
            a = [sender.publish("gate/a", b"x", fence="a") for _ in range(300)]
            b = [sender.publish("gate/b/{}".format(i), b"y", fence="b") for i in range(50)]
            b.append(sender.publish("gate/b/last", b"end"))  # no key: the default, "own"
            closed.add("a")  # ... and the lease of "a" went meanwhile
        assert all(h.wait(20) for h in b), [h.reason for h in b if not h.acked]
        assert all(h.ok for h in b)
        assert all(h.acked and not h.ok and "fence" in h.reason for h in a)
        assert sender.take_fenced() == {"a": 300}
        assert sender.take_fenced() == {}

        def count():
            while not got_all.is_set():
                try:
                    ev = watcher.events.get(timeout=0.1)
                except queue.Empty:
                    continue
                if ev.kind == MESSAGE:
                    seen["a" if ev.topic == "gate/a" else "b"] += 1
                    if ev.topic == "gate/b/last":
                        got_all.set()

        reader = threading.Thread(target=count, daemon=True)
        reader.start()
        assert got_all.wait(20)  # (one publisher's messages arrive in order: an "a" came first)
        assert seen == {"a": 0, "b": 51}
        # The window the dropped ones held is free again: a full window more goes through.
        more = [sender.publish("gate/c", b"z", fence="c") for _ in range(150)]
        deadline = time.monotonic() + 20
        assert all(h.wait(max(0.0, deadline - time.monotonic())) and h.ok for h in more)
    finally:
        got_all.set()
        sender.stop()
        watcher.stop()


def test_without_a_gate_nothing_is_recorded(mosquitto):
    plain = MqttClient("gate-plain", mosquitto.host, mosquitto.port, events=queue.Queue())
    try:
        plain.start()
        plain.wait_connected(10)
        h = plain.publish("gate/p", b"x", fence="ignored")
        assert h.wait(10) and h.ok
        assert plain.take_fenced() == {}
    finally:
        plain.stop()
