"""The app socket's requests, answered on the daemon's main loop: the socket's thread
(``agent.device.app.server.AppSocket``, which checks the peer's uid/gid and the rate) calls
``handler``, which posts an ``AppRequest`` to the main loop and waits for the answer; the main
loop answers it with ``answer`` (the model switch does the work).

    {"op": "health", "name", "version"?, "ok": bool, "detail"?}   the app's report
    {"op": "commit", "name", "version"?}                          commit a pending version
    {"op": "rollback", "name", "version"?}                        back to a kept version
    {"op": "list"}                                                the models state
    {"op": "retry", "name", "version"}                            forget a rejection (root and
                                                                  the service user only)
    {"op": "pin", "name", "version"} / {"op": "unpin", "name"}    pin a name to a kept version
                                                                  (root and the service user)
    {"op": "donate", "name", "bytes"} + an .npz payload             the app's inputs: taken by
                                                                  the socket itself
                                                                  (agent.device.models.live_samples)

``models.app_names`` (``names_of``) limits health, commit and rollback per name: the socket
checks it (``model_not_owned``) before a request reaches the main loop.
Replies ``{"ok": true, ...}`` or ``{"ok": false, "error": {"code", "message"}}``.
"""

import grp
import logging
import os
import pwd
import queue
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

from agent.errors import AgentError

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

ANSWER_WITHIN_S = 10.0
OPS = ("health", "commit", "rollback", "list", "retry", "pin", "unpin")


class AppRequest(NamedTuple):
    request: Dict[str, Any]
    peer: Dict[str, Any]
    reply: "queue.Queue[Dict[str, Any]]"


def handler(events: Any) -> Callable[[Dict[str, Any], Dict[str, Any]], Dict[str, Any]]:
    """``handle(request, peer)`` for the socket's thread: posted to the main loop, answered
    there (or an error after ANSWER_WITHIN_S)."""

    def handle(request: Dict[str, Any], peer: Dict[str, Any]) -> Dict[str, Any]:
        reply: "queue.Queue[Dict[str, Any]]" = queue.Queue(1)
        events.put(AppRequest(dict(request), dict(peer or {}), reply))
        try:
            return reply.get(timeout=ANSWER_WITHIN_S)
        except queue.Empty:
            return {"ok": False, "error": {"code": "internal_error", "message":
                                           "the daemon did not answer within {:g} s".format(
                                               ANSWER_WITHIN_S)}}

    return handle


def answer(switch: Any, req: AppRequest) -> None:
    """On the main loop: do what ``req`` asks and put the reply."""
    try:
        out: Dict[str, Any] = dict(_do(switch, req.request, req.peer))
        out["ok"] = True
    except AgentError as exc:
        out = {"ok": False, "error": {"code": exc.code, "message": exc.message}}
    except Exception as exc:  # noqa: BLE001 - the app gets an answer, the daemon goes on
        log.exception("app request %r failed", req.request.get("op"))
        out = {"ok": False, "error": {"code": "internal_error", "message": str(exc)[:300]}}
    try:
        req.reply.put_nowait(out)
    except queue.Full:
        pass


def _do(switch: Any, request: Dict[str, Any], peer: Dict[str, Any]) -> Dict[str, Any]:
    op = request.get("op")
    if op not in OPS:
        raise AgentError("bad_argument", "expected op {}, found {!r}".format(
            " | ".join(OPS), op if not isinstance(op, str) else op[:40]))
    if op == "list":
        return {"models": switch.models_list()}
    name, version = request.get("name"), request.get("version")
    by = "the app (uid {})".format(peer.get("uid", "?"))
    if op == "health":
        ok, detail = request.get("ok"), request.get("detail", "")
        if not isinstance(ok, bool) or not isinstance(detail, str):
            raise AgentError("bad_argument", "health expects ok: true|false and detail: a "
                             "string, found {!r}, {!r}".format(ok, type(detail).__name__))
        return switch.report_health(name, version, ok, detail[:500])
    if op == "commit":
        return switch.commit(name, version, by)
    if op == "rollback":
        return switch.rollback(name, version)
    if op in ("pin", "unpin"):
        if peer.get("uid") not in (0, os.getuid()):
            raise AgentError("app_not_allowed", "expected root or the service user to {} a "
                             "model, found uid {}".format(op, peer.get("uid")))
        return switch.pin(name, version) if op == "pin" else switch.unpin(name)
    if peer.get("uid") not in (0, os.getuid()):
        raise AgentError("app_not_allowed", "expected root or the service user to retry a "
                         "rejected version, found uid {}".format(peer.get("uid")))
    return switch.retry(name, version)


def allowed_ids(users: List[str], group: Optional[str]) -> Tuple[List[int], List[int]]:
    """``models.app_users`` / ``models.app_group`` -> (uids, gids). The service need not be a
    member of the group (the socket's ACL names it); only a name this system does not know
    stops the daemon."""
    uids = []
    for user in users:
        try:
            uids.append(int(user) if user.isdigit() else pwd.getpwnam(user).pw_uid)
        except KeyError:
            raise AgentError("bad_config", "models.app_users: expected users of this system "
                             "(or numeric uids), found {!r}".format(user))
    gids = []
    if group:
        try:
            gids.append(int(group) if group.isdigit() else grp.getgrnam(group).gr_gid)
        except KeyError:
            raise AgentError("bad_config", "models.app_group: expected a group of this system "
                             "(or a numeric gid), found {!r}".format(group))
    return uids, gids


def open_socket(cfg: Any, events: Any, donate: Any = None) -> Any:
    """The app socket at ``cfg.app_socket``, started; None (warned) where this installation
    has no ``agent.device.app.server``. ``donate(name, payload)``: keeps donated inputs."""
    import importlib

    try:  # imported by name: the module plugs in (another part of the device owns it)
        module: Any = importlib.import_module("agent.device.app.server")
    except ImportError as exc:
        log.warning("no app socket: %s", exc)
        return None
    uids, gids = allowed_ids(cfg.models.app_users, cfg.models.app_group)
    sock = module.AppSocket(cfg.app_socket, uids, gids, handler(events),
                            names_of=names_of(cfg.models.app_names or {}), donate=donate)
    sock.start()
    return sock


def names_of(app_names: Dict[str, Any]) -> Optional[Callable[[Dict[str, Any]], Set[str]]]:
    """``models.app_names`` ({user | "@group": [names]}) -> ``names_of(peer)``: the names the
    peer's uid and groups are given (empty: none); None when it is not configured."""
    if not app_names:
        return None
    by_uid: Dict[int, Set[str]] = {}
    by_gid: Dict[int, Set[str]] = {}
    for who, names in app_names.items():
        if who.startswith("@"):
            group = who[1:]
            gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
            by_gid.setdefault(gid, set()).update(names)
        else:
            uid = int(who) if who.isdigit() else pwd.getpwnam(who).pw_uid
            by_uid.setdefault(uid, set()).update(names)

    def lookup(peer: Dict[str, Any]) -> Set[str]:
        out = set(by_uid.get(peer.get("uid", -1), ()))
        for gid in peer.get("groups") or ():
            out.update(by_gid.get(gid, ()))
        return out

    return lookup
