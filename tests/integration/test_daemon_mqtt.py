"""agent.wire.mqtt against a real Mosquitto: MQTT v5 and 3.1.1, acknowledged publishes (the outbox
relies on them), subscriptions restored after a broker restart, the Will on a dropped
connection, v5 request/response properties, and a clear error for an unreachable broker."""

import queue
import socket
import time

import pytest

from agent.errors import AgentError
from agent.wire.mqtt import CONNECT_FAILED, CONNECTED, MESSAGE, PUBLISHED, SUBSCRIBED, MqttClient
from agent.wire.mqtt_types import Will

from .conftest import free_port


def client(broker, name, **kw):
    kw.setdefault("reconnect_min", 0.1)
    kw.setdefault("reconnect_max", 0.5)
    return MqttClient(name, broker.host, broker.port, events=queue.Queue(), **kw)


def next_event(c, kind, timeout=10, topic=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ev = c.events.get(timeout=0.1)
        except queue.Empty:
            continue
        if ev.kind == kind and (topic is None or ev.topic == topic):
            return ev
    raise AssertionError("no {} event within {} s".format(kind, timeout))


@pytest.mark.parametrize("protocol", ["v5", "v3.1.1"])
def test_publish_ack_subscribe_and_will(mosquitto, protocol):
    dev = client(mosquitto, "dev-" + protocol, protocol=protocol,
                 will=Will("t/status", b"offline"))
    ctl = client(mosquitto, "ctl-" + protocol, protocol=protocol)
    ctl.subscribe("t/#")
    ctl.start()
    dev.start()
    dev.wait_connected(10)
    ctl.wait_connected(10)
    next_event(ctl, SUBSCRIBED)
    handle = dev.publish("t/x", b"hello", qos=1, token=("outbox", 7))
    assert handle.wait(10) and handle.ok
    ev = next_event(dev, PUBLISHED)
    assert ev.token == ("outbox", 7) and ev.ok
    msg = next_event(ctl, MESSAGE, topic="t/x")
    assert msg.payload == b"hello" and msg.qos == 1
    dev.drop_connection()  # no DISCONNECT: the broker publishes the Will
    assert next_event(ctl, MESSAGE, topic="t/status").payload == b"offline"
    dev.stop()
    ctl.stop()


def test_nagle_is_off_on_the_connection(mosquitto):
    # A 4-byte PUBACK or a block request must not wait for the broker's delayed ACK: with
    # Nagle on, a block stream stalls for 40 ms many times a second (docs/benchmarks.md).
    c = client(mosquitto, "nodelay")
    c.start()
    c.wait_connected(10)
    sock = c._client.socket()  # paho's socket: the option is only visible there
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    c.stop()


def test_subscriptions_and_queued_publishes_survive_a_broker_restart(mosquitto):
    sub = client(mosquitto, "sub")
    sub.subscribe("r/#")
    sub.start()
    pub = client(mosquitto, "pub")
    pub.start()
    sub.wait_connected(10)
    pub.wait_connected(10)
    next_event(sub, SUBSCRIBED)
    mosquitto.stop()
    time.sleep(0.3)
    handle = pub.publish("r/1", b"while down", qos=1, token="t1")  # queued by paho
    assert not handle.acked
    mosquitto.start()
    assert handle.wait(15) and handle.ok  # resent after the reconnect, then acknowledged
    next_event(sub, CONNECTED, timeout=15)
    next_event(sub, SUBSCRIBED, timeout=15)  # subscriptions sent again on the new session
    pub.publish("r/2", b"after", qos=1).wait(10)
    assert next_event(sub, MESSAGE, topic="r/2").payload == b"after"
    pub.stop()
    sub.stop()


def test_v5_response_topic_and_correlation(mosquitto):
    a = client(mosquitto, "a")
    b = client(mosquitto, "b")
    b.subscribe("req")
    a.start()
    b.start()
    a.wait_connected(10)
    b.wait_connected(10)
    next_event(b, SUBSCRIBED)
    a.publish("req", b"?", correlation=b"c-1", response_topic="replies/a").wait(10)
    ev = next_event(b, MESSAGE, topic="req")
    assert ev.response_topic == "replies/a" and ev.correlation == b"c-1"
    a.stop()
    b.stop()


def test_unreachable_broker_names_host_port_and_reason(tmp_path):
    port = free_port()
    c = MqttClient("x", "127.0.0.1", port, reconnect_min=0.1, reconnect_max=0.2,
                   events=queue.Queue())
    c.start()
    with pytest.raises(AgentError) as exc:
        c.wait_connected(1.5)
    assert exc.value.code == "broker_unreachable"
    assert "127.0.0.1:{}".format(port) in exc.value.message
    assert "ConnectionRefusedError" in exc.value.message
    assert next_event(c, CONNECT_FAILED).reason
    c.stop()


def test_bad_protocol_is_a_config_error():
    with pytest.raises(AgentError) as exc:
        MqttClient("x", protocol="v4")
    assert exc.value.code == "bad_config"
