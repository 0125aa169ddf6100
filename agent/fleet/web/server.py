"""The dashboard's HTTP server (stdlib ``http.server``, one thread per request): the pages of
``agent.fleet.web.pages``, Prometheus ``/metrics``, the vendored static files, and the
actions (pause, resume, cancel a rollout; pause, resume, retry, undo a deployment; accept or
reject a pending device; roll a device back), which need a token and are recorded in the audit
trail under the token's name (agent.fleet.database.audit).

Read-only unless a token is configured (``--dashboard-token-file``); an action without the right
token is refused (401), compared in constant time. Bodies are bounded (``MAX_BODY``); ids in
paths must be protocol ids; every response carries a strict Content-Security-Policy.
"""

import hmac
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import parse_qs, quote, urlsplit

from agent.errors import AgentError
from agent.fleet.database import audit, device_models, history
from agent.fleet.database.store import Store
from agent.fleet.deployments import deployments
from agent.fleet.rollouts import rollback, rollback_log
from agent.fleet.transfer.http_bounds import BoundedHTTPServer
from agent.fleet.web import metrics, operator_views, pages, views
from agent.wire import protocol

log = logging.getLogger("agent.fleet.web")
STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
MAX_BODY = 4096
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
TYPES = {".js": "application/javascript", ".css": "text/css", ".svg": "image/svg+xml",
         ".LICENSE": "text/plain; charset=utf-8"}
ROLLOUT_CONTROLS = ("pause", "resume", "cancel")

# rollback(device, command) -> publishes the rollback command
# (agent.fleet.rollouts.rollback.command)
Rollback = Callable[[str, Dict[str, Any]], None]


class Dashboard(object):
    """``Dashboard(store_url, host, port, token).start()``; ``url``; ``stop()``."""

    def __init__(self, store_url: str, host: str = "127.0.0.1", port: int = 0,
                 token: Optional[str] = None, rollback: Optional[Rollback] = None,
                 tokens: Optional[Dict[str, str]] = None) -> None:
        self.store = Store(store_url)  # its own connection: readers never wait on the loop
        history.ensure_schema(self.store)
        # name -> token: the audit trail names the operator whose token an action carried
        self.tokens = dict(tokens or {})
        if token:
            self.tokens.setdefault("dashboard", token)
        self.token = next(iter(self.tokens.values()), None)  # None: read-only
        self.rollback = rollback
        self.static = {n: os.path.join(STATIC, n) for n in os.listdir(STATIC)}
        app = self

        class Handler(_Handler):
            dashboard = app

        try:
            self.httpd = BoundedHTTPServer((host, int(port)), Handler)
        except OSError as exc:
            self.store.close()
            raise AgentError("bad_argument", "--dashboard {}:{}: cannot listen there: {}".format(
                host, port, exc.strerror or exc))
        self.thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return "http://{}:{}".format(host if isinstance(host, str) else host.decode(), port)

    def start(self) -> "Dashboard":
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="dashboard",
                                       daemon=True)
        self.thread.start()
        log.info("dashboard on %s (%s)", self.url,
                 "actions need the token" if self.token else "read-only")
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.store.close()

    # -- routes -------------------------------------------------------------------------------

    def get(self, path: str, query: Dict[str, str]) -> Tuple[int, str, bytes]:
        parts = [p for p in path.split("/") if p]
        actions = self.token is not None
        notice = _notice(query)
        if not parts:
            return _html(pages.fleet_page(views.fleet_rows(self.store), views.rollout_rows(
                self.store, states=pages.ACTIVE, failures=False), actions,
                views.deployment_rows(self.store), operator_views.fleet_labels(self.store)))
        if parts == ["metrics"]:
            body, ctype = metrics.exposition(self.store)
            return 200, ctype, body
        if parts == ["healthz"]:
            return 200, "text/plain; charset=utf-8", b"ok\n"
        if parts[0] == "static" and len(parts) == 2 and parts[1] in self.static:
            with open(self.static[parts[1]], "rb") as f:
                ext = os.path.splitext(parts[1])[1] or parts[1]
                return 200, TYPES.get(ext, "application/octet-stream"), f.read()
        if parts == ["pending"]:
            return _html(pages.pending_page(pending_rows(self.store), actions, notice))
        if parts == ["rollouts"]:  # a page of the newest (?limit=N&offset=M: older ones)
            limit = _int(query.get("limit"), views.MAX_ROLLOUTS, 1, 1000)
            offset = _int(query.get("offset"), 0, 0, 10 ** 9)
            return _html(pages.rollouts_page(views.rollout_rows(self.store, limit, offset),
                                             actions, limit, offset))
        if len(parts) == 2 and parts[0] == "rollouts" and protocol.valid_id(parts[1]):
            row = self.store.rollout(parts[1])
            if row is not None:
                dep = self.store.db.query("SELECT deployment_id FROM deployment_rollouts WHERE "
                                          "rollout_id = ?", (parts[1],))
                return _html(pages.rollout_page(views.rollout_detail(self.store, row), actions,
                                                notice, dep[0][0] if dep else None))
        page = self._operator_page(parts, query, actions, notice)
        if page is not None:
            return _html(page)
        if len(parts) == 2 and parts[0] == "devices" and protocol.valid_id(parts[1]):
            rows = views.fleet_rows(self.store, device=parts[1])
            if rows:
                from agent.fleet.admission import admission, identity_events

                identity_events.mark_viewed(self.store, parts[1])  # spared by eviction
                rows[0]["identity"] = admission.identity_view(self.store, parts[1])
                return _html(pages.device_page(
                    rows[0], views.job_rows(self.store, device=parts[1]),
                    history.series(self.store, parts[1]), actions, notice,
                    views.status_history(self.store, parts[1]),
                    rollback_log.of_device(self.store, parts[1]),
                    operator_views.device_labels(self.store, parts[1]),
                    operator_views.device_deployments(self.store, parts[1])))
        return 404, "text/html; charset=utf-8", pages.message_page(
            "Not found", "nothing at {}".format(path[:200]), actions)

    def _operator_page(self, parts: List[str], query: Dict[str, str], actions: bool,
                       notice: str) -> Optional[bytes]:
        """/deployments, /deployments/ID, /models, /labels, /audit (None: not one of them)."""
        if parts == ["deployments"]:
            live, ended = operator_views.deployment_lists(self.store)
            return pages.deployments_page(live, ended, actions)
        if len(parts) == 2 and parts[0] == "deployments" and protocol.valid_id(parts[1]):
            try:
                got = operator_views.deployment_detail(self.store, parts[1])
            except AgentError:
                return None
            return pages.deployment_page(got["deployment"], got["devices"], got["rollouts"],
                                         got["pins"], actions, notice, deployments.LIVE)
        if parts == ["models"]:
            return pages.models_page(operator_views.model_rows(self.store), actions)
        if parts == ["labels"]:
            return pages.labels_page(operator_views.label_rows(self.store),
                                     operator_views.pins(self.store), actions)
        if parts == ["audit"]:
            limit = _int(query.get("limit"), 500, 1, 5000)
            return pages.audit_page(operator_views.audit_rows(self.store, limit), limit,
                                    actions)
        return None

    def post(self, path: str, form: Dict[str, str]) -> Tuple[int, str, bytes]:
        """An action: (status, location or "", body). Every authorised action is recorded in
        the audit trail with its outcome (agent.fleet.database.audit); a refused token is only
        logged (a stranger must not be able to flood the trail)."""
        if self.token is None:
            raise _Refused(403, "unauthorized", "the dashboard is read-only: start fleet serve "
                           "with --dashboard-token-file to allow actions")
        given = form.get("token", "").encode("utf-8")
        actor = None
        for name, token in sorted(self.tokens.items()):  # each compared, in constant time
            if hmac.compare_digest(given, token.encode("utf-8")):
                actor = name
        if actor is None:
            log.warning("dashboard: POST %s refused: wrong token", path[:200])
            raise _Refused(401, "unauthorized", "the token given does not match the "
                           "service's --dashboard-token-file")
        parts = [p for p in path.split("/") if p]
        outcome, message = "internal_error", None
        try:
            result = self._act(parts, path, form, actor)
            outcome = "ok"
            return result
        except _Refused as exc:
            outcome, message = exc.code, exc.message
            raise
        except AgentError as exc:
            outcome, message = exc.code, exc.message
            raise
        finally:
            self._audit(actor, parts, form, outcome, message)

    def _audit(self, actor: str, parts: List[str], form: Dict[str, str], outcome: str,
               message: Optional[str]) -> None:
        # "/rollouts/ID/pause" -> action "rollouts pause", target ID (as the CLI names them)
        kind = parts[0] if parts else "-"
        action = "{} {}".format(kind, parts[-1]) if len(parts) >= 3 else kind
        try:
            audit.record(self.store, actor, "dashboard", action[:64],
                         parts[1] if len(parts) >= 2 else None,
                         {k: v for k, v in form.items() if k != "token"}, outcome, message)
        except Exception:  # noqa: BLE001 - the action's outcome stands; the log says why
            log.exception("dashboard: the audit record of %s failed", action[:64])

    def _act(self, parts: List[str], path: str, form: Dict[str, str], actor: str
             ) -> Tuple[int, str, bytes]:
        if len(parts) == 3 and parts[0] == "deployments" and protocol.valid_id(parts[1]) and \
                parts[2] in operator_views.DEPLOYMENT_ACTIONS:
            did = operator_views.control(self.store, parts[1], parts[2], actor)
            log.info("dashboard: %s of deployment %s recorded", parts[2], did)
            return 303, "/deployments/{}?done={}".format(quote(did), parts[2]), b""
        if len(parts) == 3 and parts[0] == "rollouts" and protocol.valid_id(parts[1]) and \
                parts[2] in ROLLOUT_CONTROLS:
            self.store.request_control(parts[1], parts[2])
            log.info("dashboard: %s of rollout %s requested", parts[2], parts[1])
            return 303, "/rollouts/{}?done={}".format(quote(parts[1]), parts[2]), b""
        if len(parts) == 3 and parts[0] == "devices" and protocol.valid_id(parts[1]) and \
                parts[2] == "rollback":
            model, name = form.get("model") or None, form.get("name") or None
            if name is None and not protocol.valid_sha256(model):
                raise AgentError("bad_argument", "rollback needs the model's name or its sha256 "
                                 "(64 hex digits), found {!r}".format((model or "")[:80]))
            device = self.store.device(parts[1])
            if device is None:
                raise AgentError("unknown_device", "no device {!r} in the fleet database"
                                 .format(parts[1]))
            if self.rollback is None:
                raise _Refused(503, "broker_unreachable", "this dashboard has no MQTT connection "
                               "to send the rollback command")
            models = device_models.load(self.store, [parts[1]]).get(parts[1])
            plan = rollback.plan_one(parts[1], device["status"], models, name=name, model=model)
            cmd = rollback.command(plan["model"], name=plan["name"])
            request_id = str(cmd["request_id"])
            held = {m["name"]: m for m in device_models.entries(device["status"], models)}
            job_id = (held.get(plan["name"] or "") or {}).get("job_id") or next(
                (m.get("job_id") for m in held.values() if m.get("model") == plan["model"]),
                None)
            rollback_log.record(self.store, [dict(
                plan, request_id=request_id, origin="dashboard",
                rollout_id=rollback_log.rollout_for(self.store, parts[1], plan["name"],
                                                    plan["model"], job_id=job_id))])
            from agent.fleet.deployments import pins  # governed: the rollback holds

            pins.rollback_pins(self.store, [dict(plan, device=parts[1], request_id=request_id)],
                               reason="rollback from the dashboard")
            self.rollback(parts[1], cmd)
            return 303, "/devices/{}?done=rollback&request={}".format(
                quote(parts[1]), quote(request_id)), b""
        if len(parts) == 3 and parts[0] == "pending" and protocol.valid_id(parts[1]) and \
                parts[2] in ("accept", "reject"):
            from agent.fleet.admission import admission

            if parts[2] == "accept":  # pins the key id the page showed, never another
                admission.accept(self.store, parts[1], seen_key_id=str(form.get("key_id") or ""))
            else:
                admission.reject(self.store, parts[1])
            log.info("dashboard: device %s %sed", parts[1], parts[2])
            return 303, "/pending?done={}".format(parts[2]), b""
        raise _Refused(404, "bad_argument", "no action at {}".format(path[:200]))


def pending_rows(store: Store) -> List[Dict[str, Any]]:
    """Devices with a key waiting for an operator (as ``fleet devices pending`` lists them)."""
    return [{"device": d, "state": r["state"], "key_id": r.get("pending_key_id"),
             "since": r.get("pending_since"),
             "board": ((r.get("pending_status") or {}).get("platform") or {}).get("board")}
            for d, r in sorted(store.device_keys().items()) if r.get("pending_key_id")]


NOTICES = {  # the page after an action says what was done; no text from the URL is shown
    "pause": "pause requested; the service applies it within a second",
    "resume": "resume requested; the service applies it within a second",
    "cancel": "cancel requested; the service applies it within a second",
    "accept": "device accepted: its key is pinned; the service admits it within seconds",
    "reject": "device rejected: its messages are dropped",
    "retry": "retry recorded: the service sends the failed devices their job again",
    "undo": "undo recorded: the deployment is back at its previous revision",
    "rollback": "rollback sent (request {}); the device's answer shows under Rollbacks below "
                "(refused: with its reason), its models what it runs now",
}


def _notice(query: Dict[str, str]) -> str:
    text = NOTICES.get(query.get("done", ""), "")
    request = query.get("request", "")
    return text.format(request if protocol.valid_id(request) else "-") if text else ""


def _int(text: Optional[str], default: int, low: int, high: int) -> int:
    """A bounded number from the query string; the default when absent or not a number."""
    try:
        return min(high, max(low, int(text or "")))
    except ValueError:
        return default


class _Refused(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _html(body: bytes) -> Tuple[int, str, bytes]:
    return 200, "text/html; charset=utf-8", body


class _Handler(BaseHTTPRequestHandler):
    dashboard: Dashboard
    timeout = 30  # a client that sends nothing does not hold its thread for ever
    server_version = "jetson-agent-fleet"
    sys_version = ""

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.client_address[0], *args)

    def _send(self, status: int, ctype: str, body: bytes, location: str = "") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Security-Policy", CSP)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Cache-Control", "no-store" if "html" in ctype else "max-age=300")
        if location:
            self.send_header("Location", location)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str) -> None:
        body = pages.message_page("Refused ({})".format(code), message,
                                  self.dashboard.token is not None)
        self._send(status, "text/html; charset=utf-8", body)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query[:2048]).items()}
        try:
            status, ctype, body = self.dashboard.get(url.path, query)
        except Exception as exc:  # a page must not take the service down
            log.exception("dashboard: GET %s failed", url.path[:200])
            self._error(500, "internal", "{}: {}".format(type(exc).__name__, exc))
            return
        self._send(status, ctype, body)

    do_HEAD = do_GET

    def do_POST(self) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            self.close_connection = True
            self._error(413, "too_large", "an action's form is at most {} bytes, found "
                        "Content-Length {}".format(MAX_BODY, self.headers.get(
                            "Content-Length")))
            return
        raw = self.rfile.read(length).decode("utf-8", "replace")
        form = {k: v[0] for k, v in parse_qs(raw).items()}
        try:
            status, location, body = self.dashboard.post(urlsplit(self.path).path, form)
        except _Refused as exc:
            self._error(exc.status, exc.code, exc.message)
            return
        except AgentError as exc:
            self._error(404 if exc.code.startswith("unknown") else 409, exc.code, exc.message)
            return
        self._send(status, "text/html; charset=utf-8", body, location)
