"""sd_notify over a real AF_UNIX datagram socket, path and abstract namespace."""

import os
import socket
import uuid

from agent.device.sdnotify import Notifier


def receiver(address):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_ready_status_watchdog_stopping_on_a_path_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = receiver(path)
    try:
        n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000",
                      "WATCHDOG_PID": str(os.getpid())})
        assert n.enabled and n.watchdog_interval == 2.0
        assert n.ready("connected")
        assert sock.recv(4096) == b"READY=1\nSTATUS=connected"
        assert n.watchdog()
        assert sock.recv(4096) == b"WATCHDOG=1"
        assert n.status("job j1\nrunning")
        assert sock.recv(4096) == b"STATUS=job j1 running"
        assert n.stopping()
        assert sock.recv(4096) == b"STOPPING=1"
        n.close()
    finally:
        sock.close()


def test_abstract_namespace():
    name = "jetson-agent-test-" + uuid.uuid4().hex
    sock = receiver("\0" + name)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


def test_without_systemd_everything_is_a_noop():
    n = Notifier({})
    assert not n.enabled
    assert not n.ready() and not n.watchdog() and not n.stopping()


def test_watchdog_only_when_armed_for_this_process(tmp_path):
    path = str(tmp_path / "n.sock")
    sock = receiver(path)
    try:
        assert Notifier({"NOTIFY_SOCKET": path}).watchdog_interval is None
        other = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1000000",
                          "WATCHDOG_PID": str(os.getpid() + 1)})
        assert other.watchdog_interval is None and not other.watchdog()
        assert Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "junk"}).watchdog_interval \
            is None
    finally:
        sock.close()


def test_a_vanished_manager_does_not_raise(tmp_path):
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone.sock")})
    assert n.ready() is False
