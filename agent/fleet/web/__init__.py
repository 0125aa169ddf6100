"""The fleet service's web side: the dashboard and ``/metrics`` (``server``, ``pages``), the
read models they show (``views``), the Prometheus collector (``metrics``), and how ``fleet
serve`` mounts them (``add_args``, ``mount``). Static files: ``static/`` holds
uPlot 1.6.32 (MIT, ``uPlot.LICENSE``) as published on npm, and the dashboard's own CSS/JS.

May import: every other subpackage of ``agent.fleet`` (``database``, ``rollouts``,
``deployments``, ``admission``, ``transfer``) and the base modules, plus ``wire``, ``engines``,
``precision``, ``platform``, ``calib``; none of them imports ``web``. Not ``service`` or
``mqtt_edge``: the service hands the dashboard what it needs.
"""

import argparse
import logging
import os
from typing import Any, Dict, Optional, Tuple

from agent.errors import AgentError

log = logging.getLogger("agent.fleet.web")


def add_args(p: argparse.ArgumentParser) -> None:
    from agent.fleet.database import history

    g = p.add_argument_group("dashboard and metrics")
    g.add_argument("--dashboard", metavar="HOST:PORT", default=os.environ.get(
        "JETSON_AGENT_FLEET_DASHBOARD"), help="serve the dashboard and Prometheus /metrics here "
        "(e.g. :8480, loopback only; 0.0.0.0:8480 for every interface, with a warning; off "
        "by default)")
    g.add_argument("--dashboard-token-file", metavar="F", help="a file holding the token that "
                   "enables dashboard actions (pause/resume/cancel, rollback); without it the "
                   "dashboard is read-only")
    g.add_argument("--telemetry-retention", type=float, default=history.RETENTION_S / 86400,
                   metavar="DAYS", help="how long telemetry history is kept (default "
                   "%(default)s days; also capped at {} samples per device)".format(
                       history.MAX_ROWS_PER_DEVICE))


def parse_hostport(text: str) -> Tuple[str, int]:
    """``--dashboard HOST:PORT``: loopback unless a host is given
    (agent.fleet.transfer.http_bounds)."""
    from agent.fleet.transfer.http_bounds import listen_address

    return listen_address(text, "--dashboard")


def read_token(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    try:
        with open(path, "r", encoding="utf-8") as f:
            token = f.read(4096).strip()
    except OSError as exc:
        raise AgentError("file_not_found", "--dashboard-token-file {}: {}".format(
            path, exc.strerror or exc))
    if len(token) < 16:
        raise AgentError("bad_argument", "--dashboard-token-file {}: the token must be at least 16 "
                         "characters, found {}".format(path, len(token)))
    return token


def mount(args: argparse.Namespace, url: str, service: Any) -> Optional[Any]:
    """Record telemetry history on ``service`` and, with ``--dashboard``, start the dashboard
    (returns it; ``stop()`` at exit)."""
    from agent.fleet.database import history
    from agent.fleet.web.server import Dashboard
    from agent.wire import protocol

    days = getattr(args, "telemetry_retention", history.RETENTION_S / 86400)
    if days is not None and days > 0:
        recorder = history.TelemetryHistory(service.store, retention_s=days * 86400.0)
        service.on_telemetry = recorder.record
    if not getattr(args, "dashboard", None):
        return None
    host, port = parse_hostport(args.dashboard)

    def send_rollback(device: str, cmd: Dict[str, Any]) -> None:
        service.conn.client.publish(service.conn.topics.commands(device),
                                    protocol.encode(cmd), qos=1)

    dash = Dashboard(url, host, port, read_token(args.dashboard_token_file), send_rollback)
    return dash.start()
