"""The app socket under slow clients: one app's request round trips (connect, one JSON line,
the reply) while another process of the same uid keeps 12 connections open, each sending a
byte every 50 ms and never a whole line (a slow or stuck client).

Ours: p50 / p99 / max round trip and the requests refused, with the slow clients. Baseline:
the same requests with no other client. Uses only ``AppSocket(path, uids, gids, handle)``, so
the same file times any tree first on PYTHONPATH (the tree before the selector reader refused
the app once the slow clients held the 4 slots).
"""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after PYTHONPATH: PYTHONPATH=<another tree> times that tree

from tests.integration.test_versions_kept import SLOW_CLIENT  # noqa: E402 - the same slow client

REQUESTS = 400
SLOW = 12


def _ask(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    try:
        s.connect(path)
        s.sendall(b'{"op": "list"}\n')
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    finally:
        s.close()
    return json.loads(data.decode("utf-8"))


def _round_trips(path):
    times, refused = [], 0
    for _ in range(REQUESTS):
        started = time.perf_counter()
        reply = _ask(path)
        times.append((time.perf_counter() - started) * 1000.0)
        refused += 0 if reply.get("ok") else 1
    times.sort()
    return {"p50": times[len(times) // 2], "p99": times[int(len(times) * 0.99) - 1],
            "max": times[-1], "refused": refused}


def measure():
    from agent.device.app.server import AppSocket

    folder = tempfile.mkdtemp(prefix="bench-appsock-")
    path = os.path.join(folder, "app.sock")
    out = {}
    with AppSocket(path, [], [], lambda request, peer: {"ok": True, "models": []},
                   rate_per_s=1e6, burst=1e6):
        out["alone"] = _round_trips(path)
        slow = subprocess.Popen([sys.executable, "-c", SLOW_CLIENT, path, str(SLOW)],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert slow.stdout.readline().strip() == "holding"
            out["slow"] = _round_trips(path)
        finally:
            slow.kill()
            slow.wait(10)
    os.rmdir(folder)
    return out


def run():
    out = measure()
    rows = []
    for key in ("p50", "p99", "max"):
        rows.append({"name": "app socket round trip {} with {} slow clients vs none".format(
            key, SLOW), "ours": out["slow"][key], "baseline": out["alone"][key], "unit": "ms",
            "goal": "no refusal; p99 within 2x"})
    rows.append({"name": "app requests refused with {} slow clients (of {})".format(
        SLOW, REQUESTS), "ours": out["slow"]["refused"], "baseline": out["alone"]["refused"],
        "unit": "requests", "goal": "0"})
    return rows


if __name__ == "__main__":
    print(json.dumps(measure(), indent=1))
