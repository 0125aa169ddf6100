"""The dashboard's HTML, rendered from the Jinja2 templates in ``templates/`` with autoescape
on: every value a device or an operator supplied is escaped where it is printed, so a page
cannot forget one (a device id, label or error message with HTML is a stored XSS otherwise).
Nothing is marked safe but the chart data, JSON whose ``<`` are escaped.

No inline scripts or styles (the server sends a strict Content-Security-Policy): charts read
their data from a ``<script type="application/json">`` block, progress is ``<progress>``.
Pages: the fleet, rollouts, one rollout, one device, pending devices, deployments, one
deployment, the model registry, labels and pins, the audit trail (docs/dashboard.md).
"""

import json
import os
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence
from urllib.parse import quote

import jinja2
import markupsafe

from agent.fleet.web import views

ACTIVE = ("running", "paused")
TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "templates")
NAV = (("fleet", "/", "Fleet"), ("deployments", "/deployments", "Deployments"),
       ("rollouts", "/rollouts", "Rollouts"), ("models", "/models", "Models"),
       ("labels", "/labels", "Labels & pins"), ("pending", "/pending", "Pending devices"),
       ("audit", "/audit", "Audit"), ("metrics", "/metrics", "Metrics"))


def age(ts: Any, now: Optional[float] = None) -> str:
    if views._num(ts) is None:
        return "-"
    s = max(0.0, (time.time() if now is None else now) - float(ts))
    if s < 90:
        return "{:.0f} s ago".format(s)
    if s < 5400:
        return "{:.0f} min ago".format(s / 60)
    if s < 172800:
        return "{:.1f} h ago".format(s / 3600)
    return "{:.0f} d ago".format(s / 86400)


def when(ts: Any) -> str:
    if views._num(ts) is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(ts)))


def _num(value: Any, fmt: str = "{:.3g}") -> str:
    return "-" if views._num(value) is None else fmt.format(value)


def _urlpart(value: Any) -> str:
    return quote(str(value), safe="")


def _reason(job: Mapping[str, Any]) -> str:
    return views.failure_reason(job) if job["state"] in views.FAILED_STATES else \
        str(job.get("note") or "")


def _environment() -> jinja2.Environment:
    # Optional keys of a row (a model's previous version, a job's figures) read as empty.
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), autoescape=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters.update(age=age, when=when, num=_num, urlpart=_urlpart, reason=_reason)
    return env


_ENV = _environment()


def render(template: str, title: str, active: str, actions: bool,
           refresh: Optional[int] = None, scripts: Sequence[str] = (), **values: Any) -> bytes:
    return _ENV.get_template(template).render(
        title=title, active=active, actions=actions, refresh=refresh, scripts=scripts,
        nav=NAV, **values).encode("utf-8")


def fleet_page(rows: List[Dict[str, Any]], rollouts: List[Dict[str, Any]],
               actions: bool, deployments: Sequence[Mapping[str, Any]] = (),
               labels: Optional[Mapping[str, Mapping[str, str]]] = None) -> bytes:
    health: Dict[str, int] = {}
    for r in rows:
        health[r["health"]] = health.get(r["health"], 0) + 1
    return render("fleet.html", "Fleet", "fleet", actions, refresh=5, rows=rows,
                  online=sum(1 for r in rows if r["online"]), health=health,
                  deployments=deployments, labels=labels or {},
                  running=[r for r in rollouts if r["state"] in ACTIVE])


def rollouts_page(rollouts: List[Dict[str, Any]], actions: bool,
                  limit: int = views.MAX_ROLLOUTS, offset: int = 0) -> bytes:
    return render("rollouts.html", "Rollouts", "rollouts", actions, refresh=5,
                  rollouts=rollouts, limit=limit, offset=offset)


def rollout_page(r: Dict[str, Any], actions: bool, notice: str = "",
                 deployment: Optional[str] = None) -> bytes:
    finished = views.FAILED_STATES + ("SUCCEEDED",)
    stage_done = [sum(n for k, n in s["counts"].items() if k in finished)
                  for s in r["stage_progress"]]
    return render("rollout.html", "Rollout " + r["rollout_id"], "rollouts", actions,
                  refresh=5 if r["state"] in ACTIVE else None, r=r, notice=notice,
                  active_states=ACTIVE, stage_done=stage_done, deployment=deployment)


CHARTS = (  # (id, title, metric prefix or key, suffix, scale)
    ("temp", "Temperature (C)", "temp_", "_c", 1.0),
    ("power", "Power (W)", "power_", "_mw", 0.001),
    ("load", "GPU / CPU load (%)", None, "_percent", 1.0),
    ("memory", "Memory in use (%)", None, "_fraction", 100.0),
)


def chart_data(series: Sequence[Any], jobs: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """What ``dashboard.js`` plots: one x axis per chart, named y series."""
    xs = [ts for ts, _ in series]
    charts: List[Dict[str, Any]] = []
    for cid, title, prefix, suffix, scale in CHARTS:
        keys = sorted({k for _, m in series for k in m
                       if k.endswith(suffix) and (prefix is None or k.startswith(prefix))})
        if not keys:
            continue
        charts.append({"id": cid, "title": title, "x": xs, "series": [
            {"label": k[len(prefix or ""):-len(suffix)] if prefix else k[:-len(suffix)],
             "y": [None if m.get(k) is None else round(m[k] * scale, 4) for _, m in series]}
            for k in keys]})
    done = [j for j in jobs if j["state"] == "SUCCEEDED" and j["throughput_qps"] is not None]
    if done:
        jx = [j["finished"] or j["updated"] for j in done]
        charts.append({"id": "throughput", "title": "Engine throughput (qps)", "x": jx,
                       "points": True, "series": [{"label": "throughput",
                                                   "y": [j["throughput_qps"] for j in done]}]})
        charts.append({"id": "latency", "title": "Engine latency (ms)", "x": jx,
                       "points": True, "series": [
                           {"label": "p50", "y": [j["latency_p50_ms"] for j in done]},
                           {"label": "p99", "y": [j["latency_p99_ms"] for j in done]}]})
    return {"charts": charts}


def script_json(value: Any) -> markupsafe.Markup:
    """JSON for a ``<script type="application/json">`` block: every ``<`` escaped, so no
    string in it can close the element (the one value these pages mark safe)."""
    return markupsafe.Markup(json.dumps(value, separators=(",", ":")).replace("<", "\\u003c"))


def device_page(row: Dict[str, Any], jobs: List[Dict[str, Any]], series: Sequence[Any],
                actions: bool, notice: str = "",
                statuses: Sequence[Mapping[str, Any]] = (),
                rollbacks: Sequence[Mapping[str, Any]] = (),
                labels: Optional[Mapping[str, str]] = None,
                deployments: Sequence[Mapping[str, Any]] = ()) -> bytes:
    return render("device.html", "Device " + row["device"], "fleet", actions,
                  scripts=("uPlot.min.css", "uPlot.iife.min.js", "dashboard.js"), row=row,
                  jobs=jobs, notice=notice, statuses=statuses, device_rollbacks=rollbacks,
                  models=row.get("models") or [], labels=labels or {},
                  deployments=deployments, chart_json=script_json(chart_data(series, jobs)))


def pending_page(rows: Sequence[Mapping[str, Any]], actions: bool, notice: str = "") -> bytes:
    """Devices waiting for admission (docs/security.md, "Admission"): their announced key
    and board, with accept / reject (the token) when actions are enabled. A pending device is
    no fleet member: it is on no other page."""
    return render("pending.html", "Pending devices", "pending", actions, refresh=10, rows=rows,
                  notice=notice)


def message_page(title: str, text: str, actions: bool) -> bytes:
    return render("message.html", title, "", actions, text=text)


def deployments_page(live: Sequence[Mapping[str, Any]], ended: Sequence[Mapping[str, Any]],
                     actions: bool) -> bytes:
    return render("deployments.html", "Deployments", "deployments", actions, refresh=10,
                  live=live, ended=ended)


# Columns of deployment_devices rows shown as they are, beside state and reason, when a row
# has them (attempts, next retry ... as the deployment runner records them).
BASE_DEVICE_COLUMNS = ("device", "state", "reason", "updated", "deployment_id", "device_id")


def deployment_page(d: Mapping[str, Any], devices: Sequence[Mapping[str, Any]],
                    rollouts: Sequence[str], pins: Sequence[Mapping[str, Any]],
                    actions: bool, notice: str = "", live_states: Sequence[str] = ()
                    ) -> bytes:
    extra: List[str] = []
    for r in devices:
        extra += [k for k in r if k not in BASE_DEVICE_COLUMNS and k not in extra and
                  isinstance(r[k], (str, int, float, type(None)))]
    return render("deployment.html", "Deployment " + str(d["deployment_id"]), "deployments",
                  actions, refresh=10, d=d, devices=devices, rollouts=rollouts, pins=pins,
                  notice=notice, extra_columns=extra[:6], live_states=live_states)


def models_page(models: Sequence[Any], actions: bool) -> bytes:
    """``models``: [(name, [version rows with deployments, devices, blobs])]."""
    return render("models.html", "Models", "models", actions, models=models)


def labels_page(rows: Sequence[Mapping[str, Any]], pins: Sequence[Mapping[str, Any]],
                actions: bool) -> bytes:
    return render("labels.html", "Labels & pins", "labels", actions, rows=rows, pins=pins)


def audit_page(rows: Sequence[Mapping[str, Any]], limit: int, actions: bool) -> bytes:
    return render("audit.html", "Audit trail", "audit", actions, rows=rows, limit=limit)
