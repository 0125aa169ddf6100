"""The jetson-agent client for inference apps: standard library only, Python 3.6+ (copy this one
file into an app if you like).

- ``current(name)`` -> ``Current(name, version, engine, meta)``: reads
  ``<models_dir>/<name>/current`` once and resolves it, so the version, the engine path and
  meta.json belong to the same version even while the agent switches.
- ``watch(name, callback)`` -> a handle with ``stop()``: a thread polls the ``current`` link and
  calls ``callback(Current)`` after each switch.
- ``report_health(name, version, ok, detail="")`` and ``commit(name, version=None)``: one request
  each on the agent's app socket (allowed for the configured app user or group only).
- ``state(name, version=None)`` -> ``ModelState(name, version, state, previous, health,
  pinned)``: what the agent says of the name's active version (or of ``version``): ``state``
  is ``pending`` (switched, waiting for the app's or the probe's confirmation), ``committed``,
  ``unconfirmed`` (nobody confirmed it in time), or ``rejected`` (asked for a version the
  device rolled back); ``health``: ``ok``, the app's last problem or the rollback's reason.
- ``donate(name, inputs)``: hand the agent recent real inputs (input name -> numpy array, one
  sample or a batch) for the live check before a new version commits and the INT8 range watch.
  They stay on the device (docs/using-models.md, "Live inputs"). It never blocks: the
  inputs are serialised and queued for a sender thread; while one donation is still on its
  way another is dropped (the reply says so; ``donations()`` counts them). ``wait=True``
  sends at once and returns the agent's reply (a refusal raises ClientError).

Defaults: ``$JETSON_AGENT_MODELS_DIR`` / ``$JETSON_AGENT_SOCKET``, else the shipped unit's
``/var/lib/jetson-agent-models`` and ``/run/jetson-agent/app.sock``. Failures raise
``ClientError`` with a stable ``code`` (the agent's codes, docs/errors.md) and a message.
"""

import collections
import io
import json
import os
import queue
import re
import socket
import sys
import threading

DEFAULT_MODELS_DIR = "/var/lib/jetson-agent-models"  # the shipped unit's (docs/daemon.md)
DEFAULT_SOCKET = "/run/jetson-agent/app.sock"
MAX_META = 1 << 20
MAX_REPLY = 64 * 1024
MAX_DONATION = 16 << 20  # the agent's limit on one donation's bytes
MAX_DONATED_INPUTS = 64
NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")

Current = collections.namedtuple("Current", "name version engine meta")
ModelState = collections.namedtuple("ModelState", "name version state previous health pinned")


class ClientError(Exception):
    """``code``: a stable error code; ``message``: what was expected and what was found."""

    def __init__(self, code, message):
        super(ClientError, self).__init__(message)
        self.code = code
        self.message = message

    def __str__(self):
        return "{}: {}".format(self.code, self.message)


def _check_name(name):
    if not isinstance(name, str) or not NAME.match(name):
        raise ClientError("bad_model_name", "expected a model name matching {}, found "
                          "{!r}".format(NAME.pattern, name))
    return name


def _check_version(version):
    if not isinstance(version, str) or not VERSION.match(version) or version in (".", ".."):
        raise ClientError("bad_model_version", "expected a version matching {}, found "
                          "{!r}".format(VERSION.pattern, version))
    return version


def models_dir_default(models_dir=None):
    return models_dir or os.environ.get("JETSON_AGENT_MODELS_DIR") or DEFAULT_MODELS_DIR


def socket_default(socket_path=None):
    return socket_path or os.environ.get("JETSON_AGENT_SOCKET") or DEFAULT_SOCKET


def _link(name, models_dir):
    return os.path.join(models_dir_default(models_dir), _check_name(name), "current")


def current(name, models_dir=None):
    """The version ``name``'s ``current`` link points to now: Current(name, version, engine,
    meta). Raises ClientError ``file_not_found`` when the model is not deployed."""
    link = _link(name, models_dir)
    try:
        target = os.readlink(link)
    except OSError as exc:
        raise ClientError("file_not_found", "expected {} to be a link to the deployed version, "
                          "found {}".format(link, exc.strerror))
    folder = os.path.normpath(os.path.join(os.path.dirname(link), target))
    version = os.path.basename(folder)
    meta_path = os.path.join(folder, "meta.json")
    try:
        with open(meta_path, "rb") as f:
            data = f.read(MAX_META + 1)
    except OSError as exc:
        raise ClientError("file_not_found", "expected {}, found {}".format(meta_path,
                                                                         exc.strerror))
    try:
        if len(data) > MAX_META:
            raise ValueError("larger than {} bytes".format(MAX_META))
        meta = json.loads(data.decode("utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise ClientError("bad_message", "expected {} to hold a JSON object, found: {}".format(
            meta_path, exc))
    return Current(name, version, os.path.join(folder, "model.engine"), meta)


class Watch(object):
    """A running ``watch``: ``stop()`` ends it (also as a context manager)."""

    def __init__(self, name, callback, models_dir, interval_s):
        self.name = name
        self.callback = callback
        self.link = _link(name, models_dir)
        self.models_dir = models_dir
        self.interval_s = interval_s
        self.errors = 0
        self._stop = threading.Event()
        self._last = self._target()
        self._thread = threading.Thread(target=self._run, name="jetson-agent-watch",
                                        daemon=True)
        self._thread.start()

    def _target(self):
        try:
            return os.readlink(self.link)
        except OSError:
            return None

    def _run(self):
        while not self._stop.wait(self.interval_s):
            target = self._target()
            if target is None or target == self._last:
                continue
            try:
                found = current(self.name, self.models_dir)
            except ClientError:
                continue  # switching right now: look again at the next tick
            self._last = target
            try:
                self.callback(found)
            except Exception as exc:  # noqa: BLE001 - the app's callback must not end the watch
                self.errors += 1
                sys.stderr.write("jetson-agent watch callback failed: {!r}\n".format(exc))

    def stop(self, timeout=None):
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def watch(name, callback, models_dir=None, interval_s=1.0):
    """Call ``callback(Current)`` on a thread each time ``name`` switches version; returns a
    handle whose ``stop()`` ends the watch."""
    if not interval_s > 0:
        raise ClientError("bad_argument", "expected interval_s > 0, found {!r}".format(
            interval_s))
    return Watch(name, callback, models_dir, interval_s)


def request(message, socket_path=None, timeout=10.0, payload=b""):
    """One JSON request on the app socket (``payload``: bytes sent after its line), its JSON
    reply (raises ClientError on a refusal)."""
    path = socket_default(socket_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        try:
            sock.connect(path)
            try:
                sock.sendall(json.dumps(message).encode("utf-8") + b"\n" + payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before reading the request (or its payload): the refusal is
                # waiting below
            data = b""
            while b"\n" not in data and len(data) <= MAX_REPLY:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
        except PermissionError as exc:
            # The socket's mode and ACL admit the configured app users and group only.
            raise ClientError("app_not_allowed", "expected a user or group the agent allows "
                              "(models.app_users, models.app_group) to reach {}, found uid {} "
                              "refused: {}".format(path, os.getuid(), exc.strerror or exc))
        except (socket.timeout, OSError) as exc:
            raise ClientError("agent_unreachable", "expected the agent to answer on {}, found "
                              "{}".format(path, getattr(exc, "strerror", None) or exc))
    finally:
        sock.close()
    try:
        reply = json.loads(data.split(b"\n", 1)[0].decode("utf-8"))
        if not isinstance(reply, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        raise ClientError("bad_message", "expected a JSON reply from the agent, found: "
                          "{}".format(exc))
    if not reply.get("ok"):
        error = reply.get("error")
        if not isinstance(error, dict):
            error = {}
        raise ClientError(str(error.get("code", "internal_error")),
                          str(error.get("message", "the agent refused the request")))
    return reply


def report_health(name, version, ok, detail="", socket_path=None):
    """Tell the agent whether ``name@version`` works in the app (an unhealthy report of a
    pending version rolls it back)."""
    if not isinstance(ok, bool):
        raise ClientError("bad_argument", "expected ok to be True or False, found {!r}".format(
            ok))
    return request({"op": "health", "name": _check_name(name),
                    "version": _check_version(version), "ok": ok,
                    "detail": str(detail)[:1000]}, socket_path)


def commit(name, version=None, socket_path=None):
    """Commit ``name``'s pending version (``version``: only if it is that one). The reply's
    ``state`` is ``pending`` while the agent's live check still runs: its verdict comes first."""
    message = {"op": "commit", "name": _check_name(name)}
    if version is not None:
        message["version"] = _check_version(version)
    return request(message, socket_path)


def state(name, version=None, socket_path=None):
    """What the agent says of ``name``: ModelState of its active version, or of ``version``
    (``rejected`` when the device rolled that version back and refuses it; ClientError
    ``file_not_found`` for a name or version the device does not hold)."""
    _check_name(name)
    if version is not None:
        _check_version(version)
    models = request({"op": "list"}, socket_path).get("models")
    row = next((m for m in models if isinstance(m, dict) and m.get("name") == name), None) \
        if isinstance(models, list) else None
    if row is None:
        raise ClientError("file_not_found", "expected the agent to hold model {}, found it "
                          "does not".format(name))
    found = ModelState(name, row.get("version"), row.get("state"), row.get("previous"),
                       row.get("health") or "ok", row.get("pinned"))
    if version is None or version == found.version:
        return found
    if version in (row.get("rejected") or []):
        return found._replace(version=version, state="rejected")
    if version in (row.get("unconfirmed") or []):
        return found._replace(version=version, state="unconfirmed")
    raise ClientError("file_not_found", "expected {}@{} to be the active or a rejected version, "
                      "found {} active".format(name, version, found.version))


_donations = {"queued": 0, "sent": 0, "dropped": 0, "refused": 0,
              "last_error": None}  # type: dict
_sender_lock = threading.Lock()
_sender_queue = []  # type: list  # the sender thread's queue, once it runs


def _payload(inputs):
    """``inputs`` (name -> array) as .npz bytes; ClientError bad_donation on what the agent
    would refuse anyway."""
    import numpy as np  # the app passes arrays: it has numpy

    if not isinstance(inputs, dict) or not inputs or len(inputs) > MAX_DONATED_INPUTS:
        raise ClientError("bad_donation", "expected a dict of 1 to {} input name -> array, "
                          "found {!r}".format(MAX_DONATED_INPUTS, type(inputs).__name__))
    arrays = {}
    for key, value in inputs.items():
        arr = np.asarray(value)
        if not isinstance(key, str) or arr.dtype.kind not in "biuf":
            raise ClientError("bad_donation", "expected input names (str) -> numeric arrays, "
                              "found {!r} -> {}".format(key, arr.dtype))
        arrays[key] = arr
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    data = buf.getvalue()
    if len(data) > MAX_DONATION:
        raise ClientError("bad_donation", "expected at most {} bytes in one donation, found {}: "
                          "donate fewer rows".format(MAX_DONATION, len(data)))
    return data


def _send_donations(q):
    while True:
        name, data, socket_path = q.get()
        try:
            request({"op": "donate", "name": name, "bytes": len(data)}, socket_path,
                    payload=data)
            _donations["sent"] += 1
        except ClientError as exc:
            _donations["dropped" if exc.code == "rate_limited" else "refused"] += 1
            _donations["last_error"] = str(exc)
        finally:
            q.task_done()


def donate(name, inputs, socket_path=None, wait=False):
    """Hand the agent recent real inputs of ``name`` (input name -> array: one sample, or a
    batch along the first axis). Returns at once: ``{"queued": True}``, or ``{"dropped":
    True, "reason": ...}`` while the previous donation is still being sent. ``wait=True``:
    sent now, the agent's reply returned (``kept`` rows, ``samples`` held)."""
    _check_name(name)
    data = _payload(inputs)
    if wait:
        return request({"op": "donate", "name": name, "bytes": len(data)}, socket_path,
                       payload=data)
    with _sender_lock:
        if not _sender_queue:
            _sender_queue.append(queue.Queue(1))
            threading.Thread(target=_send_donations, args=(_sender_queue[0],),
                             name="jetson-agent-donate", daemon=True).start()
    try:
        _sender_queue[0].put_nowait((name, data, socket_path))
    except queue.Full:
        _donations["dropped"] += 1
        return {"ok": True, "dropped": True, "reason": "the previous donation is still being "
                "sent: this one was dropped"}
    _donations["queued"] += 1
    return {"ok": True, "queued": True}


def donations():
    """Counts of this process's donations: queued, sent, dropped, refused, last_error."""
    return dict(_donations)
