"""Read models over the fleet database for the dashboard and ``/metrics``: the fleet (one row
per device with its platform, every model it holds (``name@version (state)``, from its models
message or, for an older daemon, its active engines), the newest engine's accuracy and
throughput, health), rollouts with per-stage progress, the reason of every failure and the
rollbacks recorded against them, and one device's job history. Read-only: nothing here writes.

Everything a device reported is untrusted text: callers escape it (HTML) or bound it (labels).
"""

import json
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from agent.fleet.database import device_models
from agent.fleet.database.store import Store
from agent.fleet.rollouts import rollback_log
from agent.fleet.rollouts.report import accuracy_summary
from agent.fleet.rollouts.rollout import SEARCH_SUFFIX

FAILED_STATES = ("FAILED", "REJECTED", "TIMED_OUT", "CANCELED")
HOT_C = 85.0  # a Jetson throttles near 90-100 C; above this the dashboard says "hot"
STALE_S = 120.0  # online but no telemetry for this long: "stale"
MAX_ROLLOUTS = 200  # the rollouts page lists the newest ones (all: fleet rollouts ls)


def _num(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def temperatures(metrics: Any) -> Dict[str, float]:
    """sensor -> degrees C from ``temp_<sensor>_c`` metrics."""
    out: Dict[str, float] = {}
    for key, value in (metrics or {}).items() if isinstance(metrics, Mapping) else ():
        v = _num(value)
        if v is not None and isinstance(key, str) and key.startswith("temp_") and \
                key.endswith("_c"):
            out[key[5:-2]] = v
    return out


def power_rails(metrics: Any) -> Dict[str, float]:
    """rail -> milliwatts from ``power_<rail>_mw`` metrics (``total`` included)."""
    out: Dict[str, float] = {}
    for key, value in (metrics or {}).items() if isinstance(metrics, Mapping) else ():
        v = _num(value)
        if v is not None and isinstance(key, str) and key.startswith("power_") and \
                key.endswith("_mw"):
            out[key[6:-3]] = v
    return out


def _dict(value: Any) -> Dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _job_query(store: Store, devices: Optional[Sequence[str]] = None,
               rollouts: Optional[Sequence[str]] = None,
               states: Optional[Sequence[str]] = None,
               columns: str = "j.stage, j.state, j.data, j.updated, r.created"
               ) -> List[Tuple[Any, ...]]:
    """Raw job rows (rollout, device, ``columns``; oldest rollout first), not decoded: callers
    decode only the ones they show."""
    sql = ("SELECT j.rollout_id, j.device_id, {} FROM jobs j JOIN rollouts r ON "
           "r.rollout_id = j.rollout_id WHERE 1 = 1".format(columns))
    params: List[Any] = []
    for column, values in (("j.device_id", devices), ("j.rollout_id", rollouts),
                           ("j.state", states)):
        if values is not None:
            sql += " AND {} IN ({})".format(column, ", ".join("?" for _ in values) or "NULL")
            params += list(values)
    return store.db.query(sql + " ORDER BY r.created, j.rollout_id", params)


def job_rows(store: Store, device: Optional[str] = None, rollout_id: Optional[str] = None
             ) -> List[Dict[str, Any]]:
    """Per-device jobs (of one device, one rollout or all; oldest rollout first), with result
    and error."""
    return [_job(*r) for r in _job_query(store, None if device is None else [device],
                                         None if rollout_id is None else [rollout_id])]


def _jobs_of(store: Store, keys: Sequence[Tuple[str, str]]
             ) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """The decoded jobs of these (rollout, device) pairs: a query per rollout they are in."""
    by_rollout: Dict[str, List[str]] = {}
    for rid, dev in sorted(set(keys)):
        by_rollout.setdefault(rid, []).append(dev)
    out = {}
    for rid, devs in by_rollout.items():
        for i in range(0, len(devs), 500):
            for raw in _job_query(store, devs[i:i + 500], [rid]):
                out[(raw[0], raw[1])] = _job(*raw)
    return out


def _job(rid: str, dev: str, stage: int, state: str, data: Optional[str], updated: Any,
         created: Any) -> Dict[str, Any]:
    loaded = json.loads(data) if data else {}
    item: Dict[str, Any] = loaded if isinstance(loaded, dict) else {}
    result = _dict(item.get("result"))
    error = _dict(item.get("error"))
    latency = _dict(result.get("latency_ms"))
    accuracy = result.get("accuracy")
    if accuracy is None and isinstance(error.get("details"), dict):
        accuracy = error["details"].get("accuracy")
    # The device's live check on the app's own inputs (a named model's result, or the figures
    # of its refusal, live_check_failed).
    live = _dict(result.get("live_check")) or _dict(_dict(error.get("details")).get("live_check"))
    return {
        "rollout_id": rid, "device": dev, "stage": int(stage) + 1, "state": state,
        "job_id": item.get("job_id") or rid, "phase": item.get("phase"),
        "job_stage": item.get("job_stage"), "progress": item.get("progress"),
        "precision": result.get("precision"),
        "throughput_qps": _num(result.get("throughput_qps")),
        "latency_p50_ms": _num(latency.get("median", latency.get("p50"))),
        "latency_p99_ms": _num(latency.get("p99")),
        "accuracy": accuracy if isinstance(accuracy, dict) else None,
        "accuracy_text": accuracy_summary(accuracy if isinstance(accuracy, dict) else None) +
        live_text(live),
        "live_check": live or None,
        "engine_key": result.get("engine_key"), "cache_hit": result.get("cache_hit"),
        "error_code": error.get("code"), "error_message": error.get("message"),
        "note": item.get("note") or "", "started": _num(item.get("started")),
        "finished": _num(item.get("finished")), "updated": _num(updated),
        "created": _num(created)}


def live_text(live: Mapping[str, Any]) -> str:
    """The accuracy cell's tail for the live check: "; live top-1 98.4% on 64" or "" """
    agreement, error = _num(live.get("agreement")), _num(live.get("error"))
    if live.get("skipped") or (agreement is None and error is None):
        return ""
    figure = "top-1 {:.1%}".format(agreement) if agreement is not None else \
        "{}|err| {:.3g}".format(live.get("error_stat") or "", error or 0.0)
    return "; live {} on {}{}".format(figure, live.get("samples"),
                                      "" if live.get("passed", False) else " FAIL")


def failure_reason(job: Mapping[str, Any]) -> str:
    """Why a device's job did not succeed, in one line."""
    parts = [str(job.get("error_code") or ""), str(job.get("error_message") or ""),
             str(job.get("note") or "")]
    text = ": ".join(p for p in parts[:2] if p)
    if parts[2]:
        text = "{} ({})".format(text, parts[2]) if text else parts[2]
    return text or "no reason reported"


def _active_engine(status: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    engines = [e for e in (status.get("active_engines") or []) if isinstance(e, dict)]
    if not engines:
        return None
    return max(engines, key=lambda e: _num(e.get("activated")) or 0.0)


def health(device: Mapping[str, Any], last_job: Optional[Mapping[str, Any]],
           now: Optional[float] = None, models: Sequence[Mapping[str, Any]] = ()
           ) -> Tuple[str, str]:
    """(word, why): offline, stale, hot, unhealthy (a model the device holds has a health
    problem: its models message says which), failing or ok."""
    now = time.time() if now is None else now
    if not device.get("online"):
        return "offline", str(device.get("reason") or "no birth status since its Will")
    temps = temperatures((device.get("telemetry") or {}).get("metrics"))
    seen = _num(device.get("telemetry_ts")) or _num(device.get("last_seen")) or 0.0
    if device.get("telemetry") and now - seen > STALE_S:
        return "stale", "no telemetry for {:.0f} s".format(now - seen)
    if temps and max(temps.values()) >= HOT_C:
        hot = max(temps, key=lambda k: temps[k])
        return "hot", "{} at {:.0f} C".format(hot, temps[hot])
    problems = device_models.problems(models)
    if problems:
        return "unhealthy", "; ".join(problems)[:1024]
    if last_job is not None and last_job.get("state") in FAILED_STATES:
        return "failing", "last job {}: {}".format(last_job["state"], failure_reason(last_job))
    return "ok", ""


def _engine_jobs(store: Store, done: Dict[str, List[Tuple[str, str]]],
                 actives: Mapping[str, Optional[Mapping[str, Any]]],
                 jobs: Dict[Tuple[str, str], Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """device -> of its SUCCEEDED jobs (``done``: (rollout, device), newest first): the one
    that activated its engine (it carries the engine's figures), else the newest that measured
    throughput. Only what decides is decoded (into ``jobs``): a job id is its rollout's id or
    that id and a suffix (agent.fleet.rollouts.rollout), so only those rollouts can hold the first;
    the newest job usually measured throughput, the older ones are read only when it did not."""
    wanted = {d: str((a or {}).get("job_id") or "") for d, a in actives.items()}
    homes = {d: {j, j[:-len(SEARCH_SUFFIX)] if j.endswith(SEARCH_SUFFIX) else j}
             for d, j in wanted.items() if j}
    match = {d: [k for k in keys if k[0] in homes.get(d, ())] for d, keys in done.items()}
    jobs.update(_jobs_of(store, [k for d, keys in done.items() for k in match[d] + keys[:1]]))
    older = [d for d in done if jobs[done[d][0]]["throughput_qps"] is None]
    jobs.update(_jobs_of(store, [k for d in older for k in done[d][1:]]))
    out = {}
    for d, keys in done.items():
        found = next((jobs[k] for k in match[d] if jobs[k]["job_id"] == wanted[d]), None) or \
            next((jobs[k] for k in keys if jobs[k]["throughput_qps"] is not None), None)
        if found is not None:
            out[d] = found
    return out


def ended_deployment_rollouts(store: Store) -> Set[str]:
    """The rollouts of deployments that were removed or superseded."""
    return {str(r[0]) for r in store.db.query(
        "SELECT r.rollout_id FROM deployment_rollouts r JOIN deployments d ON "
        "d.deployment_id = r.deployment_id WHERE d.state IN ('removed', 'superseded')")}


def fleet_rows(store: Store, now: Optional[float] = None, device: Optional[str] = None
               ) -> List[Dict[str, Any]]:
    """One row per device, sorted by id (``device``: only that one, [] if unknown). Only the
    jobs shown are decoded (each device's last one and its engine's), not its history."""
    if device is None:
        devices = store.devices()
    else:
        one = store.device(device)
        devices = [one] if one is not None else []
    actives = {d["device"]: _active_engine(d.get("status") or {}) for d in devices}
    held = device_models.load(store, None if device is None else [device])
    last: Dict[str, Tuple[str, str]] = {}
    done: Dict[str, List[Tuple[str, str]]] = {}  # device -> SUCCEEDED jobs, newest first
    for rid, dev, state in _job_query(store, None if device is None else [device],
                                      columns="j.state"):
        if dev in actives:
            last[dev] = (rid, dev)
            if state == "SUCCEEDED":
                done.setdefault(dev, []).append((rid, dev))
    for keys in done.values():
        keys.reverse()
    jobs = _jobs_of(store, list(last.values()))
    engines = _engine_jobs(store, done, actives, jobs)
    moot = ended_deployment_rollouts(store) if last else set()
    out = []
    for dev in devices:
        status = dev.get("status") or {}
        platform = dev.get("platform") or status.get("platform") or {}
        last_job = jobs[last[dev["device"]]] if dev["device"] in last else None
        metrics = (dev.get("telemetry") or {}).get("metrics") or {}
        temps = temperatures(metrics)
        models = device_models.entries(status, held.get(dev["device"]))
        # a failed job of a deployment since removed or superseded asks nothing of it now
        word, why = health(dev, None if last_job is not None and last_job["rollout_id"] in moot
                           else last_job, now, models)
        out.append({
            "device": dev["device"], "online": dev["online"], "board": dev.get("board"),
            "jetpack": platform.get("jetpack"), "tensorrt": platform.get("tensorrt"),
            "backend": platform.get("backend"), "agent_version": status.get("agent_version"),
            "active_engine": actives[dev["device"]], "engine_job": engines.get(dev["device"]),
            "models": models, "models_text": device_models.text(models),
            "named_models": device_models.named(status),
            "last_job": last_job,
            "last_seen": dev.get("last_seen"), "health": word, "health_reason": why,
            "metrics": metrics, "max_temp_c": max(temps.values()) if temps else None,
            "power_mw": power_rails(metrics).get("total")})
    return out


def rollout_rows(store: Store, limit: Optional[int] = MAX_ROLLOUTS, offset: int = 0,
                 states: Optional[Sequence[str]] = None, failures: bool = True
                 ) -> List[Dict[str, Any]]:
    """The newest ``limit`` rollouts (from ``offset``; ``states``: only those), newest first,
    with their failures (device, state, reason; ``failures`` False: none read). One query for
    the failures of the whole page."""
    rows = store.rollouts(states=states, limit=limit, offset=offset)
    failed: Dict[str, List[Dict[str, Any]]] = {r["rollout_id"]: [] for r in rows}
    if failures and rows:
        for raw in _job_query(store, rollouts=list(failed), states=FAILED_STATES):
            failed[raw[0]].append(_job(*raw))
    rollbacks = rollback_log.of_rollouts(store, list(failed)) if rows else {}
    return [rollout_summary(row, sorted(failed[row["rollout_id"]],
                                        key=lambda j: (j["stage"], j["device"])),
                            rollbacks.get(row["rollout_id"], []))
            for row in rows]


def model_label(spec: Mapping[str, Any]) -> Optional[str]:
    """``name@version`` of a rollout's model; for a rollout without a name, the name and
    version devices give it (``sha-<12 hex>@<12 hex>``); None without a model."""
    from agent.wire import model_names

    sha = ((spec.get("artifacts") or {}).get("model") or {}).get("sha256")
    if spec.get("model_name"):
        return model_names.label(spec["model_name"], spec.get("model_version") or (
            model_names.default_version(sha) if isinstance(sha, str) and len(sha) == 64
            else None))
    if isinstance(sha, str) and len(sha) == 64:
        return model_names.label(model_names.derived_name(sha),
                                 model_names.default_version(sha))
    return None


def state_text(state: str, rolled: Mapping[str, Sequence[str]]) -> str:
    """A rollout's state as shown: ``succeeded`` alone only when nothing was rolled back."""
    done = len(rolled.get("rolled_back") or ())
    return "{}, rolled back on {} device{}".format(state, done, "" if done == 1 else "s") \
        if done else state


def rollout_summary(row: Mapping[str, Any], jobs: Sequence[Mapping[str, Any]],
                    rollbacks: Sequence[Mapping[str, Any]] = ()) -> Dict[str, Any]:
    """The row with its failures (of ``jobs``, in their order), progress, model
    (``name@version``) and precision, and the rollbacks recorded against it."""
    failures = [{"device": j["device"], "stage": j["stage"], "state": j["state"],
                 "reason": failure_reason(j)} for j in jobs if j["state"] in FAILED_STATES]
    total = sum(len(s) for s in row.get("stages") or [])
    done = sum(n for s, n in (row.get("counts") or {}).items()
               if s in FAILED_STATES + ("SUCCEEDED",))
    spec = row.get("spec") or {}
    model = (spec.get("artifacts") or {}).get("model") or {}
    rolled = rollback_log.summary(rollbacks)
    return dict(row, failures=failures, total=total, done=done,
                model_name=model_label(spec) or model.get("name"),
                model_file=model.get("name"), model_sha=model.get("sha256"),
                precision=spec.get("precision"), rollbacks=list(rollbacks),
                rolled_back=rolled["rolled_back"], rollback_refused=rolled["refused"],
                state_text=state_text(str(row.get("state")), rolled))


def rollout_detail(store: Store, row: Mapping[str, Any],
                   jobs: Optional[Sequence[Mapping[str, Any]]] = None) -> Dict[str, Any]:
    """One rollout's page: the summary and every device's job."""
    if jobs is None:
        jobs = job_rows_of(store, row["rollout_id"])
    rollbacks = rollback_log.of_rollouts(store, [row["rollout_id"]])[row["rollout_id"]]
    return dict(rollout_summary(row, jobs, rollbacks), jobs=list(jobs))


def job_rows_of(store: Store, rollout_id: str) -> List[Dict[str, Any]]:
    rows = job_rows(store, rollout_id=rollout_id)
    return sorted(rows, key=lambda j: (j["stage"], j["device"]))


def status_history(store: Store, device: str, limit: int = 50) -> List[Dict[str, Any]]:
    """The device's last ``limit`` job status changes (all rollouts), newest first."""
    rows = store.db.query("SELECT rollout_id, job_id, version, state, stage, ts, received FROM "
                          "job_history WHERE device_id = ? ORDER BY id DESC LIMIT ?",
                          (device, max(1, int(limit))))
    return [{"rollout_id": r[0], "job_id": r[1], "version": r[2], "state": r[3],
             "stage": r[4], "ts": _num(r[5]), "received": _num(r[6])} for r in rows]


def deployment_rows(store: Any, limit: int = 100) -> List[Dict[str, Any]]:
    """Live deployments (newest ``limit``), each with its convergence summary (one grouped
    query over the devices' recorded states, no scan of the fleet)."""
    from agent.fleet.deployments import deployments

    live = deployments.rows(store, deployments.LIVE)[-limit:]
    sums = deployments.summary(store, [d["deployment_id"] for d in live])
    return [dict(d, summary=sums.get(d["deployment_id"], deployments.empty_summary()))
            for d in reversed(live)]
