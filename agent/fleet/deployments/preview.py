"""What a selector matches and what a deployment would do, before anything is recorded
(``fleet deploy --dry-run``, ``fleet devices --selector``, the refusal of a selector that
matches no device): reads the fleet database, writes nothing.

Each registered device is judged as the service's runner would judge it
(``deployments.eligible_devices``, ``labels.selectable``, ``deployments.decide`` with no job of
the new deployment yet), so the preview and what ``fleet serve`` then does agree.
"""

import json
from typing import Any, Dict, List, Mapping, Optional

from agent.fleet.database import device_models
from agent.fleet.deployments import deployments, labels, pins

MAX_LISTED = 1000  # devices printed by the table views (--json lists every one)


def devices(store: Any) -> List[Dict[str, Any]]:
    """Every registered device, by id: {device, online, labels, admission, eligible, models,
    models_at}. ``admission``: its key's state when it has one (pending, rejected, ...)."""
    eligible = deployments.eligible_devices(store)
    assigned = labels.assigned(store)
    keys = {r[0]: r[1] for r in store.db.query("SELECT device_id, state FROM device_keys")}
    models: Dict[str, Any] = {}
    for dev, message, updated in store.db.query(
            "SELECT device_id, message, updated FROM device_models"):
        models[dev] = (json.loads(message) if message else None, float(updated or 0))
    out = []
    for dev, online, status in store.db.query(
            "SELECT device_id, online, status FROM devices ORDER BY device_id"):
        st = json.loads(status) if status else {}
        msg, at = models.get(dev, (None, 0.0))
        out.append({"device": dev, "online": bool(online),
                    "labels": labels.selectable(st, assigned.get(dev)),
                    "admission": keys.get(dev), "eligible": dev in eligible,
                    "status": st, "models": msg, "models_at": at})
    return out


def matching(store: Any, selector: Any, eligible_only: bool = False) -> List[Dict[str, Any]]:
    """The registered devices ``selector`` (agent.fleet.deployments.selectors) matches."""
    return [d for d in devices(store) if selector.matches(d["labels"]) and
            (d["eligible"] or not eligible_only)]


def current(name: str, device: Mapping[str, Any]) -> Optional[str]:
    """The version of ``name`` the device runs, from its models message (the active one, else
    the one activated last: a version the app has not confirmed yet is pending)."""
    held = [m for m in device_models.entries(device.get("status"), device.get("models"))
            if m["name"] == name]
    held.sort(key=lambda m: (m["state"] == "active", m["activated"] or 0.0))
    return str(held[-1]["version"]) if held else None


def plan(store: Any, dep: Mapping[str, Any], selector: Any) -> List[Dict[str, Any]]:
    """For each device ``selector`` matches: {device, online, labels, current, action,
    detail} where action is install, converged, offline (installs when it is back), failed
    (its app rejected this version), pinned (a pin holds another version: fleet unpin) or
    not_eligible (admission: pending, rejected)."""
    out = []
    ref = "{}@{}".format(dep["name"], dep["version"])
    found = matching(store, selector)
    fleet_pins = pins.fleet_pins(store, [d["device"] for d in found])
    for d in found:
        row = {"device": d["device"], "online": d["online"], "labels": d["labels"],
               "current": current(dep["name"], d)}
        if not d["eligible"]:
            row.update(action="not_eligible", detail="admission: {}; fleet devices accept {}"
                       .format(d["admission"] or "not admitted", d["device"]))
        else:
            pin = pins.effective(fleet_pins.get((d["device"], dep["name"])), d["models"],
                                 dep["name"])
            verdict = deployments.decide(dep, d["online"], d["models"], d["models_at"], None,
                                         0.0, pin=pin)
            state, reason = verdict["state"], verdict["reason"]
            action = state
            if state == "waiting":
                action = {None: "install", "offline": "offline"}.get(
                    reason, "pinned" if pin is not None else "waiting")
            detail = {"converged": "already runs " + ref,
                      "failed": "its app rejected {} ({})".format(ref, reason),
                      "offline": "installs {} when it is back online".format(ref),
                      "pinned": "keeps its pin ({}): fleet unpin to let it converge".format(
                          reason),
                      "waiting": "waits ({})".format(reason),
                      "install": "installs {} (now: {})".format(
                          ref, row["current"] or "none")}.get(action, "")
            row.update(action=action, detail=detail)
        out.append(row)
    return out


# Labels every device has, from its platform (labels.derived): the tables show them in their
# own columns; the device/ and fleet/ copies say whose a label is (--json lists them all).
DERIVED = ("board", "jetpack", "tensorrt", "class")


def label_text(values: Mapping[str, str], limit: int = 60) -> str:
    """``k=v,k=v`` for a table cell (the labels a device claims or an operator gave it), cut
    at ``limit`` characters."""
    text = ",".join("{}={}".format(k, v) for k, v in sorted(values.items())
                    if "/" not in k and k not in DERIVED) or "-"
    return text if len(text) <= limit else text[:limit - 3] + "..."
