"""Server-rendered HTML of the dashboard: the fleet, rollouts, one rollout, one device.

Every value shown came from a device or an operator: ``_e`` escapes all of it. No inline
scripts or styles (the server sends a strict Content-Security-Policy): charts read their data
from a ``<script type="application/json">`` block, progress is ``<progress>``/``<meter>``.
"""

import html
import json
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence
from urllib.parse import quote

from agent.fleet.web import views

ACTIVE = ("running", "paused")


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _u(value: str) -> str:
    return quote(value, safe="")


def _num(value: Any, fmt: str = "{:.3g}") -> str:
    return "-" if views._num(value) is None else fmt.format(value)


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


def page(title: str, body: str, active: str, actions: bool, refresh: Optional[int] = None,
         scripts: Sequence[str] = ()) -> bytes:
    nav = "".join('<a href="{}"{}>{}</a>'.format(href, ' class="here"' if key == active
                                                  else "", label)
                  for key, href, label in (("fleet", "/", "Fleet"),
                                           ("rollouts", "/rollouts", "Rollouts"),
                                           ("pending", "/pending", "Pending devices"),
                                           ("metrics", "/metrics", "Metrics")))
    mode = ('<span class="mode rw">actions enabled</span>' if actions
            else '<span class="mode ro">read-only</span>')
    head = ['<!doctype html><html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            '<title>{} - jetson-agent fleet</title>'.format(_e(title)),
            '<link rel="icon" href="/static/favicon.svg" type="image/svg+xml">',
            '<link rel="stylesheet" href="/static/dashboard.css">']
    if refresh:
        head.append('<meta http-equiv="refresh" content="{:d}">'.format(refresh))
    for src in scripts:
        if src.endswith(".css"):
            head.append('<link rel="stylesheet" href="/static/{}">'.format(src))
        else:
            head.append('<script src="/static/{}" defer></script>'.format(src))
    return "".join(head + [
        '</head><body><header><strong>jetson-agent fleet</strong><nav>{}</nav>{}</header>'
        .format(nav, mode), '<main><h1>{}</h1>'.format(_e(title)), body,
        '</main></body></html>']).encode("utf-8")


def table(header: Sequence[str], rows: Sequence[Sequence[str]], cls: str = "") -> str:
    """``rows`` are HTML already (cells escaped by the caller)."""
    if not rows:
        return '<p class="empty">none</p>'
    return '<table class="{}"><thead><tr>{}</tr></thead><tbody>{}</tbody></table>'.format(
        cls, "".join("<th>{}</th>".format(_e(h)) for h in header),
        "".join("<tr>{}</tr>".format("".join("<td>{}</td>".format(c) for c in r))
                for r in rows))


def badge(word: Any, title: str = "") -> str:
    w = str(word or "-")
    return '<span class="badge b-{}"{}>{}</span>'.format(
        _e(w.lower()), ' title="{}"'.format(_e(title)) if title else "", _e(w))


def _engine(row: Mapping[str, Any]) -> str:
    eng = row.get("active_engine")
    if not eng:
        return "-"
    return '{} <code title="{}">{}</code>'.format(_e(eng.get("precision") or ""),
                                                 _e(eng.get("engine_key")),
                                                 _e(str(eng.get("engine_key") or "")[:12]))


def models_cell(row: Mapping[str, Any]) -> str:
    """Every model the device holds: ``name@version (state)``, one per line; a model with a
    health problem says it."""
    items = row.get("models") or []
    if not items:
        return "-"
    return "<br>".join('<span class="model" title="{}">{}@{} ({}){}</span>'.format(
        _e("engine {} {}".format(m.get("engine_key") or "-", m.get("precision") or "")),
        _e(m["name"]), _e(m["version"]), _e(m["state"]),
        "" if m.get("health") in (None, "ok") else " " + badge("unhealthy", str(m["health"])))
        for m in items)


def rollout_state(r: Mapping[str, Any]) -> str:
    """The state badge, and "rolled back on N devices" when rollbacks succeeded."""
    extra = ""
    if r.get("rolled_back"):
        extra += " " + badge("rolled back", "{} device(s): {}".format(
            len(r["rolled_back"]), ", ".join(r["rolled_back"][:20])))
    if r.get("rollback_refused"):
        extra += " " + badge("rollback refused", ", ".join(r["rollback_refused"][:20]))
    return badge(r["state"], str(r.get("state_text") or "")) + extra


def rollbacks_table(items: Sequence[Mapping[str, Any]], device_column: bool = True) -> str:
    """Rollbacks sent and what the devices answered (a refusal's reason included)."""
    header = (["device"] if device_column else []) + ["sent", "from", "model", "rollout",
                                                      "request", "outcome"]
    rows = []
    for b in items:
        what = (b["name"] + ("@" + b["version"] if b.get("version") else "")) if b.get("name") \
            else (b.get("model") or "")[:12]
        rollout = '<a href="/rollouts/{}">{}</a>'.format(_u(b["rollout_id"]), _e(
            b["rollout_id"])) if b.get("rollout_id") else "-"
        rows.append(([('<a href="/devices/{}">{}</a>'.format(_u(b["device"]), _e(
            b["device"])))] if device_column else []) + [
            _e(when(b["sent"])), _e(b.get("origin") or "-"), _e(what), rollout,
            _e(b["request_id"]), _e(b["outcome"])])
    return table(header, rows, cls="rollbacks")


def progress(done: int, total: int) -> str:
    return '<progress value="{:d}" max="{:d}"></progress> {:d}/{:d}'.format(
        done, max(total, 1), done, total)


def counts_text(counts: Mapping[str, int]) -> str:
    return ", ".join("{} {}".format(n, badge(s)) for s, n in sorted(counts.items())) or "-"


def deployments_table(deps: Sequence[Mapping[str, Any]]) -> str:
    """Live deployments: model, selector, state and convergence (views.deployment_rows)."""
    return table(["deployment", "model", "selector", "state", "converged", "in progress",
                  "failed", "offline", "waiting"], [
        [_e(d["deployment_id"]), _e("{}@{}".format(d["name"], d["version"])),
         "<code>{}</code>".format(_e(d["selector"] or "(all)")), badge(d["state"]),
         progress(d["summary"]["converged"], d["summary"]["desired"]),
         str(d["summary"]["in_progress"]),
         _e(", ".join("{} {}".format(n, r) for r, n in sorted(
             d["summary"]["failed_by"].items())) or "0"),
         str(d["summary"]["offline"]), str(d["summary"]["waiting"])] for d in deps])


def fleet_page(rows: List[Dict[str, Any]], rollouts: List[Dict[str, Any]],
               actions: bool, deployments: Sequence[Mapping[str, Any]] = ()) -> bytes:
    online = sum(1 for r in rows if r["online"])
    health: Dict[str, int] = {}
    for r in rows:
        health[r["health"]] = health.get(r["health"], 0) + 1
    parts = ['<section class="cards"><div class="card"><b>{}</b> devices</div>'.format(
        len(rows)), '<div class="card"><b>{}</b> online</div>'.format(online)]
    parts += ['<div class="card">{} <b>{}</b></div>'.format(badge(w), n)
              for w, n in sorted(health.items())]
    parts.append("</section>")
    if deployments:
        parts.append("<h2>Deployments</h2>" + deployments_table(deployments))
    running = [r for r in rollouts if r["state"] in ACTIVE]
    if running:
        parts.append("<h2>Active rollouts</h2>")
        parts.append(table(["rollout", "state", "stage", "progress", "devices"], [
            ['<a href="/rollouts/{}">{}</a>'.format(_u(r["rollout_id"]), _e(r["rollout_id"])),
             badge(r["state"]), "{}/{}".format(max(r["current_stage"] + 1, 0),
                                               len(r["stages"])),
             progress(r["done"], r["total"]), counts_text(r["counts"])] for r in running]))
    parts.append("<h2>Devices</h2>")
    parts.append(table(
        ["device", "online", "board", "JetPack", "TensorRT", "backend", "models",
         "accuracy", "throughput (qps)", "latency p50 (ms)", "temp max (C)", "power (W)",
         "last seen", "health"],
        [['<a href="/devices/{}">{}</a>'.format(_u(r["device"]), _e(r["device"])),
          badge("online" if r["online"] else "offline"), _e(r["board"] or "-"),
          _e(r["jetpack"] or "-"), _e(r["tensorrt"] or "-"), _e(r["backend"] or "-"),
          models_cell(r), _e((r["engine_job"] or {}).get("accuracy_text") or "-"),
          _num((r["engine_job"] or {}).get("throughput_qps"), "{:.1f}"),
          _num((r["engine_job"] or {}).get("latency_p50_ms")),
          _num(r["max_temp_c"], "{:.1f}"),
          _num(None if r["power_mw"] is None else r["power_mw"] / 1000.0, "{:.2f}"),
          _e(age(r["last_seen"])), badge(r["health"], r["health_reason"])]
         for r in rows], cls="fleet"))
    return page("Fleet", "".join(parts), "fleet", actions, refresh=5)


def _failures(failures: Sequence[Mapping[str, Any]]) -> str:
    return table(["device", "stage", "state", "reason"], [
        ['<a href="/devices/{}">{}</a>'.format(_u(f["device"]), _e(f["device"])),
         _e(f["stage"]), badge(f["state"]), _e(f["reason"])] for f in failures],
        cls="failures")


def rollouts_page(rollouts: List[Dict[str, Any]], actions: bool,
                  limit: int = views.MAX_ROLLOUTS, offset: int = 0) -> bytes:
    rows = [['<a href="/rollouts/{}">{}</a>'.format(_u(r["rollout_id"]), _e(r["rollout_id"])),
             rollout_state(r), _e(r["model_name"] or "-"), _e(r["precision"] or "-"),
             "{}/{}".format(max(r["current_stage"] + 1, 0), len(r["stages"])),
             progress(r["done"], r["total"]), counts_text(r["counts"]), _e(when(r["created"])),
             _e(r["reason"] or "")] for r in rollouts]
    body = table(["rollout", "state", "model", "precision", "stage", "progress", "devices",
                  "created", "reason"], rows, cls="rollouts")
    links = []  # a page is at most ``limit`` rollouts; these lead to the others
    if offset:
        links.append('<a href="/rollouts?limit={:d}&amp;offset={:d}">newer rollouts</a>'.format(
            limit, max(0, offset - limit)))
    if len(rollouts) >= limit:
        links.append('<a href="/rollouts?limit={:d}&amp;offset={:d}">older rollouts</a>'.format(
            limit, offset + limit))
    if links:
        body += '<p class="pager">{}</p>'.format(" | ".join(links))
    failed = [r for r in rollouts if r["failures"]]
    for r in failed:
        body += '<h2>Failures of <a href="/rollouts/{}">{}</a></h2>'.format(
            _u(r["rollout_id"]), _e(r["rollout_id"])) + _failures(r["failures"])
    return page("Rollouts", body, "rollouts", actions, refresh=5)


def _action_form(url: str, label: str, fields: Optional[Mapping[str, str]] = None,
                 danger: bool = False) -> str:
    hidden = "".join('<input type="hidden" name="{}" value="{}">'.format(_e(k), _e(v))
                     for k, v in (fields or {}).items())
    return ('<form method="post" action="{}" class="action">{}<input type="password" '
            'name="token" placeholder="token" autocomplete="off" required>'
            '<button type="submit"{}>{}</button></form>').format(
                _e(url), hidden, ' class="danger"' if danger else "", _e(label))


def rollout_page(r: Dict[str, Any], actions: bool, notice: str = "") -> bytes:
    parts = ['<p class="notice">{}</p>'.format(_e(notice))] if notice else []
    parts.append('<dl class="facts"><dt>state</dt><dd>{}</dd><dt>model</dt><dd>{} <code>{}'
                 '</code> {}</dd><dt>precision</dt><dd>{}</dd><dt>created</dt><dd>{}</dd>'
                 '<dt>finished</dt><dd>{}</dd><dt>reason</dt><dd>{}</dd><dt>progress</dt>'
                 '<dd>{}</dd></dl>'.format(
                     rollout_state(r), _e(r["model_name"] or "-"),
                     _e((r["model_sha"] or "")[:12]), _e(r.get("model_file") or ""),
                     _e(r["precision"] or "-"),
                     _e(when(r["created"])), _e(when(r["finished"])), _e(r["reason"] or "-"),
                     progress(r["done"], r["total"])))
    if actions and r["state"] in ACTIVE:
        base = "/rollouts/{}/".format(_u(r["rollout_id"]))
        parts.append('<div class="actions">{}{}</div>'.format(
            _action_form(base + ("resume" if r["paused"] else "pause"),
                         "Resume" if r["paused"] else "Pause"),
            _action_form(base + "cancel", "Cancel rollout", danger=True)))
    parts.append("<h2>Stages</h2>")
    parts.append(table(["stage", "devices", "progress", "states"], [
        [("&#9654; " if i == r["current_stage"] and r["state"] in ACTIVE else "") + str(i + 1),
         str(s["devices"]), progress(sum(n for k, n in s["counts"].items()
                                         if k in views.FAILED_STATES + ("SUCCEEDED",)),
                                     s["devices"]),
         counts_text(s["counts"])] for i, s in enumerate(r["stage_progress"])], cls="stages"))
    parts.append("<h2>Devices</h2>")
    parts.append(table(["device", "stage", "state", "job stage", "precision", "accuracy",
                        "throughput (qps)", "latency p50 (ms)", "reason"], [
        ['<a href="/devices/{}">{}</a>'.format(_u(j["device"]), _e(j["device"])),
         str(j["stage"]), badge(j["state"]), _e(j["job_stage"] or "-"),
         _e(j["precision"] or "-"), _e(j["accuracy_text"]),
         _num(j["throughput_qps"], "{:.1f}"), _num(j["latency_p50_ms"]),
         _e(views.failure_reason(j) if j["state"] in views.FAILED_STATES else j["note"])]
        for j in r["jobs"]], cls="jobs"))
    if r["failures"]:
        parts.append("<h2>Failures</h2>" + _failures(r["failures"]))
    if r.get("rollbacks"):
        parts.append("<h2>Rollbacks</h2>" + rollbacks_table(r["rollbacks"]))
    return page("Rollout " + r["rollout_id"], "".join(parts), "rollouts", actions,
                refresh=5 if r["state"] in ACTIVE else None)


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


def device_page(row: Dict[str, Any], jobs: List[Dict[str, Any]], series: Sequence[Any],
                actions: bool, notice: str = "",
                statuses: Sequence[Mapping[str, Any]] = (),
                rollbacks: Sequence[Mapping[str, Any]] = ()) -> bytes:
    parts = ['<p class="notice">{}</p>'.format(_e(notice))] if notice else []
    eng = row.get("active_engine") or {}
    parts.append('<dl class="facts"><dt>online</dt><dd>{}</dd><dt>health</dt><dd>{} {}</dd>'
                 '<dt>board</dt><dd>{}</dd><dt>JetPack / TensorRT</dt><dd>{} / {}</dd>'
                 '<dt>backend</dt><dd>{}</dd><dt>agent</dt><dd>{}</dd><dt>newest engine</dt>'
                 '<dd>{} (job {})</dd><dt>last seen</dt><dd>{}</dd></dl>'.format(
                     badge("online" if row["online"] else "offline"), badge(row["health"]),
                     _e(row["health_reason"]), _e(row["board"] or "-"),
                     _e(row["jetpack"] or "-"), _e(row["tensorrt"] or "-"),
                     _e(row["backend"] or "-"), _e(row["agent_version"] or "-"), _engine(row),
                     _e(eng.get("job_id") or "-"), _e(age(row["last_seen"]))))
    ident = row.get("identity") or {}
    if ident:  # admission: the pinned key and any impostor events (docs/security.md)
        last = ident.get("last_impostor") or {}
        parts.append('<dl class="facts identity"><dt>admission</dt><dd>{}</dd><dt>pinned key'
                     '</dt><dd><code>{}</code></dd><dt>impostor events</dt><dd>{}{}</dd></dl>'
                     .format(badge(str(ident.get("state") or "-")),
                             _e(ident.get("key_id") or "-"),
                             _e(ident.get("impostor_events") or 0),
                             " (last: key <code>{}</code>, {})".format(
                                 _e(last.get("key_id")), _e(when(last.get("ts"))))
                             if last else ""))
    models = row.get("models") or []
    parts.append("<h2>Models</h2>")
    parts.append(table(["model", "version", "state", "previous", "precision", "engine",
                        "job", "activated", "health"] + (["action"] if actions else []), [
        [_e(m["name"]), _e(m["version"]), badge(m["state"]), _e(m.get("previous") or "-"),
         _e(m.get("precision") or "-"), '<code title="{}">{}</code>'.format(
             _e(m.get("engine_key")), _e(str(m.get("engine_key") or "-")[:12])),
         _e(m.get("job_id") or "-"), _e(when(m.get("activated"))),
         badge("ok" if m["health"] == "ok" else "unhealthy", str(m["health"])) +
         ("" if m["health"] == "ok" else " " + _e(m["health"]))] +
        ([_action_form("/devices/{}/rollback".format(_u(row["device"])),
                       "Roll back to the previous " + ("engine" if m.get("legacy")
                                                       else "version"),
                       {"name": str(m["name"])} if row.get("named_models") else
                       {"model": str(m.get("model") or "")}, danger=True)]
         if actions and (row.get("named_models") or m.get("model")) else
         ([""] if actions else []))
        for m in models], cls="models"))
    if rollbacks:
        parts.append("<h2>Rollbacks</h2>" + rollbacks_table(rollbacks, device_column=False))
    data = json.dumps(chart_data(series, jobs), separators=(",", ":"))
    # JSON inside <script>: "</" must not close the element.
    parts.append('<script type="application/json" id="chart-data">{}</script>'.format(
        data.replace("</", "<\\/")))
    parts.append('<h2>Telemetry</h2><section id="charts" class="charts"></section>')
    parts.append("<h2>Jobs</h2>")
    parts.append(table(["rollout", "job", "state", "job stage", "precision", "accuracy",
                        "throughput (qps)", "latency p50 (ms)", "finished", "reason"], [
        ['<a href="/rollouts/{}">{}</a>'.format(_u(j["rollout_id"]), _e(j["rollout_id"])),
         _e(j["job_id"]), badge(j["state"]), _e(j["job_stage"] or "-"),
         _e(j["precision"] or "-"), _e(j["accuracy_text"]),
         _num(j["throughput_qps"], "{:.1f}"), _num(j["latency_p50_ms"]),
         _e(when(j["finished"])),
         _e(views.failure_reason(j) if j["state"] in views.FAILED_STATES else j["note"])]
        for j in reversed(jobs)], cls="jobs"))
    parts.append("<h2>Job status changes</h2>")
    parts.append(table(["received", "rollout", "job", "version", "state", "stage"], [
        [_e(when(h["received"])), '<a href="/rollouts/{}">{}</a>'.format(
            _u(h["rollout_id"]), _e(h["rollout_id"])), _e(h["job_id"]), _e(h["version"]),
         badge(h["state"]), _e(h["stage"] or "-")] for h in statuses], cls="history"))
    return page("Device " + row["device"], "".join(parts), "fleet", actions,
                scripts=("uPlot.min.css", "uPlot.iife.min.js", "dashboard.js"))


def pending_page(rows: Sequence[Mapping[str, Any]], actions: bool, notice: str = "") -> bytes:
    """Devices waiting for admission (docs/security.md, "Admission"): their announced key
    and board, with accept / reject (the token) when actions are enabled. A pending device is
    no fleet member: it is on no other page."""
    parts = ['<p class="notice">{}</p>'.format(_e(notice))] if notice else []
    parts.append("<p>Devices whose signed birth reached the controller and that no policy "
                 "admitted. Check the key id against the device's <code>device.key.pub"
                 "</code> before accepting; <code>fleet devices pending|accept|reject</code> "
                 "do the same.</p>")
    parts.append(table(
        ["device", "state", "key id", "board", "waiting since"] + (
            ["accept", "reject"] if actions else []),
        [[_e(r["device"]), badge(r["state"]), "<code>{}</code>".format(_e(r["key_id"])),
          _e(r["board"] or "-"), _e(age(r["since"]))] + (
            [_action_form("/pending/{}/accept".format(_u(r["device"])), "accept",
                          {"key_id": str(r["key_id"])}),
             _action_form("/pending/{}/reject".format(_u(r["device"])), "reject",
                          danger=True)] if actions else [])
         for r in rows], cls="pending"))
    return page("Pending devices", "".join(parts), "pending", actions, refresh=10)


def message_page(title: str, text: str, actions: bool) -> bytes:
    return page(title, '<p class="notice">{}</p><p><a href="/">back to the fleet</a></p>'
                .format(_e(text)), "", actions)
