#!/usr/bin/env python3
"""A load generator for the example app (standard library + numpy): ``threads`` clients, each on
one keep-alive HTTP connection, post rows to ``/infer`` back to back (or at ``rate`` requests a
second each) and count, per version that answered, the requests served, and every failure
(an error status, a dropped connection, a timeout).

In a program: ``gen = LoadGen(url).start(); ...; summary = gen.stop()``.
CLI: ``python examples/app/loadgen.py --url http://127.0.0.1:PORT --seconds 10 [--json F]``.
"""

import argparse
import http.client
import json
import os
import sys
import threading
import time
from typing import Any, Dict, List, Optional
from urllib.parse import urlsplit

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


class LoadGen(object):
    def __init__(self, url: str, threads: int = 2, rows: int = 8, rate: float = 0.0,
                 timeout: float = 10.0, checks: Optional[str] = None) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", int(parts.port or 80)
        self.threads = threads
        self.rate = rate
        self.timeout = timeout
        with np.load(checks or os.path.join(HERE, "checks.npz"), allow_pickle=False) as data:
            batch = data["input"][:rows]
        self.body = json.dumps({"input": batch.tolist()}).encode("utf-8")
        self.lock = threading.Lock()
        self.by_version: Dict[str, int] = {}
        self.failures: List[Dict[str, Any]] = []
        self.ok = 0
        self._stop = threading.Event()
        self._workers: List[threading.Thread] = []
        self.started = self.stopped = 0.0

    def start(self) -> "LoadGen":
        self.started = time.monotonic()
        for i in range(self.threads):
            t = threading.Thread(target=self._run, name="loadgen-{}".format(i), daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def _connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _run(self) -> None:
        conn = self._connect()
        period = 1.0 / self.rate if self.rate > 0 else 0.0
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                conn.request("POST", "/infer", self.body,
                             {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                if resp.status != 200:
                    raise RuntimeError("HTTP {}: {}".format(resp.status, data[:200]))
                version = json.loads(data.decode("utf-8"))["version"]
                with self.lock:
                    self.ok += 1
                    self.by_version[version] = self.by_version.get(version, 0) + 1
            except Exception as exc:  # noqa: BLE001 - every failure counts
                with self.lock:
                    self.failures.append({"at": time.time(), "error": str(exc)[:300]})
                conn.close()
                conn = self._connect()
                self._stop.wait(0.05)  # do not spin on a dead server
            if period:
                self._stop.wait(max(0.0, period - (time.monotonic() - began)))
        conn.close()

    def summary(self) -> Dict[str, Any]:
        with self.lock:
            elapsed = (self.stopped or time.monotonic()) - self.started
            return {"ok": self.ok, "failed": len(self.failures),
                    "by_version": dict(self.by_version), "failures": self.failures[:20],
                    "seconds": round(elapsed, 3),
                    "rate_per_s": round(self.ok / elapsed, 1) if elapsed > 0 else None}

    def stop(self) -> Dict[str, Any]:
        self._stop.set()
        for t in self._workers:
            t.join(self.timeout + 1)
        self.stopped = time.monotonic()
        return self.summary()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the app, e.g. http://127.0.0.1:8080")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=8, help="rows per request")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="requests a second per thread (0: back to back)")
    parser.add_argument("--json", help="write the summary here too")
    args = parser.parse_args(argv)
    gen = LoadGen(args.url, args.threads, args.rows, args.rate).start()
    try:
        time.sleep(args.seconds)
    except KeyboardInterrupt:
        pass
    summary = gen.stop()
    print(json.dumps(summary, indent=1, sort_keys=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1, sort_keys=True)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
