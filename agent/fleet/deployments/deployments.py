"""Deployments: desired state. ``fleet deploy NAME@VERSION --to SELECTOR`` records that every
eligible device the selector matches should run that registry version; the service
(``agent.fleet.deployments.deployment_runner``) makes the fleet converge and keeps it so.

This module owns the tables and the pure decisions:

- ``deployments``: one row per deployment (name, version, selector and its canonical text, the
  rollout spec built from the registry version and the deploy flags, state: pending -> rolling
  (first wave) -> active | halted; paused; superseded; removed);
- ``deployment_rollouts``: the rollouts a deployment made (its first wave, then catch-ups);
- ``deployment_devices``: each governed device's state for its deployment (converged,
  in_progress, failed with its reason, offline, waiting), written by the runner when the device
  changes, read by ``show``, the dashboard and /metrics without scanning the fleet;
- ``deployment_retries``: an operator's retry (``fleet deployments retry``): failures and app
  rejections older than it no longer hold the device back.

``eligible_devices`` is the one place that says which devices deployments may target.
``decide`` says, for one device and the deployment that governs it, what it needs.
"""

import functools
import json
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set

from agent.errors import AgentError
from agent.fleet.database import device_models
from agent.fleet.deployments import pins, revisions
from agent.wire import protocol

LIVE = ("pending", "rolling", "active", "paused", "halted")  # still governs its devices
SENDING = ("pending", "rolling", "active")  # may send jobs
# A device's state for its deployment; a reason says why it waits (offline, paused, pinned to
# N@V, pending admission, superseded), how it failed (the job's code: message) or when it is
# tried again (retrying).
STATES = ("converged", "in_progress", "retrying", "failed", "waiting")
# A job that ended so, or the device's app rejecting the version: not sent again until retried.
FAILED_JOB = ("FAILED", "REJECTED")
ALL = "*"  # deployment_retries.device_id of a retry of every device
# spec["on_leave"]: what a device that leaves the selector does with the model (keep: nothing;
# remove: the runner sends it a remove command, agent.fleet.deployments.deployment_runner).
ON_LEAVE = ("keep", "remove")
TIMED_OUT = "TIMED_OUT"  # a job its rollout gave up on: one attempt
MAX_ATTEMPTS = 5  # rollouts a device may time out in before its deployment halts
BACKOFF_S, BACKOFF_CAP_S = 5.0, 600.0  # after attempt n: BACKOFF_S * 2**(n-1), capped



# Devices no deployment targets or counts: admission sent them back to pending (a new key:
# re-keyed), rejected them, or an operator decommissioned them (fleet devices rm).
_LEFT_OUT = ("(SELECT device_id FROM device_keys WHERE state IN ('pending', 'rejected', "
             "'decommissioned'))")


def eligible_devices(store: Any, ids: Optional[Iterable[str]] = None) -> Set[str]:
    """The devices deployments may target (``ids``: of these): the registered devices that
    admission has not sent back to pending or rejected (agent.fleet.admission.admission; a device
    not admitted never enters the registry at all)."""
    admitted = "device_id NOT IN " + _LEFT_OUT
    if ids is None:
        return {r[0] for r in store.db.query(
            "SELECT device_id FROM devices WHERE " + admitted)}
    out: Set[str] = set()
    ids = sorted(set(ids))
    for i in range(0, len(ids), 500):
        chunk = ids[i:i + 500]
        out.update(r[0] for r in store.db.query(
            "SELECT device_id FROM devices WHERE device_id IN ({}) AND {}".format(
                ", ".join("?" for _ in chunk), admitted), chunk))
    return out


# ---------------------------------------------------------------------------- rows

_SELECT = ("SELECT deployment_id, name, version, selector, spec, state, reason, superseded_by, "
           "created, updated FROM deployments")


def _row(r: Sequence[Any]) -> Dict[str, Any]:
    return {"deployment_id": r[0], "name": r[1], "version": r[2], "selector": r[3],
            "spec": json.loads(r[4]), "state": r[5], "reason": r[6], "superseded_by": r[7],
            "created": r[8], "updated": r[9]}


def rows(store: Any, states: Optional[Sequence[str]] = None) -> List[Dict[str, Any]]:
    """Deployments, oldest first (``states``: only those)."""
    sql = _SELECT
    params: Sequence[str] = ()
    if states is not None:
        sql += " WHERE state IN ({})".format(", ".join("?" for _ in states))
        params = tuple(states)
    return [_row(r) for r in store.db.query(sql + " ORDER BY created, deployment_id", params)]


def get(store: Any, deployment_id: str) -> Dict[str, Any]:
    found = store.db.query(_SELECT + " WHERE deployment_id = ?", (deployment_id,))
    if not found:
        raise AgentError("unknown_deployment", "expected a deployment id (fleet deployments "
                         "ls), found {!r}".format(deployment_id))
    return _row(found[0])


def set_state(store: Any, deployment_id: str, state: str, reason: Optional[str] = None
              ) -> float:
    """Returns the row's new ``updated``."""
    now = time.time()
    store.db.execute("UPDATE deployments SET state = ?, reason = ?, updated = ? WHERE "
                     "deployment_id = ?", (state, reason, now, deployment_id))
    return now


def insert(store: Any, deployment_id: str, name: str, version: str, selector: str,
           spec: Mapping[str, Any], actor: Optional[str] = None) -> List[str]:
    """A new deployment (state pending); the live deployments of the same name and selector
    are superseded by it (their unfinished rollouts cancelled) and their revision history is
    its own (``revisions``). Returns the superseded ids."""
    from agent.fleet.deployments.selectors import parse

    selector = parse(selector).text  # the group: the same requirements, the same text
    now = time.time()
    with store.transaction():
        if store.db.query("SELECT 1 FROM deployments WHERE deployment_id = ?",
                          (deployment_id,)):
            raise AgentError("bad_argument", "deployment {} exists; expected a new id".format(
                deployment_id))
        older = [r[0] for r in store.db.query(
            "SELECT deployment_id FROM deployments WHERE name = ? AND selector = ? AND state IN "
            "({})".format(", ".join("?" for _ in LIVE)), (name, selector) + LIVE)]
        for old in older:
            store.db.execute("UPDATE deployments SET state = 'superseded', superseded_by = ?, "
                             "reason = ?, updated = ? WHERE deployment_id = ?",
                             (deployment_id, "superseded by " + deployment_id, now, old))
        store.db.execute("INSERT INTO deployments (deployment_id, name, version, selector, spec,"
                         " state, created, updated) VALUES (?, ?, ?, ?, ?, 'pending', ?, ?)",
                         (deployment_id, name, version, selector,
                          json.dumps(dict(spec), sort_keys=True), now, now))
        revisions.record(store, deployment_id, version, selector, spec, actor,
                         inherit=older[-1] if older else None)
    for old in older:
        cancel_rollouts(store, old)
    return older


def rollouts_of(store: Any, deployment_id: str) -> List[str]:
    return [r[0] for r in store.db.query(
        "SELECT rollout_id FROM deployment_rollouts WHERE deployment_id = ? ORDER BY created",
        (deployment_id,))]


def cancel_rollouts(store: Any, deployment_id: str, control: str = "cancel") -> None:
    """Ask the service to cancel (pause, resume) the deployment's unfinished rollouts."""
    for rid in rollouts_of(store, deployment_id):
        try:
            store.request_control(rid, control)
        except AgentError:  # finished already
            pass


def retry(store: Any, deployment_id: str, devices: Sequence[str] = ()) -> None:
    get(store, deployment_id)
    now = time.time()
    store.db.executemany(
        "INSERT INTO deployment_retries (deployment_id, device_id, at) VALUES (?, ?, ?) ON "
        "CONFLICT (deployment_id, device_id) DO UPDATE SET at = excluded.at",
        [(deployment_id, d, now) for d in (list(devices) or [ALL])])
    store.db.execute("UPDATE deployments SET updated = ? WHERE deployment_id = ?",
                     (now, deployment_id))


def retries(store: Any, deployment_id: str) -> Dict[str, float]:
    return {r[0]: float(r[1]) for r in store.db.query(
        "SELECT device_id, at FROM deployment_retries WHERE deployment_id = ?",
        (deployment_id,))}


def record_devices(store: Any, deployment_id: str,
                   states: Mapping[str, Optional[Mapping[str, Any]]]) -> None:
    """device -> {state, reason} (None: no longer governed by this deployment)."""
    now = time.time()
    gone = [(deployment_id, d) for d, s in states.items() if s is None]
    kept = [(deployment_id, d, s["state"], s.get("reason"), now)
            for d, s in sorted(states.items()) if s is not None]
    if gone:
        store.db.executemany("DELETE FROM deployment_devices WHERE deployment_id = ? AND "
                             "device_id = ?", gone)
    store.db.executemany(
        "INSERT INTO deployment_devices (deployment_id, device_id, state, reason, updated) "
        "VALUES (?, ?, ?, ?, ?) ON CONFLICT (deployment_id, device_id) DO UPDATE SET state = "
        "excluded.state, reason = excluded.reason, updated = excluded.updated", kept)


# A deployment's figures leave out the devices eligible_devices leaves out, at read time: a
# row the runner has not removed yet is not counted.
_COUNTED = "dd.device_id NOT IN " + _LEFT_OUT


def empty_summary() -> Dict[str, Any]:
    return dict({k: 0 for k in STATES}, desired=0, failed_by={}, waiting_by={}, offline=0,
                pinned=0)


def summary(store: Any, deployment_ids: Optional[Sequence[str]] = None
            ) -> Dict[str, Dict[str, Any]]:
    """deployment -> {desired, converged, in_progress, retrying, failed, waiting, failed_by:
    {code: n}, waiting_by: {reason: n}, offline, pinned}: one grouped query over
    ``deployment_devices``. The one set of figures: ``fleet deployments show|ls``, the
    dashboard and /metrics all read it. A deployment that no longer governs (superseded,
    removed) counts its last devices as waiting, "superseded" (or "removed"), never converged:
    a device counts in one live deployment of a model."""
    states = {r[0]: r[1] for r in store.db.query("SELECT deployment_id, state FROM deployments")}
    out: Dict[str, Dict[str, Any]] = {}
    for dep, state, reason, n in store.db.query(
            "SELECT dd.deployment_id, dd.state, dd.reason, COUNT(*) FROM deployment_devices dd "
            "WHERE " + _COUNTED + " GROUP BY dd.deployment_id, dd.state, dd.reason"):
        if deployment_ids is not None and dep not in deployment_ids:
            continue
        state, reason = _shown(states.get(dep), state, reason)
        s = out.setdefault(dep, empty_summary())
        n = int(n)
        s["desired"] += n
        s[state] = s.get(state, 0) + n
        if state == "failed":
            code = (reason or "-").split(":", 1)[0]
            s["failed_by"][code] = s["failed_by"].get(code, 0) + n
        elif state == "waiting":
            why = reason or "to be sent"
            if why.startswith("pinned"):
                s["pinned"] += n
                why = "pinned"
            s["waiting_by"][why] = s["waiting_by"].get(why, 0) + n
            if why == "offline":
                s["offline"] += n
    return out


def _shown(dep_state: Optional[str], state: str, reason: Optional[str]) -> Any:
    if dep_state is not None and dep_state not in LIVE:
        return "waiting", dep_state
    if state == "offline":  # recorded by an earlier release
        return "waiting", "offline"
    return state, reason


def device_states(store: Any, deployment_id: str) -> List[Dict[str, Any]]:
    """Per device: {device, state, reason, updated}, the devices ``summary`` counts."""
    dep_state = (store.db.query("SELECT state FROM deployments WHERE deployment_id = ?",
                                (deployment_id,)) or [[None]])[0][0]
    out = []
    for r in store.db.query("SELECT dd.device_id, dd.state, dd.reason, dd.updated FROM "
                            "deployment_devices dd WHERE dd.deployment_id = ? AND " + _COUNTED +
                            " ORDER BY dd.device_id", (deployment_id,)):
        state, reason = _shown(dep_state, r[1], r[2])
        out.append({"device": r[0], "state": state, "reason": reason, "updated": r[3]})
    return out + pending_admission(store, deployment_id)


MAX_PENDING_SHOWN = 200


def pending_admission(store: Any, deployment_id: str) -> List[Dict[str, Any]]:
    """Devices waiting for an operator's admission (new, or re-keyed) whose labels, as their
    pending birth states them, the deployment's selector matches: shown as waiting, never
    counted (admission bounds how many wait)."""
    from agent.fleet.deployments.labels import selectable
    from agent.fleet.deployments.selectors import parse

    dep = store.db.query("SELECT selector, state FROM deployments WHERE deployment_id = ?",
                         (deployment_id,))
    if not dep or dep[0][1] not in LIVE:
        return []
    selector = parse(dep[0][0])
    out: List[Dict[str, Any]] = []
    for dev, row in sorted(store.device_keys("pending").items()):
        status = row.get("pending_status")
        if isinstance(status, Mapping) and selector.matches(selectable(status, None)):
            out.append({"device": dev, "state": "waiting", "reason": "pending admission "
                        "(fleet devices accept {})".format(dev), "updated": row.get("updated")})
            if len(out) >= MAX_PENDING_SHOWN:
                break
    return out


# ---------------------------------------------------------------------------- decisions

def holds(dep: Mapping[str, Any], models_msg: Optional[Mapping[str, Any]]) -> Optional[bool]:
    """Whether the device's models message shows the deployment's version (with the same
    model and, for a named precision, the same precision) active or pending: True; another
    or none: False; no message at all (an older daemon, a simulator): None."""
    if not isinstance(models_msg, Mapping):
        return None
    spec = dep["spec"]
    sha = ((spec.get("artifacts") or {}).get("model") or {}).get("sha256")
    for m in device_models.entries(None, models_msg):
        if m["name"] != dep["name"] or m["version"] != dep["version"]:
            continue
        if m.get("model") and sha and m["model"] != sha:
            return False
        wanted = spec.get("precision")
        if wanted not in (None, "best") and m.get("precision") not in (None, wanted) \
                and spec.get("fallback") != "allow":
            return False
        return True
    return False


def rejected(dep: Mapping[str, Any], models_msg: Optional[Mapping[str, Any]]) -> bool:
    """Whether the device's app rejected this version (its models message says so)."""
    for m in (models_msg or {}).get("models") or []:
        if isinstance(m, Mapping) and m.get("name") == dep["name"] and \
                dep["version"] in (m.get("rejected") or []):
            return True
    return False


def backoff(spec: Mapping[str, Any], attempts: int) -> float:
    """Seconds to wait after the ``attempts``-th timed-out rollout before the next:
    exponential from the spec's ``retry_backoff`` (default 5 s), capped at ``BACKOFF_CAP_S``."""
    base = float(spec.get("retry_backoff") or BACKOFF_S)
    return min(BACKOFF_CAP_S, base * (2 ** max(0, attempts - 1)))


def max_attempts(spec: Mapping[str, Any]) -> int:
    return int(spec.get("max_attempts") or MAX_ATTEMPTS)


def _failed_reason(err: Any, state: str) -> str:
    """``code: message`` of a job's error (the figure groups by the code)."""
    err = err if isinstance(err, Mapping) else {}
    code = str(err.get("code") or state.lower())
    msg = str(err.get("message") or "")[:160]
    return "{}: {}".format(code, msg) if msg else code


def decide(dep: Mapping[str, Any], online: bool, models_msg: Optional[Mapping[str, Any]],
           models_at: float, last_job: Optional[Mapping[str, Any]], retried_at: float,
           pin: Optional[Mapping[str, Any]] = None, attempts: int = 0,
           now: Optional[float] = None) -> Dict[str, Any]:
    """What one device governed by ``dep`` needs: {state, reason, send, at}. ``last_job``: its
    newest job of this deployment ({state, error, updated, open}: open while its rollout
    runs); ``models_at``: when its models message was stored; ``retried_at``: the operator's
    last retry for it (0: none); ``pin``: the pin that holds this model on it
    (``pins.effective``); ``attempts``: its jobs of this deployment that timed out since the
    retry. ``at``: when to decide again (a backoff), else None. ``halt``: its attempts are
    spent (the deployment halts)."""
    now = time.time() if now is None else now
    held = holds(dep, models_msg)

    def out(state: str, reason: Optional[str] = None, send: bool = False,
            at: Optional[float] = None, halt: bool = False) -> Dict[str, Any]:
        return {"state": state, "reason": reason, "send": send, "at": at, "halt": halt}

    if pin is not None:  # the pin wins: the deployment neither sends nor counts it as behind
        if held and pin.get("version") == dep["version"]:
            return out("converged")
        return out("waiting", pins.label(pin))
    if held:
        return out("converged")
    if rejected(dep, models_msg) and models_at > retried_at:
        return out("failed", "version_rejected")
    if last_job is not None:
        state = str(last_job.get("state"))
        if last_job.get("open") and not protocol.is_terminal(state):
            return out("in_progress")
        ended = float(last_job.get("updated") or 0)
        if state == "SUCCEEDED" and (held is None or models_at <= ended):
            # A device without models messages, or whose message predates the success.
            return out("converged")
        if state in FAILED_JOB and ended > retried_at:
            return out("failed", _failed_reason(last_job.get("error"), state))
        if state == TIMED_OUT and ended > retried_at and attempts > 0:
            spec = dep["spec"]
            if attempts >= max_attempts(spec):
                return out("failed", "offline" if not online else "timed_out", halt=True)
            at = ended + backoff(spec, attempts)
            reason = "attempt {} at {}".format(attempts + 1, time.strftime(
                "%H:%M:%S", time.localtime(at)))
            if dep.get("state") in ("paused", "halted"):
                return out("waiting", str(dep["state"]))
            # A device that went away mid-rollout is sent again too: the job waits for it.
            return out("retrying", reason, send=now >= at, at=None if now >= at else at)
    if dep.get("state") in ("paused", "halted"):  # sends nothing until resumed / retried
        return out("waiting", str(dep["state"]))
    if not online:
        return out("waiting", "offline")
    return out("waiting", None, send=True)


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> Any:
    from agent.fleet.deployments.selectors import parse

    return parse(text)


def governing(deps: Sequence[Mapping[str, Any]], labels: Mapping[str, str]
              ) -> Dict[str, Mapping[str, Any]]:
    """model name -> the newest live deployment of it whose selector matches ``labels``."""
    out: Dict[str, Mapping[str, Any]] = {}
    for dep in deps:  # oldest first: a newer one of the same name replaces it
        if dep["state"] in LIVE and _parsed(dep["selector"]).matches(labels):
            out[dep["name"]] = dep
    return out
