"""The app socket: where the inference app (and ``jetson-agent models commit``) talks to the
daemon, at ``$JETSON_AGENT_SOCKET`` under the shipped unit (``/run/jetson-agent/app.sock``), else
``<state_dir>/app.sock``.

Owns the listening AF_UNIX stream socket and its connections. A peer is identified by the
kernel (SO_PEERCRED): its uid must be one of ``allowed_uids``, or its gid or one of its user's
supplementary groups (``os.getgrouplist``) one of ``allowed_gids``; root and the daemon's own
uid are always allowed. Each connection carries ONE JSON line (at most 4 KiB, nested at most
``MAX_DEPTH`` deep, complete within ``read_timeout_s``) and gets one JSON line back.

Slow clients cannot starve the app: lines are read by one selector thread, so a connection
that dribbles bytes holds no worker; each uid has at most ``max_per_uid`` connections still
sending their line (a new one beyond that pushes out the uid's oldest, so a stuck client of
the app's own user cannot keep the app's next request out), at most ``max_open`` in all. A
complete line goes to one of ``max_concurrent`` workers; requests are rate-limited per uid
(token bucket: ``rate_per_s``, ``burst``, counted on complete lines only). ``names_of(peer)``
(``models.app_names``) says which model names a peer may commit, report on or roll back
(None: every name).

A donation (``{"op": "donate", "name", "bytes": N}``, then N bytes: an .npz of the app's
inputs, at most ``MAX_PAYLOAD``) is the one request with a payload: read by its worker within
``PAYLOAD_WITHIN_S`` and handed to ``donate(name, payload)``
(agent.device.models.live_samples), one at a time: another that comes meanwhile is refused
at once (``rate_limited``, "dropped"), so donations hold at most one worker and the app never
waits behind them.

The socket file is mode 0660, group ``socket_gid`` (default: the first allowed gid), with a
POSIX ACL entry for each allowed uid and gid, so a listed user or group reaches it whether or
not the service is in that group (setting an ACL needs ownership, not membership). Where the
file system has no ACLs and a listed peer is outside the file's group, the mode is 0666 and
the SO_PEERCRED check alone decides (a stranger then gets ``app_not_allowed``). A stale socket
file is replaced at start. ``handle(request, peer) -> dict`` does the work; refusals are
``{"ok": false, "error": {"code", "message"}}`` with ``app_not_allowed``, ``model_not_owned``,
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
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

from agent.errors import AgentError
from agent.wire.device.limits import TokenBuckets

MAX_LINE = 4096
MAX_DEPTH = 8  # a request is a flat object: deeper nesting is refused before parsing
LINGER_S = 0.5  # a refused connection stays open this long for the peer's line to drain
MAX_LINGERING = 256
OPS = ("health", "commit", "rollback", "list", "retry", "pin", "unpin", "donate")
OWNED_OPS = ("health", "commit", "rollback", "donate")  # what models.app_names restricts
# A donation's line says how many payload bytes follow it (an .npz of the app's inputs).
MAX_PAYLOAD = 16 << 20
PAYLOAD_WITHIN_S = 10.0
_UCRED = struct.Struct("3i")  # struct ucred {pid_t pid; uid_t uid; gid_t gid;}
# linux/posix_acl_xattr.h: a version, then (tag, perm, id) entries sorted by tag and id.
_ACL_HEADER, _ACL_ENTRY = struct.Struct("<I"), struct.Struct("<HHI")
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ, _ACL_GROUP, _ACL_MASK, _ACL_OTHER = (
    0x01, 0x02, 0x04, 0x08, 0x10, 0x20)
_NO_ID = 0xFFFFFFFF

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

Handler = Callable[[Dict[str, Any], Dict[str, Any]], Dict[str, Any]]
Donate = Callable[[str, bytes], Dict[str, Any]]  # (name, npz bytes) -> the reply
NamesOf = Callable[[Dict[str, Any]], Optional[Set[str]]]


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


def nesting_depth(line: bytes) -> int:
    """How deep ``[`` / ``{`` nest in a JSON text (outside strings): checked before parsing,
    so a deeply nested line costs a scan, not the parser's recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in line:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            deepest = max(deepest, depth)
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return deepest


def parse_line(line: bytes) -> Dict[str, Any]:
    """One request line -> the checked request; AgentError bad_message."""
    if nesting_depth(line) > MAX_DEPTH:
        raise AgentError("bad_message", "expected one flat JSON object (nested at most {} "
                         "deep), found deeper nesting".format(MAX_DEPTH))
    try:
        return check_request(json.loads(line.decode("utf-8")))
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise AgentError("bad_message", "expected one JSON line, found text that does not "
                         "parse: {}".format(str(exc)[:200]))


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
    if op == "donate":
        size = request.get("bytes")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_PAYLOAD:
            raise AgentError("bad_donation", "expected \"bytes\": the payload's size, 1 to {} "
                             "bytes, found {!r}".format(MAX_PAYLOAD, size))
    return request


class _Reading(object):
    """A connection still sending its line."""

    def __init__(self, conn: socket.socket, peer: Dict[str, Any], deadline: float) -> None:
        self.conn, self.peer, self.deadline = conn, peer, deadline
        self.data = b""


class AppSocket:
    def __init__(self, path: str, allowed_uids: Iterable[int], allowed_gids: Iterable[int],
                 handle: Handler, rate_per_s: float = 5, burst: int = 20,
                 max_concurrent: int = 4, read_timeout_s: float = 2.0,
                 socket_gid: Optional[int] = None, max_per_uid: int = 4,
                 max_open: int = 64, names_of: Optional[NamesOf] = None,
                 donate: Optional[Donate] = None) -> None:
        """``donate(name, payload)``: keeps an app's donated inputs (None: refused); runs
        on this socket's worker, not the daemon's loop, one at a time (another meanwhile is
        dropped: an app is never made to wait)."""
        self.path = os.path.abspath(path)
        self.allowed_uids = set(allowed_uids)
        self.allowed_gids = set(allowed_gids)
        self.handle = handle
        self.names_of = names_of
        self.donate = donate
        self.donating = threading.Lock()
        self._group_cache: Dict[Tuple[int, int], Tuple[float, List[int]]] = {}
        self.bucket = TokenBuckets(rate_per_s, burst)
        self.slots = threading.BoundedSemaphore(max_concurrent)
        self.max_per_uid, self.max_open = max(1, max_per_uid), max(1, max_open)
        self.read_timeout_s = read_timeout_s
        self.socket_gid = socket_gid if socket_gid is not None else (
            min(self.allowed_gids) if self.allowed_gids else None)
        self.own_uid = os.getuid()
        self.counts = {"served": 0, "refused": 0}
        self._sock: Optional[socket.socket] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._inode: Optional[int] = None
        self._reading: Dict[int, _Reading] = {}  # fd -> connection, oldest first
        self._lingering: Dict[int, Any] = {}  # fd -> (refused connection, close at), oldest first

    # -- life -------------------------------------------------------------------------------
    def start(self) -> "AppSocket":
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.path)
            # Nobody can connect before listen(): set mode, group and ACL first.
            self._set_access()
            sock.listen(64)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._inode = os.stat(self.path).st_ino
        self._sock = sock
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="app-socket", daemon=True)
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
        for r in list(self._reading.values()):
            r.conn.close()
        self._reading.clear()
        for conn, _ in list(self._lingering.values()):
            conn.close()
        self._lingering.clear()
        try:
            if self._inode is not None and os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except OSError:
            pass

    def __enter__(self) -> "AppSocket":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- the selector thread: accept, check the peer, read lines ----------------------------
    def _loop(self) -> None:
        assert self._sock is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._sock, selectors.EVENT_READ)
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.2):
                    try:
                        if key.fileobj is self._sock:
                            self._accept(selector)
                        elif key.fd in self._lingering:
                            self._drain(selector, key.fd)
                        else:
                            self._read(selector, key.fd)
                    except Exception:  # noqa: BLE001 - one connection never stops the loop
                        log.exception("app socket: a connection failed")
                now = time.monotonic()
                for fd, r in list(self._reading.items()):
                    if r.deadline <= now:
                        self._drop(selector, fd, "bad_message", "expected one complete JSON "
                                   "line within {:g} s, found {} bytes and no newline".format(
                                       self.read_timeout_s, len(r.data)))
                for fd, (_conn, close_at) in list(self._lingering.items()):
                    if close_at <= now:
                        self._close_lingering(selector, fd)

    def _refuse_soon(self, selector: selectors.BaseSelector, conn: socket.socket, code: str,
                     message: str) -> None:
        """A refusal from the selector thread: the reply now (a fresh socket's buffer takes
        it), then the connection lingers (LINGER_S) while the peer's line drains. Closing at
        once would reset a peer still sending, and it could lose the reply unread; waiting
        here would hold up every other client."""
        self.counts["refused"] += 1
        try:
            conn.setblocking(False)
            conn.send(json.dumps(refusal(code, message), sort_keys=True).encode("utf-8") +
                      b"\n")
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            conn.close()
            return
        if len(self._lingering) >= MAX_LINGERING:
            self._close_lingering(selector, next(iter(self._lingering)))
        self._lingering[conn.fileno()] = (conn, time.monotonic() + LINGER_S)
        selector.register(conn, selectors.EVENT_READ)

    def _drain(self, selector: selectors.BaseSelector, fd: int) -> None:
        conn, _ = self._lingering[fd]
        try:
            if conn.recv(MAX_LINE):
                return  # more may come: until the peer closes or LINGER_S
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass
        self._close_lingering(selector, fd)

    def _close_lingering(self, selector: selectors.BaseSelector, fd: int) -> None:
        conn, _ = self._lingering.pop(fd)
        try:
            selector.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _groups(self, uid: int, gid: int) -> List[int]:
        """groups_of, cached a minute per (uid, gid): a user database lookup (NSS: LDAP, sssd)
        on the selector thread for every connection would let a stranger's connect loop stall
        every app's request."""
        now = time.monotonic()
        hit = self._group_cache.get((uid, gid))
        if hit is not None and hit[0] > now:
            return hit[1]
        groups = groups_of(uid, gid)
        if len(self._group_cache) >= 256:
            self._group_cache.clear()
        self._group_cache[(uid, gid)] = (now + 60.0, groups)
        return groups

    def _accept(self, selector: selectors.BaseSelector) -> None:
        assert self._sock is not None
        try:
            conn, _addr = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            log.warning("app socket: accept failed: %s", exc)
            return
        peer: Dict[str, Any] = dict(peer_credentials(conn))
        peer["groups"] = self._groups(peer["uid"], peer["gid"])
        if not self.allowed(peer):
            log.warning("app socket: refused pid %s uid %s gid %s", peer["pid"], peer["uid"],
                        peer["gid"])
            self._refuse_soon(selector, conn, "app_not_allowed", (
                "expected a process of the configured app user or group, found uid {} "
                "(gid {})").format(peer["uid"], peer["gid"]))
            return
        mine = [fd for fd, r in self._reading.items() if r.peer["uid"] == peer["uid"]]
        if len(mine) >= self.max_per_uid:  # the uid's oldest still-sending connection goes
            self._drop(selector, mine[0], "rate_limited", "expected at most {} connections "
                       "at once still sending from uid {}, found more: this, the oldest, is "
                       "closed".format(self.max_per_uid, peer["uid"]))
        if len(self._reading) >= self.max_open:
            self._drop(selector, self._busiest(), "rate_limited", "expected at most {} "
                       "connections at once on the app socket, found more".format(
                           self.max_open))
        conn.setblocking(False)
        self._reading[conn.fileno()] = _Reading(conn, peer,
                                                time.monotonic() + self.read_timeout_s)
        selector.register(conn, selectors.EVENT_READ)

    def _busiest(self) -> int:
        """The oldest connection of the uid that holds the most: made to give way."""
        per_uid: Dict[int, int] = {}
        for r in self._reading.values():
            per_uid[r.peer["uid"]] = per_uid.get(r.peer["uid"], 0) + 1
        top = max(per_uid, key=per_uid.__getitem__)
        return next(fd for fd, r in self._reading.items() if r.peer["uid"] == top)

    def _read(self, selector: selectors.BaseSelector, fd: int) -> None:
        r = self._reading.get(fd)
        if r is None:
            return
        try:
            chunk = r.conn.recv(MAX_LINE + 1 - len(r.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        r.data += chunk
        if b"\n" not in r.data:
            if len(r.data) > MAX_LINE:
                self._drop(selector, fd, "bad_message", "expected one JSON line of at most {} "
                           "bytes, found more".format(MAX_LINE))
            elif not chunk:  # the peer stopped sending before its newline
                self._drop(selector, fd, "bad_message", "expected one JSON line ending in a "
                           "newline, found {} bytes and the end".format(len(r.data)))
            return
        selector.unregister(r.conn)
        del self._reading[fd]
        line, rest = r.data.split(b"\n", 1)
        if not self.slots.acquire(blocking=False):
            self._refuse_soon(selector, r.conn, "rate_limited", "expected at most a few requests "
                              "at once on the app socket, found more: ask again shortly")
            return
        r.conn.setblocking(True)
        threading.Thread(target=self._serve, args=(r.conn, r.peer, line, rest),
                         name="app-socket-conn", daemon=True).start()

    def _drop(self, selector: selectors.BaseSelector, fd: int, code: str,
              message: str) -> None:
        r = self._reading.pop(fd, None)
        if r is None:
            return
        try:
            selector.unregister(r.conn)
        except (KeyError, ValueError):
            pass
        self._refuse_soon(selector, r.conn, code, message)

    def _refuse(self, conn: socket.socket, code: str, message: str) -> None:
        self.counts["refused"] += 1
        try:
            self._reply(conn, refusal(code, message), timeout=0.2)
            # Drain what the peer already sent: closing an AF_UNIX socket with unread data
            # resets the peer, which could lose the refusal before it reads it. Non-blocking:
            # a timeout would make recv wait for a peer that sends nothing more (this runs on
            # the selector thread, which must never wait on one client).
            conn.shutdown(socket.SHUT_WR)
            conn.setblocking(False)
            for _ in range(16):
                if not conn.recv(MAX_LINE):
                    break
        except OSError:
            pass
        finally:
            conn.close()

    def _reply(self, conn: socket.socket, reply: Dict[str, Any],
               timeout: Optional[float] = None) -> None:
        conn.settimeout(self.read_timeout_s if timeout is None else timeout)
        try:
            conn.sendall(json.dumps(reply, sort_keys=True).encode("utf-8") + b"\n")
        except OSError:
            pass  # the peer went away: nothing to tell it

    def allowed(self, peer: Dict[str, Any]) -> bool:
        uid = peer["uid"]
        if uid in (0, self.own_uid) or uid in self.allowed_uids:
            return True
        return bool(self.allowed_gids.intersection(peer["groups"]))

    # -- a worker: one complete line ----------------------------------------------------------
    def _serve(self, conn: socket.socket, peer: Dict[str, Any], line: bytes,
               rest: bytes = b"") -> None:
        try:
            if not self.bucket.take(peer["uid"]):
                self._refuse(conn, "rate_limited", "expected at most {:g} requests a second "
                             "from uid {} (burst {:g}), found more: ask again later".format(
                                 self.bucket.rate, peer["uid"], self.bucket.burst))
                return
            if not line.strip():
                self._refuse(conn, "bad_message", "expected one JSON line, found an empty one")
                return
            try:
                request = parse_line(line)
                self._check_owner(request, peer)
            except AgentError as exc:
                self._refuse(conn, exc.code, exc.message)
                return
            try:
                if request["op"] == "donate":
                    reply = self._donation(conn, request, rest)
                    if reply is None:
                        return
                else:
                    reply = self.handle(request, peer)
            except AgentError as exc:
                reply = {"ok": False, "error": exc.to_dict()}
            except Exception as exc:  # noqa: BLE001 - the socket must answer whatever happens
                log.exception("app socket: handler failed")
                reply = refusal("internal_error", "the agent failed on this request: {}".format(
                    exc))
            self.counts["served"] += 1
            self._reply(conn, reply)
        finally:
            conn.close()
            self.slots.release()

    def _donation(self, conn: socket.socket, request: Dict[str, Any],
                  rest: bytes) -> Optional[Dict[str, Any]]:
        """Read the payload the line announced and hand it on; None when the connection was
        answered here already (dropped: another donation is in hand)."""
        if self.donate is None:
            raise AgentError("bad_message", "expected no donations: this agent keeps none")
        if not self.donating.acquire(blocking=False):
            self._refuse(conn, "rate_limited", "expected one donation at a time, found "
                         "another in hand: this one was dropped")
            return None
        try:
            size = request["bytes"]
            data = bytearray(rest[:size])
            deadline = time.monotonic() + PAYLOAD_WITHIN_S
            while len(data) < size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AgentError("bad_donation", "expected {} payload bytes within {:g} s, "
                                     "found {}".format(size, PAYLOAD_WITHIN_S, len(data)))
                conn.settimeout(left)
                try:
                    chunk = conn.recv(min(1 << 20, size - len(data)))
                except socket.timeout:
                    continue
                if not chunk:
                    raise AgentError("bad_donation", "expected {} payload bytes, found {} and "
                                     "the end".format(size, len(data)))
                data += chunk
            return dict(self.donate(request["name"], bytes(data)), ok=True)
        finally:
            self.donating.release()

    def _check_owner(self, request: Dict[str, Any], peer: Dict[str, Any]) -> None:
        if self.names_of is None or request["op"] not in OWNED_OPS or \
                peer["uid"] in (0, self.own_uid):
            return
        names = self.names_of(peer)
        if names is None or "*" in names or request["name"] in names:
            return
        raise AgentError("model_not_owned", "expected a model name uid {} is configured for "
                         "(models.app_names: {}), found {!r}".format(
                             peer["uid"], ", ".join(sorted(names)) or "none",
                             request["name"][:80]))
