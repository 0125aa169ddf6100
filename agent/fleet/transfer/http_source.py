"""The service's content-addressed store over HTTP: ``GET /artifacts/<sha256>`` with single
``Range: bytes=A-B`` requests (206) so that devices resume where they stopped; devices check
every block against the signed per-block hashes and the whole file against its sha256, so
the transport needs no trust for artifacts. ``tls`` (a server-side ``ssl.SSLContext``,
``fleet serve --http-tls-cert/--http-tls-key``) serves HTTPS: the builders' engine uploads
and the artifacts are then private on the network, and devices verify the server with their CA
(``transfer.http_ca_file`` or ``broker.tls.ca_file``). Or put TLS in front with a reverse proxy,
or use any HTTPS URL of a CDN or object store in the job document instead.

``files`` is a callable returning sha256 -> (path, size): the BlockServer's table.
``shares`` (engine sharing): an ``agent.fleet.transfer.sharing.ShareBoard`` taking ``PUT
/shares/<token>``, a builder's engine upload to the one-time URL of its signed job document.
``uploads`` (``fleet models push --server``): an ``agent.fleet.deployments.uploads.Uploads``
taking ``/registry/...`` with the operator's token.
"""

import json
import logging
import re
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Dict, Optional, Tuple

from agent.fleet.transfer.http_bounds import BoundedHTTPServer

log = logging.getLogger("agent.fleet")
_PATH = re.compile(r"^/artifacts/([0-9a-f]{64})$")
_SHARE = re.compile(r"^/shares/([0-9a-f]{32})$")
_REGISTRY_BLOB = re.compile(r"^/registry/blobs/([0-9a-f]{64})$")
_RANGE = re.compile(r"^bytes=(\d{1,15})-(\d{0,15})$")
CHUNK = 1 << 16


class HttpSource(object):
    def __init__(self, host: str, port: int,
                 files: Callable[[], Dict[str, Tuple[str, int]]], shares: Any = None,
                 tls: Any = None, uploads: Any = None) -> None:
        self.files = files
        self.shares = shares
        self.uploads = uploads
        source = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "jetson-agent-fleet"
            timeout = 60  # per recv: a client that stalls (or stops mid-upload) lets go

            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("http %s: " + fmt, self.client_address[0], *args)

            def do_HEAD(self) -> None:
                if self.path.startswith("/registry/"):
                    source._registry(self)
                    return
                source._serve(self, body=False)

            def do_GET(self) -> None:
                source._serve(self, body=True)

            def do_PUT(self) -> None:
                if self.path.startswith("/registry/"):
                    source._registry(self)
                    return
                source._upload(self)

            def do_POST(self) -> None:
                source._registry(self)

        self.httpd = BoundedHTTPServer((host, port), Handler, tls=tls)
        self.scheme = "https" if tls is not None else "http"
        self.thread: Optional[threading.Thread] = None

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    def start(self) -> "HttpSource":
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="http-source",
                                       daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _upload(self, req: BaseHTTPRequestHandler) -> None:
        m = _SHARE.match(req.path)
        if m is None or self.shares is None or not self.shares.expects(m.group(1)):
            req.close_connection = True  # its body is unread: never parse it as a request
            req.send_error(404, "no such share upload")
            return
        length = req.headers.get("Content-Length") or ""
        if not length.isdigit() or len(length) > 15:
            req.send_error(411, "a Content-Length is required")
            return
        try:
            status, message = self.shares.receive(m.group(1), req.rfile, int(length),
                                                  req.headers)
        except (OSError, ConnectionError) as exc:
            log.warning("http: share upload failed: %s", exc)
            status, message = 500, "the upload could not be stored"
        if status >= 400:
            req.close_connection = True  # the body may be unread: never parse it as a request
            req.send_error(status, message)
            return
        data = message.encode("utf-8")
        req.send_response(status)
        req.send_header("Content-Type", "text/plain")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    def _registry(self, req: BaseHTTPRequestHandler) -> None:
        """The registry's upload endpoint (agent.fleet.deployments.uploads)."""
        up = self.uploads
        blob = _REGISTRY_BLOB.match(req.path)
        route = ("blob" if blob else "models" if req.path == "/registry/models" else None)
        if up is None or route is None or (route, req.command) not in (
                ("blob", "HEAD"), ("blob", "PUT"), ("models", "POST")):
            req.close_connection = True  # its body is unread: never parse it as a request
            req.send_error(404, "no such registry endpoint")
            return
        refused = up.refused(req.headers)
        if refused is None and req.command == "HEAD":
            req.send_response(200 if up.has_blob(blob.group(1)) else 404)  # type: ignore
            req.send_header("Content-Length", "0")
            req.end_headers()
            return
        length = req.headers.get("Content-Length") or ""
        if refused is None and (not length.isdigit() or len(length) > 15):
            refused = (411, {"error": {"code": "bad_argument", "message": "a Content-Length "
                                       "is required"}})
        if refused is None:
            try:
                if route == "blob":
                    refused = up.put_blob(blob.group(1), req.rfile, int(length))  # type: ignore
                else:
                    refused = up.put_version(req.rfile, int(length))
            except (OSError, ConnectionError) as exc:
                log.warning("http: registry upload failed: %s", exc)
                refused = (500, {"error": {"code": "internal_error", "message": "the upload "
                                           "could not be stored: {}".format(exc)}})
        status, doc = refused
        if status >= 400:
            req.close_connection = True  # the body may be unread: never parse it as a request
        data = json.dumps(doc, sort_keys=True).encode("utf-8")
        req.send_response(status)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)

    def _serve(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        m = _PATH.match(req.path)
        entry = self.files().get(m.group(1)) if m else None
        if entry is None:
            req.send_error(404, "no such artifact")
            return
        path, size = entry
        start, end, status = 0, size - 1, 200
        header = req.headers.get("Range")
        if header:
            r = _RANGE.match(header.strip())
            if r is None:
                req.send_error(400, "only one range bytes=A-B is served")
                return
            start = int(r.group(1))
            end = min(int(r.group(2)) if r.group(2) else size - 1, size - 1)
            if start > end:
                req.send_response(416)
                req.send_header("Content-Range", "bytes */{}".format(size))
                req.end_headers()
                return
            status = 206
        req.send_response(status)
        req.send_header("Content-Type", "application/octet-stream")
        req.send_header("Accept-Ranges", "bytes")
        req.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            req.send_header("Content-Range", "bytes {}-{}/{}".format(start, end, size))
        req.end_headers()
        if not body:
            return
        try:
            with open(path, "rb") as f:
                f.seek(start)
                left = end - start + 1
                while left > 0:
                    data = f.read(min(CHUNK, left))
                    if not data:
                        break
                    req.wfile.write(data)
                    left -= len(data)
        except (OSError, ConnectionError) as exc:
            log.debug("http: %s not fully sent: %s", path, exc)
