"""The client library for inference apps (standard library only, Python 3.6+): where the current
version of a named model is (``current``), a watch that calls back when it switches
(``watch``), and the two requests an app sends to the daemon over its Unix socket
(``report_health``, ``commit``).

Layout read (docs, "Using the deployed model"): ``<models_dir>/<name>/<version>/`` holds
``model.engine``, ``model.onnx`` and ``meta.json``; ``<models_dir>/<name>/current`` is a relative
symlink to ``<version>``, switched atomically by the daemon.

Defaults: ``models_dir`` from ``JETSON_AGENT_MODELS_DIR`` else ``/var/lib/jetson-agent/models``;
the socket from ``JETSON_AGENT_SOCKET`` else ``/var/lib/jetson-agent/app.sock``.
"""

import collections
import json
import os
import socket
import threading

DEFAULT_MODELS_DIR = "/var/lib/jetson-agent/models"
DEFAULT_SOCKET = "/var/lib/jetson-agent/app.sock"
MAX_REPLY = 64 * 1024
MAX_META = 1024 * 1024

Current = collections.namedtuple("Current", ["name", "version", "engine", "meta"])


class ClientError(Exception):
    """A request the daemon refused, or a layout that is not what it should be."""

    def __init__(self, code, message):
        Exception.__init__(self, "{}: {}".format(code, message))
        self.code = code
        self.message = message


def models_dir_default(models_dir=None):
    return models_dir or os.environ.get("JETSON_AGENT_MODELS_DIR") or DEFAULT_MODELS_DIR


def socket_default(socket_path=None):
    return socket_path or os.environ.get("JETSON_AGENT_SOCKET") or DEFAULT_SOCKET


def current(name, models_dir=None):
    """The current version of ``name``: the link is read once, so version, engine and meta
    belong together even if the daemon switches right after."""
    root = os.path.join(models_dir_default(models_dir), name)
    link = os.path.join(root, "current")
    try:
        version = os.readlink(link)
    except OSError as exc:
        raise ClientError("file_not_found", "expected the link {}, found none ({})".format(
            link, exc.strerror))
    version = os.path.basename(version.rstrip("/"))
    path = os.path.join(root, version)
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path, "rb") as f:
            data = f.read(MAX_META + 1)
    except OSError as exc:
        raise ClientError("file_not_found", "expected {}, found none ({})".format(
            meta_path, exc.strerror))
    if len(data) > MAX_META:
        raise ClientError("bad_meta", "expected {} within {} bytes, found more".format(
            meta_path, MAX_META))
    try:
        meta = json.loads(data.decode("utf-8"))
    except ValueError as exc:
        raise ClientError("bad_meta", "expected JSON in {}, found {}".format(meta_path, exc))
    return Current(name, version, os.path.join(path, "model.engine"), meta)


class _Watch(object):
    """The stop handle of ``watch``: ``stop()`` ends the polling thread."""

    def __init__(self, name, callback, models_dir, interval_s):
        self.name = name
        self.callback = callback
        self.link = os.path.join(models_dir_default(models_dir), name, "current")
        self.models_dir = models_dir
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._last = self._read()
        self.thread = threading.Thread(target=self._run, name="watch-" + name)
        self.thread.daemon = True
        self.thread.start()

    def _read(self):
        try:
            return os.readlink(self.link)
        except OSError:
            return None

    def _run(self):
        while not self._stop.wait(self.interval_s):
            seen = self._read()
            if seen is None or seen == self._last:
                continue
            self._last = seen
            try:
                found = current(self.name, self.models_dir)
            except ClientError:
                continue
            self.callback(found)

    def stop(self):
        self._stop.set()
        if threading.current_thread() is not self.thread:
            self.thread.join(max(1.0, 2 * self.interval_s))


def watch(name, callback, models_dir=None, interval_s=1.0):
    """Poll ``current`` every ``interval_s`` and call ``callback(Current)`` when it switches
    (from a thread of its own); returns a handle whose ``stop()`` ends it."""
    return _Watch(name, callback, models_dir, interval_s)


def _request(doc, socket_path, timeout=10.0):
    path = socket_default(socket_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(path)
        sock.sendall(json.dumps(doc, sort_keys=True).encode("utf-8") + b"\n")
        chunks, size = [], 0
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if b"\n" in chunk or size > MAX_REPLY:
                break
    except OSError as exc:
        raise ClientError("daemon_unreachable", "expected the daemon's socket at {}, found: "
                          "{}".format(path, exc))
    finally:
        sock.close()
    line = b"".join(chunks).split(b"\n", 1)[0]
    try:
        reply = json.loads(line.decode("utf-8"))
    except ValueError:
        raise ClientError("bad_reply", "expected one JSON line from {}, found {!r}".format(
            path, line[:200]))
    if not isinstance(reply, dict) or reply.get("ok") is not True:
        err = (reply.get("error") if isinstance(reply, dict) else None) or {}
        raise ClientError(str(err.get("code") or "refused"), str(err.get("message") or reply))
    return reply


def report_health(name, version, ok, detail="", socket_path=None):
    """Tell the daemon whether ``name@version`` works in the app (ok commits a pending version,
    not ok rolls it back)."""
    return _request({"op": "health", "name": name, "version": version, "ok": bool(ok),
                     "detail": str(detail)[:1000]}, socket_path)


def commit(name, version=None, socket_path=None):
    """Commit the pending version of ``name`` (or that ``version``)."""
    doc = {"op": "commit", "name": name}
    if version is not None:
        doc["version"] = version
    return _request(doc, socket_path)
