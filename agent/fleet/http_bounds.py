"""The service's HTTP servers (artifacts, dashboard) with bounds: at most ``max_connections``
handled at once (a connection past that gets ``503`` and is closed at once, counted), a
deadline on every receive (the handler's ``timeout``), and a client that resets or times out is
one log line, not a traceback. Half-sent requests can hold a slot for one deadline, never the
service's threads or memory."""

import logging
import socket
import sys
import threading
from http.server import ThreadingHTTPServer
from typing import Any, Tuple

log = logging.getLogger("agent.fleet")

MAX_CONNECTIONS = 64
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
         b"Connection: close\r\n\r\n")


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a burst of connections waits in the backlog, not in SYN retries

    def __init__(self, address: Tuple[str, int], handler: Any,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0  # connections answered 503 because every slot was taken

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                log.warning("http: %d connections refused so far: all %s slots busy",
                            self.refused, self._slots._initial_value)  # type: ignore[attr-defined]
            try:
                request.settimeout(1.0)
                request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        peer = client_address[0] if client_address else "?"
        if isinstance(exc, (ConnectionError, socket.timeout, TimeoutError)):
            log.info("http %s: connection ended: %s", peer, type(exc).__name__)
        else:
            log.warning("http %s: request failed: %s: %s", peer, type(exc).__name__, exc)
            log.debug("http %s: request failed", peer, exc_info=True)
