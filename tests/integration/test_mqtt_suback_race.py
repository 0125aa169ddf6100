"""agent.wire.mqtt over a real Mosquitto: a SUBACK that paho's network thread handles before
``subscribe()`` recorded its message id is not lost. Before, the id stayed recorded for ever,
no SUBSCRIBED event came again, and every later wait for one (the fleet service's wait for a
new rollout's retained statuses) ran to its limit: 5 s per rollout."""

import queue
import threading
import time
import uuid

from agent.wire.mqtt import SUBSCRIBED, MqttClient


def wait_subscribed(events, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ev = events.get(timeout=0.1)
        except queue.Empty:
            continue
        if ev.kind == SUBSCRIBED:
            return True
    return False


def test_a_suback_handled_before_subscribe_returned_is_not_lost(mosquitto):
    events = queue.Queue()
    client = MqttClient("race-" + uuid.uuid4().hex[:8], mosquitto.host, mosquitto.port,
                        events=events)
    client.subscribe("race/first")
    client.start()
    try:
        client.wait_connected(10)
        assert wait_subscribed(events)
        # The network thread wins every race: subscribe() returns only once the broker's
        # SUBACK was handled.
        acked = threading.Event()
        handler = client._client.on_subscribe

        def on_subscribe(*args):
            handler(*args)
            acked.set()

        client._client.on_subscribe = on_subscribe
        send = client._client.subscribe

        def late(*args, **kwargs):
            out = send(*args, **kwargs)
            assert acked.wait(5)
            return out

        client._client.subscribe = late
        for i in range(3):
            acked.clear()
            client.subscribe("race/{}".format(i))
            assert wait_subscribed(events), "no SUBSCRIBED after subscription {}".format(i)
        assert not client._sub_mids
    finally:
        client.stop()
