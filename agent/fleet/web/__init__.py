"""The fleet service's web side: the dashboard and ``/metrics`` (``server``, ``pages``), the
read models they show (``views``), the Prometheus collector (``metrics``), and how ``fleet
serve`` mounts them (``mount``). Static files: ``static/`` holds
uPlot 1.6.32 (MIT, ``uPlot.LICENSE``) as published on npm, and the dashboard's own CSS/JS.

May import: every other subpackage of ``agent.fleet`` (``database``, ``rollouts``,
``deployments``, ``admission``, ``transfer``) and the base modules, plus ``wire``, ``engines``,
``precision``, ``platform``, ``calib``; none of them imports ``web``. Not ``service`` or
``mqtt_edge``: the service hands the dashboard what it needs.
"""

import logging
import re
from typing import Any, Dict, Optional, Tuple

from agent.errors import AgentError

log = logging.getLogger("agent.fleet.web")


def parse_hostport(text: str) -> Tuple[str, int]:
    """``--dashboard HOST:PORT``: loopback unless a host is given
    (agent.fleet.transfer.http_bounds)."""
    from agent.fleet.transfer.http_bounds import listen_address

    return listen_address(text, "--dashboard")


def read_token(path: Optional[str]) -> Optional[str]:
    """The first token of the file (``read_tokens``)."""
    tokens = read_tokens(path)
    return next(iter(tokens.values())) if tokens else None


TOKEN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}\Z")
MAX_TOKENS = 100
DEFAULT_TOKEN_NAME = "dashboard"


def read_tokens(path: Optional[str]) -> Optional[Dict[str, str]]:
    """name -> token. The file holds one token (named ``dashboard``), or one ``NAME:TOKEN``
    per line, one per operator, so that the audit trail names who acted; ``#`` comments."""
    if not path:
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            text = f.read(65536)
    except OSError as exc:
        raise AgentError("file_not_found", "--dashboard-token-file {}: {}".format(
            path, exc.strerror or exc))
    tokens: Dict[str, str] = {}
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip()[0] == "#"]
    for n, line in enumerate(lines[:MAX_TOKENS + 1], 1):
        name, _, rest = line.partition(":")
        if rest and TOKEN_NAME.match(name):
            token = rest.strip()
        else:
            name, token = DEFAULT_TOKEN_NAME, line
        if len(token) < 16:
            raise AgentError("bad_argument", "--dashboard-token-file {}: the token must be at "
                             "least 16 characters, found {} (line {})".format(
                                 path, len(token), n))
        if name in tokens or token in tokens.values() or len(tokens) >= MAX_TOKENS:
            raise AgentError("bad_argument", "--dashboard-token-file {}: expected at most {} "
                             "tokens, each name and token once, found {!r} again or more (line "
                             "{})".format(path, MAX_TOKENS, name, n))
        tokens[name] = token
    if not tokens:
        raise AgentError("bad_argument", "--dashboard-token-file {}: the token must be at least "
                         "16 characters, found 0".format(path))
    return tokens


def mount(url: str, service: Any, dashboard: Optional[str] = None,
          token_file: Optional[str] = None, retention_days: Optional[float] = None
          ) -> Optional[Any]:
    """Record telemetry history on ``service`` (kept ``retention_days``; default
    history.RETENTION_S) and, with ``dashboard`` (HOST:PORT), start the dashboard (returns it;
    ``stop()`` at exit)."""
    from agent.fleet.database import history
    from agent.fleet.web.server import Dashboard
    from agent.wire import protocol

    days = history.RETENTION_S / 86400 if retention_days is None else retention_days
    if days > 0:
        recorder = history.TelemetryHistory(service.store, retention_s=days * 86400.0)
        service.on_telemetry = recorder.record
    if not dashboard:
        return None
    host, port = parse_hostport(dashboard)

    def send_rollback(device: str, cmd: Dict[str, Any]) -> None:
        service.conn.client.publish(service.conn.topics.commands(device),
                                    protocol.encode(cmd), qos=1)

    dash = Dashboard(url, host, port, None, send_rollback,
                     tokens=read_tokens(token_file))
    return dash.start()
