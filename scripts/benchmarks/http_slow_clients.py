"""One client starving the service's HTTP(S) side: ``SLOW`` (80) slow connections from one
address (127.0.0.2: half-sent requests, under HTTPS half of them TLS handshakes never begun;
each reopened as soon as the server closes it) while a legitimate client (127.0.0.1) makes
``REQUESTS`` (40) GETs of a 200 KB artifact, one after another, each with a 10 s timeout.
Measured against the bounded ``http.server`` the service ships (agent.fleet.transfer.
http_bounds: 8 connections per address, a reserve for others, 30 s header deadline) and, for
the comparison, a throwaway uvicorn + Starlette server of the same endpoint (``limit_concurrency``
64 as the service's cap, then uvicorn's default: no cap), over HTTP and HTTPS.

    python scripts/benchmarks/http_slow_clients.py     (needs uvicorn and starlette for
                                                        the comparison; SLOW=80 REQUESTS=40)
"""

import hashlib
import os
import socket
import ssl
import statistics
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from agent.fleet.transfer.http_bounds import server_tls_context  # noqa: E402
from agent.fleet.transfer.http_source import HttpSource  # noqa: E402
from tests.integration.pki import Pki  # noqa: E402
from tests.integration.test_http_bounds import _SlowClient  # noqa: E402

SLOW = int(os.environ.get("SLOW", "80"))
REQUESTS = int(os.environ.get("REQUESTS", "40"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def uvicorn_server(path, sha, port, cert=None, limit=64):
    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import FileResponse, Response
    from starlette.routing import Route

    async def artifact(request):
        if request.path_params["sha"] != sha:
            return Response("no such artifact", status_code=404)
        return FileResponse(path)

    app = Starlette(routes=[Route("/artifacts/{sha}", artifact)])
    kw = {"ssl_certfile": cert[0], "ssl_keyfile": cert[1]} if cert else {}
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                            limit_concurrency=limit, **kw)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return server


def measure(url, body, port, tls, context):
    times, ok = [], 0
    with _SlowClient(port, SLOW, tls=tls) as attack:
        for _ in range(REQUESTS):
            t0 = time.monotonic()
            try:
                with urllib.request.urlopen(url, timeout=10, context=context) as resp:
                    good = resp.status == 200 and resp.read() == body
            except OSError:
                good = False
            times.append(time.monotonic() - t0)
            ok += good
        opened = attack.opened
    return ok, statistics.median(times), max(times), opened


def main():
    tmp = tempfile.mkdtemp(prefix="http-slow-")
    body = os.urandom(200 << 10)
    path = os.path.join(tmp, "model.onnx")
    with open(path, "wb") as f:
        f.write(body)
    sha = hashlib.sha256(body).hexdigest()
    pki = Pki(os.path.join(tmp, "pki"))
    cert = pki.server("fleet")
    print("{} slow connections from 127.0.0.2, {} GETs of 200 KB from 127.0.0.1".format(
        SLOW, REQUESTS))
    print("| server | scheme | served | median s | slowest s | attacker connections opened |")
    print("|---|---|---|---|---|---|")
    for scheme in ("http", "https"):
        tls = scheme == "https"
        context = ssl.create_default_context(cafile=pki.ca_file) if tls else None
        source = HttpSource("127.0.0.1", 0, lambda: {sha: (path, len(body))},
                            tls=server_tls_context(*cert) if tls else None).start()
        try:
            url = "{}://127.0.0.1:{}/artifacts/{}".format(scheme, source.port, sha)
            ok, med, worst, opened = measure(url, body, source.port, tls, context)
        finally:
            source.stop()
        print("| bounded http.server | {} | {}/{} | {:.3f} | {:.3f} | {} |".format(
            scheme, ok, REQUESTS, med, worst, opened))
        for limit in (64, None):  # a cap like the service's; uvicorn's default (none)
            try:
                port = free_port()
                server = uvicorn_server(path, sha, port, cert if tls else None, limit)
            except ImportError:
                print("| uvicorn + Starlette | {} | (not installed) | | | |".format(scheme))
                break
            try:
                url = "{}://127.0.0.1:{}/artifacts/{}".format(scheme, port, sha)
                ok, med, worst, opened = measure(url, body, port, tls, context)
            finally:
                server.should_exit = True
                time.sleep(0.5)
            print("| uvicorn {} + Starlette, limit_concurrency={} | {} | {}/{} | {:.3f} | {:.3f} "
                  "| {} |".format(__import__("uvicorn").__version__, limit, scheme, ok, REQUESTS,
                                  med, worst, opened))


if __name__ == "__main__":
    main()
