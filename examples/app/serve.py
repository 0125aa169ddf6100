#!/usr/bin/env python3
"""An example inference service for a model the agent deploys (standard library, numpy,
onnxruntime; from the project it uses only ``agent.client``).

- Loads ``<models_dir>/<name>/current``: the version's ``model.engine`` when ONNX Runtime can run
  it (on a host the agent's engine is an emulated fp16/int8 ONNX model, the one its gate
  measured), else its ``model.onnx`` (on a Jetson the engine is a TensorRT plan, which this
  CPU example does not run). The engine's size and SHA-256 are checked against ``meta.json``.
- Serves HTTP on loopback: ``POST /infer`` with ``{"input": [[64 floats], ...]}`` answers
  ``{"version", "classes"}``; ``GET /stats`` the switch record; ``GET /healthz``.
- Switches without failing a request: a watch on ``current`` loads the new version into a new
  session, checks it, and only then replaces one reference; a request takes the reference once,
  so requests in flight finish on the version they started with.
- Checks every version on its own stored rows (``checks.npz``: inputs and their true labels):
  finite outputs and label accuracy >= ``--min-accuracy``, and reports the verdict with
  ``agent.client.report_health``. A version that fails is never served (the previous one stays)
  and is reported unhealthy, so the agent rolls it back.
- With ``--donate-every N``, hands every Nth request's rows to the agent
  (``agent.client.donate``: never waits) for its live check of the next version against this
  one on real traffic (docs/using-models.md, "Live inputs").
- Records, per switch, the time from the version's activation (``meta.json`` ``activated``) to
  the first request served by it, and counts failed requests; ``/stats`` and ``--stats-file``.

Usage: ``python examples/app/serve.py --name digits --models-dir DIR [--socket PATH]
[--port 0 --port-file F]``.
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from socketserver import ThreadingMixIn
from typing import Any, Dict, List, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:  # the app runs from a checkout; an installed agent works the same
    sys.path.append(ROOT)

from agent import client  # noqa: E402

MAX_BODY = 1 << 20  # request bodies (64 floats a row: thousands of rows)
MAX_ROWS = 4096
CHECKS = os.path.join(HERE, "checks.npz")


class ThreadingHTTPServer(ThreadingMixIn, HTTPServer):
    """http.server's own is Python 3.7+; this app also runs on JetPack 4.6's Python 3.6."""

    daemon_threads = True


class Loaded(object):
    """One version in memory: its session and what was recorded about it."""

    def __init__(self, current: Any, session: Any, source: str) -> None:
        self.name = current.name
        self.version = current.version
        self.meta = current.meta
        self.session = session
        self.source = source  # "model.engine" or "model.onnx"
        self.input = session.get_inputs()[0].name
        self.output = session.get_outputs()[0].name
        self.activated = _number(current.meta.get("activated"))
        self.loaded_at = time.time()
        self.first_served: Optional[float] = None
        self.served = 0

    def run(self, rows: np.ndarray) -> np.ndarray:
        return self.session.run([self.output], {self.input: rows})[0]


def _number(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def open_session(current: Any) -> Loaded:
    """The version's session: its engine when ONNX Runtime runs it, else its model.onnx."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    with open(current.engine, "rb") as f:
        data = f.read()
    size, sha = current.meta.get("engine_size"), current.meta.get("engine_sha256")
    if size is not None and size != len(data):
        raise ValueError("engine of {}@{}: expected {} bytes (meta.json), found {}".format(
            current.name, current.version, size, len(data)))
    if sha is not None and sha != hashlib.sha256(data).hexdigest():
        raise ValueError("engine of {}@{}: its SHA-256 is not meta.json's".format(
            current.name, current.version))
    try:
        session = ort.InferenceSession(data, sess_options=opts,
                                       providers=["CPUExecutionProvider"])
        return Loaded(current, session, "model.engine")
    except Exception:  # noqa: BLE001 - not ONNX (a TensorRT plan): run the ONNX model
        onnx_path = os.path.join(os.path.dirname(current.engine), "model.onnx")
        session = ort.InferenceSession(onnx_path, sess_options=opts,
                                       providers=["CPUExecutionProvider"])
        return Loaded(current, session, "model.onnx")


def check(loaded: Loaded, checks: Dict[str, np.ndarray], min_accuracy: float) -> str:
    """'' when the version answers the stored rows well enough, else what is wrong."""
    out = loaded.run(checks["input"])
    if out.shape != (len(checks["input"]), 10):
        return "expected logits of shape ({}, 10), found {}".format(len(checks["input"]),
                                                                    out.shape)
    if not np.all(np.isfinite(out)):
        return "expected finite logits, found {} non-finite".format(
            int(np.sum(~np.isfinite(out))))
    accuracy = float(np.mean(np.argmax(out, axis=-1) == checks["label"]))
    if accuracy < min_accuracy:
        return "expected label accuracy >= {:.0%} on {} stored rows, found {:.1%}".format(
            min_accuracy, len(out), accuracy)
    return ""


class App(object):
    """The served reference, the switch logic and the records."""

    def __init__(self, name: str, models_dir: str, socket_path: Optional[str],
                 checks: Dict[str, np.ndarray], min_accuracy: float = 0.9,
                 report: bool = True, donate_every: int = 0) -> None:
        self.name = name
        self.models_dir = models_dir
        self.socket_path = socket_path
        self.checks = checks
        self.min_accuracy = min_accuracy
        self.report = report
        self.donate_every = donate_every
        self.serving: Optional[Loaded] = None  # replaced, never mutated in place
        self.lock = threading.Lock()  # records; the switch itself is one assignment
        self.switch_lock = threading.Lock()  # one switch at a time
        self.switches: List[Dict[str, Any]] = []
        self.rejected: List[Dict[str, Any]] = []
        self.reports: List[Dict[str, Any]] = []
        self.requests = 0
        self.failed = 0

    # --- switching -------------------------------------------------------------------------
    def refresh(self, *_args: Any) -> None:
        """Take ``current`` if it names a version other than the one served (the watch's
        callback; its argument is not needed: the link is read again here)."""
        with self.switch_lock:
            try:
                cur = client.current(self.name, self.models_dir)
            except Exception as exc:  # noqa: BLE001 - no link yet, or a half-made layout
                log("no current version of {}: {}".format(self.name, exc))
                return
            serving = self.serving
            if serving is not None and serving.version == cur.version:
                return
            try:
                loaded = open_session(cur)
                problem = check(loaded, self.checks, self.min_accuracy)
            except Exception as exc:  # noqa: BLE001 - any load failure is the version's
                loaded, problem = None, "cannot load it: {}".format(exc)
            if problem or loaded is None:
                with self.lock:
                    self.rejected.append({"version": cur.version, "detail": problem,
                                          "at": time.time()})
                log("{}@{} unhealthy: {}; still serving {}".format(
                    self.name, cur.version, problem,
                    serving.version if serving else "nothing"))
                self._report(cur.version, False, problem)
                return
            self.serving = loaded  # the switch: requests from now on run on the new session
            log("{}@{} serving ({}), was {}".format(self.name, cur.version, loaded.source,
                                                    serving.version if serving else "none"))
            self._report(cur.version, True, "{} stored rows answered correctly".format(
                len(self.checks["label"])))

    def _report(self, version: str, ok: bool, detail: str) -> None:
        if not self.report:
            return
        entry = {"version": version, "ok": ok, "detail": detail, "at": time.time()}
        try:
            client.report_health(self.name, version, ok, detail, socket_path=self.socket_path)
            entry["sent"] = True
        except Exception as exc:  # noqa: BLE001 - the daemon refused or is not there
            entry["sent"] = False
            entry["error"] = str(exc)
            log("health report for {}@{} not taken: {}".format(self.name, version, exc))
        with self.lock:
            self.reports.append(entry)

    # --- serving ---------------------------------------------------------------------------
    def infer(self, rows: np.ndarray) -> Dict[str, Any]:
        loaded = self.serving  # once: this request runs on this version to the end
        if loaded is None:
            raise LookupError("no healthy version of {} yet".format(self.name))
        out = loaded.run(rows)
        now = time.time()
        with self.lock:
            self.requests += 1
            donate = self.donate_every and self.requests % self.donate_every == 0
            loaded.served += 1
            if loaded.first_served is None:
                loaded.first_served = now
                self.switches.append({
                    "version": loaded.version, "activated": loaded.activated,
                    "loaded_at": loaded.loaded_at, "first_served": now,
                    "switch_s": None if loaded.activated is None else now - loaded.activated})
        if donate:  # queued for the client's sender thread: the request never waits on it
            try:
                client.donate(self.name, {"input": rows}, socket_path=self.socket_path)
            except client.ClientError as exc:  # a donation never fails a request
                log("donation not sent: {}".format(exc))
        return {"version": loaded.version, "classes": np.argmax(out, axis=-1).tolist()}

    def stats(self) -> Dict[str, Any]:
        with self.lock:
            serving = self.serving
            return {"name": self.name, "serving": serving.version if serving else None,
                    "source": serving.source if serving else None,
                    "requests": self.requests, "failed": self.failed,
                    "switches": list(self.switches), "rejected": list(self.rejected),
                    "reports": list(self.reports)}

    def failure(self) -> None:
        with self.lock:
            self.failed += 1


def handler_for(app: App) -> type:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the load generator reuses connections

        def log_message(self, fmt: str, *args: Any) -> None:
            pass

        def _send(self, code: int, doc: Dict[str, Any]) -> None:
            body = json.dumps(doc).encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/stats":
                self._send(200, app.stats())
            elif self.path == "/healthz":
                serving = app.serving
                self._send(200 if serving else 503,
                           {"serving": serving.version if serving else None})
            else:
                self._send(404, {"error": "unknown path {}".format(self.path[:100])})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/infer":
                self._send(404, {"error": "unknown path {}".format(self.path[:100])})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if not 0 < length <= MAX_BODY:
                    raise ValueError("expected a body of 1 to {} bytes, found {}".format(
                        MAX_BODY, length))
                rows = np.asarray(json.loads(self.rfile.read(length))["input"],
                                  dtype=np.float32)
                if rows.ndim != 2 or rows.shape[1] != 64 or not 0 < len(rows) <= MAX_ROWS:
                    raise ValueError("expected input float[1..{}, 64], found {}".format(
                        MAX_ROWS, list(rows.shape)))
            except (ValueError, KeyError, TypeError) as exc:
                self._send(400, {"error": str(exc)})
                return
            try:
                self._send(200, app.infer(rows))
            except Exception as exc:  # noqa: BLE001 - counted and answered
                app.failure()
                self._send(503, {"error": str(exc)})

    return Handler


def log(text: str) -> None:
    print("app: " + text, file=sys.stderr, flush=True)


def write_json(path: str, doc: Dict[str, Any]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def load_checks(path: str) -> Dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {"input": data["input"].astype(np.float32), "label": data["label"]}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", required=True, help="the model's name")
    parser.add_argument("--models-dir", help="default: $JETSON_AGENT_MODELS_DIR, else "
                        "/var/lib/jetson-agent-models")
    parser.add_argument("--socket", help="the agent's app socket (default: "
                        "$JETSON_AGENT_SOCKET, else /run/jetson-agent/app.sock)")
    parser.add_argument("--no-report", action="store_true",
                        help="check versions but do not report to the agent")
    parser.add_argument("--checks", default=CHECKS, help="stored rows and true labels (.npz)")
    parser.add_argument("--min-accuracy", type=float, default=0.9)
    parser.add_argument("--port", type=int, default=0, help="loopback port (0: a free one)")
    parser.add_argument("--port-file", help="write the port here once listening")
    parser.add_argument("--stats-file", help="write /stats here on every switch and at exit")
    parser.add_argument("--donate-every", type=int, default=0, metavar="N",
                        help="hand every Nth request's rows to the agent (0: none)")
    parser.add_argument("--watch-interval", type=float, default=0.05,
                        help="seconds between looks at the current link (default 0.05)")
    args = parser.parse_args(argv)

    # The client's own defaults (contract): $JETSON_AGENT_MODELS_DIR, else the service's.
    models_dir = args.models_dir or os.environ.get("JETSON_AGENT_MODELS_DIR") \
        or "/var/lib/jetson-agent-models"
    app = App(args.name, models_dir, args.socket,
              load_checks(args.checks), args.min_accuracy, report=not args.no_report,
              donate_every=args.donate_every)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler_for(app))
    server.daemon_threads = True
    done = threading.Event()

    def stop(signum: int, frame: Any) -> None:
        done.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def on_switch(*cb_args: Any) -> None:
        app.refresh()
        if args.stats_file:
            write_json(args.stats_file, app.stats())

    watcher = client.watch(args.name, on_switch, models_dir=app.models_dir,
                           interval_s=args.watch_interval)
    on_switch()  # what is current now (nothing yet is fine: the watch takes it when it comes)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if args.port_file:
        write_json(args.port_file, {"port": server.server_address[1], "pid": os.getpid()})
    log("{} on http://127.0.0.1:{}".format(args.name, server.server_address[1]))
    done.wait()
    watcher.stop()
    server.shutdown()
    if args.stats_file:
        write_json(args.stats_file, app.stats())
    return 0


if __name__ == "__main__":
    sys.exit(main())
