"""The service's HTTP servers (artifacts, dashboard) with bounds: at most ``max_connections``
handled at once (a connection past that gets ``503`` and is closed at once, counted), a
deadline on every receive (the handler's ``timeout``) and on each connection as a whole (its
request line and headers within ``HEAD_DEADLINE_S``, a whole request with its body and answer
within ``REQUEST_DEADLINE_S``: a client trickling one byte per receive deadline is cut), and a
client that resets or times out is one log line, not a traceback. Half-sent requests can hold a
slot for one deadline, never the service's threads or memory. ``listen_address`` reads
``--http`` / ``--dashboard``: loopback unless an address is given, a warning when it is not.

TLS (``--http-tls-cert`` / ``--http-tls-key``, ``server_tls_context``): each accepted socket is
wrapped in the connection's own thread, its handshake within the head deadline, so a client
that stalls or fails its handshake holds one slot for one deadline, never the accept loop; a
failed handshake is one log line (with what to check), counted in ``handshake_failures``.

No one client starves the others: a client (its address) holds at most ``PER_CLIENT``
connections, and once only ``reserve`` slots are left (a quarter of the cap, at most
``RESERVE``) they go to clients holding none yet; a connection past either bound is refused
like one past the cap (``refused_client`` counts those). Slow connections from one address
then cost that address its own slots, not everyone's."""

import ipaddress
import logging
import socket
import ssl
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from typing import Any, Dict, Optional, Tuple

from agent.errors import AgentError

log = logging.getLogger("agent.fleet")

MAX_CONNECTIONS = 64
PER_CLIENT = 8  # connections one address may hold at once (a browser opens about 6)
RESERVE = 16  # of the last free slots, these go only to addresses holding none
HEAD_DEADLINE_S = 30.0  # from a connection's accept (or its previous answer) to its headers
REQUEST_DEADLINE_S = 3600.0  # one request: body received and answer sent (a slow download)
LINGER_S = 2.0  # after a TLS connection's last answer: what the client still sends is read...
LINGER_BYTES = 8 << 20  # ... up to this much, then the connection is closed
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nRetry-After: 1\r\n"
         b"Connection: close\r\n\r\n")


class BoundedHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # a burst of connections waits in the backlog, not in SYN retries

    def __init__(self, address: Tuple[str, int], handler: Any,
                 max_connections: int = MAX_CONNECTIONS, head_deadline_s: float = HEAD_DEADLINE_S,
                 request_deadline_s: float = REQUEST_DEADLINE_S,
                 tls: Optional[ssl.SSLContext] = None) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, type(handler.__name__, (_Deadlines, handler), {}))
        self.max_connections = int(max_connections)
        self.per_client = PER_CLIENT
        self.reserve = min(RESERVE, self.max_connections // 4)
        self.busy = 0  # connections being handled
        self._by_client: Dict[str, int] = {}  # address -> its connections being handled
        self.refused = 0  # connections answered 503: every slot taken, or the client's
        self.refused_client = 0  # ... of which refused by the per-client bound or the reserve
        self.head_deadline_s = head_deadline_s
        self.request_deadline_s = request_deadline_s
        self.cut = 0  # connections closed at their deadline
        self._deadlines: Dict[Any, float] = {}  # socket -> when it is cut
        self._lock = threading.Lock()
        self._watchdog: Any = None
        self.tls = tls  # a server-side context: HTTPS
        self.handshake_failures = 0

    def arm(self, sock: Any, seconds: float) -> None:
        """Cut ``sock`` in ``seconds`` unless armed again or done before."""
        with self._lock:
            self._deadlines[sock] = time.monotonic() + seconds
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="http-deadlines",
                                                  daemon=True)
                self._watchdog.start()

    def _watch(self) -> None:
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            with self._lock:
                late = [s for s, t in self._deadlines.items() if t <= now]
                for sock in late:
                    del self._deadlines[sock]
            for sock in late:
                self.cut += 1
                if self.cut in (1, 10, 100) or self.cut % 1000 == 0:
                    log.warning("http: %d connections cut at their deadline so far (headers "
                                "within %.0f s, a request within %.0f s)", self.cut,
                                self.head_deadline_s, self.request_deadline_s)
                try:  # the plain socket's shutdown, also under TLS (the reader sees EOF)
                    socket.socket.shutdown(sock, socket.SHUT_RDWR)
                except OSError:
                    pass

    def _admit(self, client: str) -> str:
        """Take a slot for ``client``: "" when taken, else why not."""
        with self._lock:
            held = self._by_client.get(client, 0)
            if self.busy >= self.max_connections:
                return "all {} slots busy".format(self.max_connections)
            if held >= self.per_client:
                return "{} holds {} connections, the most one client may".format(client, held)
            if held and self.max_connections - self.busy <= self.reserve:
                return "the last {} slots are kept for other clients".format(self.reserve)
            self.busy += 1
            self._by_client[client] = held + 1
            return ""

    def _release(self, client: str) -> None:
        with self._lock:
            self.busy -= 1
            held = self._by_client.pop(client, 0) - 1
            if held > 0:
                self._by_client[client] = held

    def process_request(self, request: Any, client_address: Any) -> None:
        client = str(client_address[0]) if client_address else "?"
        why = self._admit(client)
        if why:
            self.refused += 1
            if not why.startswith("all"):
                self.refused_client += 1
            if self.refused in (1, 10, 100) or self.refused % 1000 == 0:
                log.warning("http: %d connections refused so far (the latest: %s)",
                            self.refused, why)
            try:  # (a TLS client could not read a plain answer: it is only closed)
                if self.tls is None:
                    request.settimeout(1.0)
                    request.sendall(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(client)
            raise

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is None:
            super().finish_request(request, client_address)
            return
        conn = None
        try:
            conn = self.tls.wrap_socket(request, server_side=True,
                                        do_handshake_on_connect=False)
            self.arm(conn, self.head_deadline_s)
            conn.settimeout(self.head_deadline_s)
            conn.do_handshake()
        except (ssl.SSLError, OSError) as exc:
            self._handshake_failed(client_address, exc)
            if conn is not None:
                self._forget(conn)
                conn.close()
            return
        try:
            self.RequestHandlerClass(conn, client_address, self)  # type: ignore[arg-type]
            _linger(conn)
        finally:
            self._forget(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _forget(self, sock: Any) -> None:
        with self._lock:
            self._deadlines.pop(sock, None)

    def _handshake_failed(self, client_address: Any, exc: BaseException) -> None:
        self.handshake_failures += 1
        n = self.handshake_failures
        if n <= 10 or n in (100, 1000) or n % 10000 == 0:
            text = str(exc)
            hint = ""
            if "UNKNOWN_CA" in text or "BAD_CERTIFICATE" in text or \
                    "CERTIFICATE_UNKNOWN" in text:
                hint = " (the client does not trust this certificate: give it the CA that " \
                       "signed it, e.g. the device's transfer.http_ca_file)"
            elif "HTTP_REQUEST" in text:
                hint = " (a plain HTTP request on the HTTPS port: use the https:// URL)"
            log.warning("http %s: TLS handshake failed: %s: %s%s (%d so far)",
                        client_address[0] if client_address else "?", type(exc).__name__,
                        text, hint, n)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._deadlines.pop(request, None)
            self._release(str(client_address[0]) if client_address else "?")

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        peer = client_address[0] if client_address else "?"
        if isinstance(exc, (ConnectionError, socket.timeout, TimeoutError)):
            log.info("http %s: connection ended: %s", peer, type(exc).__name__)
        else:
            log.warning("http %s: request failed: %s: %s", peer, type(exc).__name__, exc)
            log.debug("http %s: request failed", peer, exc_info=True)


def _linger(conn: Any) -> None:
    """Read what the client still sends (a refused upload's body), at most LINGER_BYTES within
    LINGER_S, before the socket is closed: closing with unread input resets the connection,
    and the client's copy of the answer (the refusal and why) with it."""
    end = time.monotonic() + LINGER_S
    left = LINGER_BYTES
    try:
        while left > 0:
            wait = end - time.monotonic()
            if wait <= 0:
                return
            conn.settimeout(wait)
            data = conn.recv(min(left, 1 << 16))
            if not data:
                return
            left -= len(data)
    except (OSError, ValueError):
        return


class _Deadlines(object):
    """Mixed into each server's handler: the head deadline before every request line, the
    request deadline once the headers are in."""

    def handle_one_request(self) -> None:
        self.server.arm(self.connection, self.server.head_deadline_s)  # type: ignore
        super().handle_one_request()  # type: ignore[misc]

    def parse_request(self) -> bool:
        ok = super().parse_request()  # type: ignore[misc]
        self.server.arm(self.connection, self.server.request_deadline_s)  # type: ignore
        return bool(ok)


def server_tls_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    """The server side of ``--http-tls-cert`` / ``--http-tls-key``: TLS 1.2 or later, the
    certificate (chain) and its key in PEM. AgentError bad_argument when they do not load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise AgentError("bad_argument", "--http-tls-cert/--http-tls-key expected a PEM "
                         "certificate and its private key, found {} / {}: {}".format(
                             cert_file, key_file, exc))
    return ctx


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen_address(text: str, flag: str, tls: bool = False) -> Tuple[str, int]:
    """``HOST:PORT`` of ``--http`` / ``--dashboard``: ``:PORT`` (no host) listens on loopback
    (127.0.0.1) only; an address that is not loopback (``0.0.0.0:8470``, a LAN address) is
    honoured with a warning when the server speaks plain HTTP (``tls``: it serves HTTPS, no
    warning). AgentError bad_argument."""
    host, sep, port = (text or "").rpartition(":")
    try:
        number = int(port)
    except ValueError:
        number = -1
    if not sep or not 0 <= number <= 65535:
        raise AgentError("bad_argument", "{} expects HOST:PORT or :PORT (e.g. 127.0.0.1:8470), "
                         "found {!r}".format(flag, text))
    host = host.strip("[]") or "127.0.0.1"
    if not is_loopback(host) and not tls:
        log.warning("%s %s: listening on a non-loopback address, reachable from the network "
                    "(plain HTTP; ':PORT' alone means loopback only; put a TLS reverse proxy in "
                    "front, docs/security.md 'HTTP servers')", flag, text)
    return host, number
