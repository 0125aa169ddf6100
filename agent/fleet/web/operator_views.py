"""The read models of the operator's pages (deployments, one deployment, models, labels and
pins, audit) and the deployment actions the dashboard offers (pause, resume, retry, undo: what
``fleet deployments ACTION`` records, through agent.fleet.deployments.controls).
"""

import logging
from typing import Any, Dict, List, Mapping, Optional, Tuple

from agent.errors import AgentError
from agent.fleet.database import device_models
from agent.fleet.database.store import Store
from agent.fleet.deployments import controls, deployments, labels, registry
from agent.fleet.deployments import pins as pins_of

log = logging.getLogger("agent.fleet.web")
DEPLOYMENT_ACTIONS = ("pause", "resume", "retry", "undo")
MAX_ROWS = 2000  # devices per deployment page, devices per label page


def pins(store: Store, device: Optional[str] = None) -> List[Dict[str, Any]]:
    """Every pin (device, name -> version, source, who, why, when); ``device``: its only."""
    return pins_of.list_pins(store, None if device is None else [device])


def deployment_lists(store: Store) -> Tuple[List[Dict[str, Any]], List[Dict[str, Any]]]:
    """(live with their summaries, newest first; ended ones, newest first)."""
    from agent.fleet.web import views

    live = views.deployment_rows(store)
    ended = [d for d in reversed(deployments.rows(store)) if d["state"] not in deployments.LIVE]
    return live, ended[:200]


def deployment_detail(store: Store, deployment_id: str) -> Dict[str, Any]:
    """The deployment, its summary, each governed device's row (every column the runner
    records: state, reason and what else it keeps), its rollouts and the pins of its model."""
    dep = deployments.get(store, deployment_id)
    did = dep["deployment_id"]
    empty = deployments.empty_summary()
    dep["summary"] = deployments.summary(store, [did]).get(did, empty)
    devices = deployments.device_states(store, did)[:MAX_ROWS]
    return {"deployment": dep, "devices": devices,
            "rollouts": deployments.rollouts_of(store, did),
            "pins": [p for p in pins(store) if p.get("name") == dep["name"]]}


def device_deployments(store: Store, device: str) -> List[Dict[str, Any]]:
    """The live deployments that govern ``device``, with its state and reason in each (a
    removed or superseded deployment is not listed: it no longer asks anything of it)."""
    found = store.db.query(
        "SELECT deployment_id, state, reason, updated FROM deployment_devices WHERE "
        "device_id = ?", (device,))
    live = {d["deployment_id"]: d for d in deployments.rows(store, deployments.LIVE)}
    return [dict(live[r[0]], device_state=r[1], device_reason=r[2], device_updated=r[3])
            for r in found if r[0] in live]


def model_rows(store: Store) -> List[Tuple[str, List[Dict[str, Any]]]]:
    """[(name, versions)] with each version's live deployments, the devices holding it (as
    active, pending or kept to go back to) and which versions share each of its blobs."""
    versions = registry.versions(store)
    live = deployments.rows(store, deployments.LIVE)
    held: Dict[Tuple[str, str], List[str]] = {}
    for dev, msg in sorted(device_models.load(store).items()):
        for m in device_models.entries(None, msg):
            for v in {m["version"], m.get("previous")} - {None}:
                held.setdefault((m["name"], str(v)), []).append(dev)
    users: Dict[str, List[str]] = {}
    for v in versions:
        for art in (v.get("artifacts") or {}).values():
            if isinstance(art, Mapping) and art.get("sha256"):
                users.setdefault(str(art["sha256"]), []).append(
                    "{}@{}".format(v["name"], v["version"]))
    out: Dict[str, List[Dict[str, Any]]] = {}
    for v in versions:
        arts = v.get("artifacts") or {}
        out.setdefault(v["name"], []).append(dict(
            v, model_sha=(arts.get("model") or {}).get("sha256"),
            deployments=[d["deployment_id"] for d in live
                         if d["name"] == v["name"] and d["version"] == v["version"]],
            devices=held.get((v["name"], v["version"]), [])[:200],
            blobs=[(str(a["sha256"]), users.get(str(a["sha256"]), []))
                   for _, a in sorted(arts.items())
                   if isinstance(a, Mapping) and a.get("sha256")]))
    return sorted(out.items())


def label_rows(store: Store) -> List[Dict[str, Any]]:
    assigned = labels.assigned(store)
    return [{"device": d["device"], "assigned": assigned.get(d["device"], {}),
             "reported": dict(labels.derived(d["status"]), **labels.reported(d["status"]))}
            for d in store.devices()[:MAX_ROWS]]


def control(store: Store, deployment_id: str, action: str, actor: str) -> str:
    """A deployment action from the dashboard, recorded as ``fleet deployments ACTION``
    records it (agent.fleet.deployments.controls); returns the deployment id."""
    if action not in DEPLOYMENT_ACTIONS:
        raise AgentError("bad_argument", "expected a deployment action ({}), found {!r}".format(
            ", ".join(DEPLOYMENT_ACTIONS), action[:40]))
    return str(controls.apply(store, deployment_id, action, (), actor)["deployment_id"])


def device_labels(store: Store, device: str) -> Dict[str, str]:
    return labels.assigned(store, [device]).get(device, {})


def audit_rows(store: Store, limit: int) -> List[Dict[str, Any]]:
    from agent.fleet.database import audit

    return audit.rows(store, limit=limit, newest_first=True)


def fleet_labels(store: Store) -> Dict[str, Dict[str, str]]:
    """device -> the labels it is selected by: its own claims, an operator's over them."""
    assigned = labels.assigned(store)
    return {d: dict(labels.reported(status), **assigned.get(d, {}))
            for d, status in store.statuses().items()}
