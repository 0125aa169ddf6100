"""What the agent does to ``models_dir``, for running the example app without a daemon (its
test, the switch benchmark): install a version directory and switch ``current`` to it with the
daemon's own code (``agent.device.models.directory``: complete version directory first, then a new
relative link renamed over ``current``), and a stand-in for the daemon's app socket that
records what the app reports.

Layout (the daemon's): ``<models_dir>/<name>/<version>/{model.engine, model.onnx, meta.json}``,
``<models_dir>/<name>/current -> <version>``. The "engine" installed here is the ONNX model
itself (the host backend's engines are ONNX models too).
"""

import hashlib
import json
import os
import socket
import threading
import time
from typing import Any, Dict, List, Optional

from agent.device.models.directory import ModelsDir
from agent.fsio import atomic_write, atomic_write_text


def install_version(models_dir: str, name: str, version: str, onnx_path: str,
                    extra_meta: Optional[Dict[str, Any]] = None) -> str:
    """<models_dir>/<name>/<version>/ with model.engine, model.onnx and meta.json, written by
    the daemon's own code (``agent.device.models.directory``: a temporary directory, fsync'd, renamed
    into place; files linked from the source); its path."""
    with open(onnx_path, "rb") as f:
        data = f.read()
    sha = hashlib.sha256(data).hexdigest()
    # The daemon links a version's files from its own engine cache, never from the user's
    # files: a private copy beside the models directory plays that cache (a test that
    # corrupts a version's engine must not corrupt the example it came from).
    cache = os.path.join(os.path.dirname(os.path.abspath(models_dir)), "engine-cache")
    os.makedirs(cache, exist_ok=True)
    source = os.path.join(cache, sha + ".onnx")
    if not os.path.exists(source):
        atomic_write(source, data)

    def meta_for(engine_sha: str, engine_size: int) -> Dict[str, Any]:
        meta = {"name": name, "version": version, "model_sha256": sha,
                "engine_sha256": engine_sha, "engine_size": engine_size,
                "engine_key": sha[:16], "precision": "fp32", "backend": "onnxruntime",
                "state": "pending", "activated": None}
        meta.update(extra_meta or {})
        return meta

    return ModelsDir(models_dir).write_version(name, version, source, source, meta_for)


def write_meta(version_dir: str, meta: Dict[str, Any]) -> None:
    atomic_write_text(os.path.join(version_dir, "meta.json"),
                      json.dumps(meta, indent=1, sort_keys=True))


def activate(models_dir: str, name: str, version: str) -> float:
    """Stamp the version's meta.json ``activated`` (what the daemon writes when it activates a
    version) and switch ``current`` to it with the daemon's code (a new link renamed over the
    old one); the activation time."""
    vdir = os.path.join(models_dir, name, version)
    with open(os.path.join(vdir, "meta.json")) as f:
        meta = json.load(f)
    now = time.time()
    meta["activated"] = now
    write_meta(vdir, meta)
    ModelsDir(models_dir).set_current(name, version)
    return now


class SocketRecorder(object):
    """A stand-in for the daemon's app socket: one JSON line in, ``{"ok": true}`` out; every
    request is recorded (``requests``) and ``wait_for`` waits on a condition over them."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.requests: List[Dict[str, Any]] = []
        self.cond = threading.Condition()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self._stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\n" not in data and len(data) <= 4096:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    data += chunk
                try:
                    doc = json.loads(data.split(b"\n", 1)[0].decode("utf-8"))
                except ValueError:
                    doc = {"unparsed": data[:200].decode("utf-8", "replace")}
                conn.sendall(b'{"ok": true}\n')
            with self.cond:
                self.requests.append(doc)
                self.cond.notify_all()

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = [r for r in self.requests if predicate(r)]
                if found:
                    return found[-1]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no matching request in {}".format(self.requests))
                self.cond.wait(left)

    def close(self) -> None:
        self._stop = True
        self.thread.join(2)
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass
