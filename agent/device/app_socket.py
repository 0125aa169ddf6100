"""The app socket: where the inference app (and ``jetson-agent models commit``) talks to the
daemon, at ``<state_dir>/app.sock``.

Owns the listening AF_UNIX stream socket and its connections. A peer is identified by the
kernel (SO_PEERCRED): its uid must be one of ``allowed_uids``, or its gid or one of its user's
supplementary groups (``os.getgrouplist``) one of ``allowed_gids``; root and the daemon's own
uid are always allowed. Each connection carries ONE JSON line (at most 4 KiB, complete within
``read_timeout_s``) and gets one JSON line back; requests are rate-limited per uid (token
bucket: ``rate_per_s``, ``burst``) and at most ``max_concurrent`` connections are served at
once. The socket file is mode 0660, group ``socket_gid`` (default: the first allowed gid), with a
POSIX ACL entry for each allowed uid and gid, so a listed user or group reaches it whether or
not the service is in that group (setting an ACL needs ownership, not membership). Where the
file system has no ACLs and a listed peer is outside the file's group, the mode is 0666 and
the SO_PEERCRED check alone decides (a stranger then gets ``app_not_allowed``). A stale socket
file is replaced at start. ``handle(request, peer) -> dict`` (core21's) does the
work; refusals are ``{"ok": false, "error": {"code", "message"}}`` with ``app_not_allowed``,
``rate_limited`` or ``bad_message``.
"""

import json
import logging
import os
import pwd
import selectors
import socket
import stat
import struct
import threading
import time
from typing import Any, Callable, Dict, Iterable, List, Optional

from agent.errors import AgentError

MAX_LINE = 4096
OPS = ("health", "commit", "rollback", "list")
OPS = OPS + ("pin", "unpin")  # type: ignore[assignment]  # operator pins
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
# linux/posix_acl_xattr.h: a version, then (tag, perm, id) entries sorted by tag and id.
_ACL_HEADER, _ACL_ENTRY = struct.Struct("<I"), struct.Struct("<HHI")
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK, _ACL_OTHER = (
    0x01, 0x02, 0x04, 0x08, 0x10, 0x20)
_NO_ID = 0xFFFFFFFF

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

Handler = Callable[[Dict[str, Any], Dict[str, Any]], Dict[str, Any]]


def refusal(code: str, message: str) -> Dict[str, Any]:
    return {"ok": False, "error": {"code": code, "message": message}}


def acl_rw(uids: Iterable[int], gids: Iterable[int]) -> bytes:
    """A ``system.posix_acl_access`` value: owner and file group rw, each uid and gid rw,
    others nothing (setfacl -m u:UID:rw,g:GID:rw,o::-)."""
    rw = 4 | 2
    entries = [(_ACL_USER_OBJ, rw, _NO_ID)]
    entries += [(_ACL_USER, rw, uid) for uid in sorted(set(uids))]
    entries.append((_ACL_GROUP_OBJ, rw, _NO_ID))
    entries += [(_ACL_GROUP, rw, gid) for gid in sorted(set(gids))]
    entries += [(_ACL_MASK, rw, _NO_ID), (_ACL_OTHER, 0, _NO_ID)]
    return _ACL_HEADER.pack(2) + b"".join(_ACL_ENTRY.pack(*e) for e in entries)


def peer_credentials(conn: socket.socket) -> Dict[str, int]:
    pid, uid, gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _UCRED.size))
    return {"pid": pid, "uid": uid, "gid": gid}


def groups_of(uid: int, gid: int) -> List[int]:
    """The peer's primary group and its user's supplementary groups (from the group database,
    as a login would get them); just the primary group for a uid with no passwd entry."""
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        return [gid]
    try:
        return sorted(set(os.getgrouplist(name, gid)))
    except OSError:
        return [gid]


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: int) -> None:
        self.rate = float(rate_per_s)
        self.burst = float(burst)
        self.tokens: Dict[int, float] = {}
        self.stamp: Dict[int, float] = {}
        self.lock = threading.Lock()

    def take(self, key: int, now: Optional[float] = None) -> bool:
        now = time.monotonic() if now is None else now
        with self.lock:
            tokens = min(self.burst, self.tokens.get(key, self.burst) +
                         (now - self.stamp.get(key, now)) * self.rate)
            self.stamp[key] = now
            if tokens < 1.0:
                self.tokens[key] = tokens
                return False
            self.tokens[key] = tokens - 1.0
            if len(self.tokens) > 4096:  # bounded: forget the quietest users
                for old in sorted(self.stamp, key=self.stamp.__getitem__)[:1024]:
                    self.tokens.pop(old, None)
                    self.stamp.pop(old, None)
            return True


def check_request(request: Any) -> Dict[str, Any]:
    """The request's shape (values such as names are the handler's to validate)."""
    if not isinstance(request, dict):
        raise AgentError("bad_message", "expected a JSON object, found {}".format(
            type(request).__name__))
    op = request.get("op")
    if op not in OPS:
        raise AgentError("bad_message", "expected op to be one of {}, found {!r}".format(
            ", ".join(OPS), op))
    if op != "list" and not isinstance(request.get("name"), str):
        raise AgentError("bad_message", "expected a model name string in \"name\", found "
                         "{!r}".format(request.get("name")))
    if request.get("version") is not None and not isinstance(request["version"], str):
        raise AgentError("bad_message", "expected \"version\" to be a string, found {!r}".format(
            request["version"]))
    if op == "health":
        if not isinstance(request.get("ok"), bool):
            raise AgentError("bad_message", "expected \"ok\": true or false, found {!r}".format(
                request.get("ok")))
        if not isinstance(request.get("detail", ""), str):
            raise AgentError("bad_message", "expected \"detail\" to be a string, found "
                             "{!r}".format(request.get("detail")))
    return request


class AppSocket:
    def __init__(self, path: str, allowed_uids: Iterable[int], allowed_gids: Iterable[int],
                 handle: Handler, rate_per_s: float = 5, burst: int = 20,
                 max_concurrent: int = 4, read_timeout_s: float = 2.0,
                 socket_gid: Optional[int] = None) -> None:
        self.path = os.path.abspath(path)
        self.allowed_uids = set(allowed_uids)
        self.allowed_gids = set(allowed_gids)
        self.handle = handle
        self.bucket = TokenBucket(rate_per_s, burst)
        self.slots = threading.BoundedSemaphore(max_concurrent)
        self.read_timeout_s = read_timeout_s
        self.socket_gid = socket_gid if socket_gid is not None else (
            min(self.allowed_gids) if self.allowed_gids else None)
        self.own_uid = os.getuid()
        self.counts = {"served": 0, "refused": 0}
        self._sock: Optional[socket.socket] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._inode: Optional[int] = None

    # -- life -------------------------------------------------------------------------------
    def start(self) -> "AppSocket":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            # Nobody can connect before listen(): set mode, group and ACL first.
            self._set_access()
            sock.listen(16)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._inode = os.stat(self.path).st_ino
        self._sock = sock
        self._stop.clear()
        self._thread = threading.Thread(target=self._accept_loop, name="app-socket",
                                        daemon=True)
        self._thread.start()
        return self

    def _set_access(self) -> None:
        os.chmod(self.path, 0o660)
        group = os.getegid()
        if self.socket_gid is not None:
            try:
                os.chown(self.path, -1, self.socket_gid)
                group = self.socket_gid
            except PermissionError:
                pass  # the service is not in that group: the ACL below lets it in instead
        uids = self.allowed_uids - {0, self.own_uid}
        gids = self.allowed_gids - {group}
        if not uids and not gids:
            return
        try:
            os.setxattr(self.path, "system.posix_acl_access", acl_rw(uids, gids))
        except OSError as exc:
            # No ACLs here: open the file to every local user and let SO_PEERCRED decide.
            os.chmod(self.path, 0o666)
            log.info("app socket %s: no ACL (%s): mode 0666, the peer check alone admits "
                     "uids %s and gids %s", self.path, exc.strerror or exc, sorted(uids),
                     sorted(gids))

    def _remove_stale(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise AgentError("bad_config", "app socket {}: expected a socket or nothing there, "
                             "found another kind of file".format(self.path))
        os.unlink(self.path)  # the state-dir lock says no other daemon owns it

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        try:
            if self._inode is not None and os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except OSError:
            pass

    def __enter__(self) -> "AppSocket":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- connections ------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        assert self._sock is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                if not selector.select(timeout=0.2):
                    continue
                try:
                    conn, _addr = self._sock.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    log.warning("app socket: accept failed: %s", exc)
                    continue
                conn.setblocking(True)
                if not self.slots.acquire(blocking=False):
                    self._refuse(conn, "rate_limited", "expected at most a few requests at once "
                                 "on the app socket, found more: ask again shortly")
                    continue
                threading.Thread(target=self._serve, args=(conn,), name="app-socket-conn",
                                 daemon=True).start()

    def _refuse(self, conn: socket.socket, code: str, message: str) -> None:
        self.counts["refused"] += 1
        try:
            self._reply(conn, refusal(code, message))
            # Drain what the peer already sent: closing an AF_UNIX socket with unread data
            # resets the peer, which could lose the refusal before it reads it.
            conn.shutdown(socket.SHUT_WR)
            for _ in range(16):
                if not conn.recv(MAX_LINE, socket.MSG_DONTWAIT):
                    break
        except OSError:
            pass
        finally:
            conn.close()

    def _reply(self, conn: socket.socket, reply: Dict[str, Any]) -> None:
        conn.settimeout(self.read_timeout_s)
        try:
            conn.sendall(json.dumps(reply, sort_keys=True).encode("utf-8") + b"\n")
        except OSError:
            pass  # the peer went away: nothing to tell it

    def allowed(self, peer: Dict[str, Any]) -> bool:
        uid = peer["uid"]
        if uid in (0, self.own_uid) or uid in self.allowed_uids:
            return True
        return bool(self.allowed_gids.intersection(peer["groups"]))

    def _serve(self, conn: socket.socket) -> None:
        try:
            peer: Dict[str, Any] = dict(peer_credentials(conn))
            peer["groups"] = groups_of(peer["uid"], peer["gid"])
            if not self.allowed(peer):
                log.warning("app socket: refused pid %s uid %s gid %s", peer["pid"],
                            peer["uid"], peer["gid"])
                self._refuse(conn, "app_not_allowed", (
                    "expected a process of the configured app user or group, found uid {} "
                    "(gid {})").format(peer["uid"], peer["gid"]))
                return
            if not self.bucket.take(peer["uid"]):
                self._refuse(conn, "rate_limited", "expected at most {:g} requests a second "
                             "from uid {} (burst {:g}), found more: ask again later".format(
                                 self.bucket.rate, peer["uid"], self.bucket.burst))
                return
            try:
                request = check_request(json.loads(self._read_line(conn).decode("utf-8")))
            except AgentError as exc:
                self._refuse(conn, exc.code, exc.message)
                return
            except (ValueError, UnicodeDecodeError) as exc:
                self._refuse(conn, "bad_message", "expected one JSON line, found text that "
                             "does not parse: {}".format(exc))
                return
            try:
                reply = self.handle(request, peer)
            except AgentError as exc:
                reply = {"ok": False, "error": exc.to_dict()}
            except Exception as exc:  # noqa: BLE001 - the socket must answer whatever happens
                log.exception("app socket: handler failed")
                reply = refusal("internal_error", "the agent failed on this request: {}".format(
                    exc))
            self.counts["served"] += 1
            self._reply(conn, reply)
            conn.close()
        finally:
            conn.close()
            self.slots.release()

    def _read_line(self, conn: socket.socket) -> bytes:
        deadline = time.monotonic() + self.read_timeout_s
        data = b""
        while b"\n" not in data:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AgentError("bad_message", "expected one complete JSON line within {:g} s, "
                                 "found {} bytes and no newline".format(self.read_timeout_s,
                                                                       len(data)))
            conn.settimeout(left)
            try:
                chunk = conn.recv(MAX_LINE + 1 - len(data))
            except socket.timeout:
                continue
            if not chunk:
                break
            data += chunk
            if len(data) > MAX_LINE and b"\n" not in data[:MAX_LINE + 1]:
                raise AgentError("bad_message", "expected one JSON line of at most {} bytes, "
                                 "found more".format(MAX_LINE))
        line = data.split(b"\n", 1)[0]
        if not line.strip():
            raise AgentError("bad_message", "expected one JSON line, found an empty one")
        return line
