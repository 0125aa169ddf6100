"""The service's HTTP servers are bounded: half-sent requests hold at most the connection cap
(the rest are answered 503 at once), and clients that reset are one log line, no traceback."""

import logging
import socket
import struct
import threading
import time

from agent.fleet.http_bounds import BoundedHTTPServer
from agent.fleet.http_source import HttpSource


def _half_sent(port):
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"GET /artifacts/")  # never finished
    return s


def _status_line(port):
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /artifacts/" + b"0" * 64 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        return s.recv(64).split(b"\r\n", 1)[0]


def test_half_sent_requests_hold_at_most_the_cap_and_the_rest_get_503(monkeypatch):
    monkeypatch.setattr(BoundedHTTPServer.__init__, "__defaults__", (8,))
    source = HttpSource("127.0.0.1", 0, lambda: {}).start()
    threads_before = threading.active_count()
    held = []
    try:
        held = [_half_sent(source.port) for _ in range(200)]
        busy = _status_line(source.port)
        assert busy == b"HTTP/1.1 503 Service Unavailable"
        assert threading.active_count() <= threads_before + 8
        assert source.httpd.refused >= 1
    finally:
        for s in held:
            s.close()
    # Their slots come back as they close: a whole request is served again (404: unknown).
    deadline = time.monotonic() + 30
    while _status_line(source.port) != b"HTTP/1.0 404 no such artifact":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    source.stop()


def test_a_client_that_resets_is_one_line_without_a_traceback(caplog):
    source = HttpSource("127.0.0.1", 0, lambda: {}).start()
    caplog.set_level(logging.DEBUG, logger="agent.fleet")
    try:
        for _ in range(20):
            s = _half_sent(source.port)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # RST
        deadline = time.monotonic() + 30
        while len([r for r in caplog.records if "connection ended" in r.getMessage()]) < 20:
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
    finally:
        source.stop()
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
