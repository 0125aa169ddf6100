"""``fleet deploy``, ``fleet deployments``, ``fleet pin|unpin`` and ``fleet label``: desired
state in the fleet database (agent.fleet.deployments), as data; ``fleet serve`` converges it.
"""

import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from agent import fleet
from agent.errors import AgentError
from agent.fleet.database.store import Store
from agent.fleet.deployments import deployments, labels, pins, preview, registry, revisions
from agent.fleet.deployments import selectors as selectors_mod
from agent.fleet.rollouts.spec import DOC_KEYS

EMPTY = deployments.empty_summary()


@dataclass
class DeployOptions:
    """``fleet deploy``'s settings over the version's defaults (None: the version's)."""
    precision: Optional[str] = None
    fallback: Optional[str] = None
    search: Optional[str] = None
    job_timeout: Optional[float] = None
    no_accuracy_gate: bool = False
    success_threshold: float = 1.0
    abort_failure_rate: Optional[float] = None
    min_executed: int = 1
    batch: Optional[int] = None
    percent: Optional[float] = None
    timeout: float = 3600.0
    max_attempts: int = deployments.MAX_ATTEMPTS
    retry_backoff: float = deployments.BACKOFF_S
    model_set: Optional[str] = None
    model_set_names: Optional[str] = None
    on_leave: str = "keep"


def build_spec(opts: DeployOptions, version: Dict[str, Any], dep_id: str) -> Dict[str, Any]:
    """The rollout spec of the deployment: the version's artifacts and defaults, the deploy
    flags over them; every job document shape checked here."""
    merged = dict(version.get("defaults") or {})
    for k in ("precision", "fallback", "search", "job_timeout"):
        if getattr(opts, k) is not None:
            merged[k] = getattr(opts, k)
    if not merged.get("precision"):
        raise AgentError("bad_argument", "fleet deploy: expected --precision (the version has "
                         "no default precision), found none")
    arts = version["artifacts"]
    if "goldens" not in arts and not opts.no_accuracy_gate:
        raise AgentError("no_accuracy_gate", "{}@{} was pushed without goldens: expected "
                         "--golden at push, or --no-accuracy-gate here".format(
                             version["name"], version["version"]))
    if merged.get("search") and "goldens" not in arts:
        raise AgentError("bad_argument", "--search judges candidates against goldens; {}@{} "
                         "has none".format(version["name"], version["version"]))
    policy = fleet.check_policy(fleet.Policy(opts.success_threshold, opts.abort_failure_rate,
                                             opts.min_executed))
    if opts.batch is not None or opts.percent is not None:
        fleet.plan_stages(["check"], opts.batch, opts.percent)  # the numbers checked
    if not opts.timeout > 0:
        raise AgentError("bad_argument", "--timeout must be > 0, found {}".format(opts.timeout))
    attempts, backoff = opts.max_attempts, opts.retry_backoff
    if not 1 <= attempts <= 100:
        raise AgentError("bad_argument", "--max-attempts: expected 1 to 100, found {}".format(
            attempts))
    if not 0 < backoff <= deployments.BACKOFF_CAP_S:
        raise AgentError("bad_argument", "--retry-backoff: expected > 0 and <= {:g} s, found "
                         "{}".format(deployments.BACKOFF_CAP_S, backoff))
    spec: Dict[str, Any] = {k: merged.get(k) for k in DOC_KEYS}
    spec.update({"model_name": version["name"], "model_version": version["version"],
                 "artifacts": {k: dict(v) for k, v in arts.items()},
                 "layer_precisions": dict(merged.get("layer_precisions") or {}),
                 "timeout": float(opts.timeout), "model_path": None,
                 "batch": opts.batch, "percent": opts.percent,
                 "max_attempts": attempts, "retry_backoff": float(backoff),
                 "policy": {"success_threshold": policy.success_threshold,
                            "abort_failure_rate": policy.abort_failure_rate,
                            "min_executed": policy.min_executed}})
    from agent.fleet.rollouts.spec import model_set_spec

    model_set = model_set_spec(opts.model_set, opts.model_set_names, version["name"])
    if model_set is not None:
        spec["model_set"] = model_set
    docs = fleet.doc_factory(spec)
    for kind in (["search"] if spec.get("search") else []) + ["deploy"]:
        docs("check", dep_id + "-c0", kind, None)
    return spec


def _new_id(name: str, version: str) -> str:
    base = "{}-{}".format(name[:20], "".join(c if c.isalnum() or c in "._-" else "."
                                              for c in version[:12]))
    return "{}-{}".format(base, uuid.uuid4().hex[:4])


def parse(ref: str, to: str, dep_id: Optional[str]) -> Tuple[Dict[str, Any], Any]:
    """``fleet deploy``'s words checked before any database is opened: the deployment
    ({deployment_id, name, version, selector}) and its parsed selector."""
    name, version = registry.parse_ref(ref)
    if version is None:
        raise AgentError("bad_argument", "fleet deploy: expected NAME@VERSION, found {!r}"
                         .format(ref))
    selector = selectors_mod.parse(to)
    did = fleet.check_rollout_id(dep_id or _new_id(name, version))
    if len(did) > 40:
        raise AgentError("bad_argument", "--id: expected at most 40 characters, found {}"
                         .format(len(did)))
    return {"deployment_id": did, "name": name, "version": version,
            "selector": selector.text}, selector


def with_spec(store: Store, dep: Dict[str, Any], opts: DeployOptions) -> Dict[str, Any]:
    """The deployment with its rollout spec, from the registry's version; nothing recorded."""
    spec = build_spec(opts, registry.get(store, dep["name"], dep["version"]),
                      dep["deployment_id"])
    spec["on_leave"] = opts.on_leave
    return dict(dep, spec=spec)


def record(store: Store, dep: Dict[str, Any], selector: Any, allow_empty: bool
           ) -> Dict[str, Any]:
    """Record the deployment: {deployment_id, selector, superseded}."""
    if not allow_empty and not preview.matching(store, selector, eligible_only=True):
        raise AgentError("selector_matches_nothing", "fleet deploy: the selector '{}' "
                         "matches no eligible device (expected at least one; fleet devices "
                         "--selector '{}' lists what it matches); --allow-empty records it "
                         "anyway".format(selector.text, selector.text))
    older = deployments.insert(store, dep["deployment_id"], dep["name"], dep["version"],
                               selector.text, dep["spec"], pins.actor())
    return {"deployment_id": dep["deployment_id"], "selector": selector.text,
            "superseded": older}


def dry_run(store: Store, dep: Dict[str, Any], selector: Any) -> Dict[str, Any]:
    """``fleet deploy --dry-run``: what the service would do for each matched device."""
    older = [r["deployment_id"] for r in deployments.rows(store, deployments.LIVE)
             if r["name"] == dep["name"] and r["selector"] == selector.text]
    return {"dry_run": True, "deployment_id": dep["deployment_id"],
            "selector": selector.text, "would_supersede": older,
            "on_leave": dep["spec"]["on_leave"], "devices": preview.plan(store, dep, selector)}


def rows(store: Store) -> List[Dict[str, Any]]:
    """``fleet deployments ls``: every deployment with its ``summary``."""
    out = deployments.rows(store)
    sums = deployments.summary(store)
    for r in out:
        r["summary"] = sums.get(r["deployment_id"], EMPTY)
    return list(out)


def show(store: Store, dep_id: str) -> Dict[str, Any]:
    """``fleet deployments show``: the deployment, its devices, rollouts, revision, pins."""
    dep = deployments.get(store, dep_id)
    did = dep["deployment_id"]
    dep["summary"] = deployments.summary(store, [did]).get(did, EMPTY)
    dep["devices"] = deployments.device_states(store, did)
    dep["rollouts"] = deployments.rollouts_of(store, did)
    dep["on_leave"] = (dep.get("spec") or {}).get("on_leave") or "keep"
    dep["revision"] = (revisions.history(store, did) or [{"revision": 0}])[-1]["revision"]
    dep["max_attempts"] = deployments.max_attempts(dep["spec"])
    dep["pins"] = [p for p in pins.list_pins(store, [d["device"] for d in dep["devices"]])
                   if p["name"] == dep["name"]]
    dep.pop("spec", None)
    return dict(dep)


def history(store: Store, dep_id: str) -> List[Dict[str, Any]]:
    """``fleet deployments history``: every revision of the deployment."""
    return list(revisions.history(store, deployments.get(store, dep_id)["deployment_id"]))


def control(store: Store, dep_id: str, action: str, devices: List[str]) -> Dict[str, Any]:
    """``fleet deployments pause|resume|rm|retry|undo``, recorded for the service: the
    deployment's row after it, with its ``deployment_id``."""
    from agent.fleet.deployments import controls

    did = deployments.get(store, dep_id)["deployment_id"]
    return dict(controls.apply(store, did, action, devices, pins.actor()), deployment_id=did)


def label(store: Store, device: str, assignments: List[str], remove: List[str]
          ) -> Dict[str, Any]:
    """``fleet label``: set and remove, then {device, derived, assigned, reported,
    selectable}."""
    if assignments or remove:
        labels.assign(store, device, labels.parse_assignments(assignments), remove)
    dev = store.device(device)
    if dev is None:
        raise AgentError("unknown_device", "expected a device that reported to this fleet "
                         "database, found {!r}".format(device))
    mine = labels.assigned(store, [device]).get(device, {})
    return {"device": device, "derived": labels.derived(dev["status"]),
            "assigned": mine, "reported": labels.reported(dev["status"]),
            "selectable": labels.selectable(dev["status"], mine)}


def pin(store: Store, device: str, ref: Optional[str], reason: Optional[str]
        ) -> Dict[str, Any]:
    """``fleet pin DEVICE NAME@VERSION``: the pin's row, with the ``rollout_id`` that sends
    the version (None when the device runs it already)."""
    name, version = registry.parse_ref(ref or "")
    if version is None:
        raise AgentError("bad_argument", "fleet pin: expected DEVICE NAME@VERSION, found "
                         "{!r}".format(ref))
    if store.device(device) is None:
        raise AgentError("unknown_device", "expected a device that reported to this fleet "
                         "database, found {!r}".format(device))
    version_row = registry.get(store, name, version)  # a version the fleet can send
    row = dict(pins.pin(store, device, name, version, reason=reason))
    row["rollout_id"] = send_pinned(store, device, version_row)
    return row


def send_pinned(store: Store, device: str, version_row: Dict[str, Any]) -> Any:
    """A pin to a version the device does not run: a one-device rollout of it (the
    governing deployment's settings, else the version's defaults), driven by ``fleet serve``
    like any. None when the device runs it already."""
    from agent.fleet.database import device_models

    name, version = version_row["name"], version_row["version"]
    msg = device_models.load(store, [device]).get(device)
    if any(m["name"] == name and m["version"] == version
           for m in device_models.entries(None, msg)):
        return None
    busy = store.busy_devices([device])
    if busy:
        raise AgentError("device_busy", "pinned; but device {} is in rollout {}: expected it "
                         "idle to send {}@{}, found it busy (pin again when it ends)".format(
                             device, busy[device], name, version))
    rid = fleet.check_rollout_id("pin-{}-{}".format(device[:40], uuid.uuid4().hex[:6]))
    dep_id = pins.governed_by(store, device, name)
    if dep_id is not None:
        spec = dict(deployments.get(store, dep_id)["spec"])
        spec.update(model_version=version,
                    artifacts={k: dict(v) for k, v in version_row["artifacts"].items()})
        if "goldens" not in spec["artifacts"]:
            spec["search"] = None  # a search judges against goldens this version lacks
    else:
        spec = build_spec(DeployOptions(no_accuracy_gate=True), version_row, rid)
    store.insert_rollout(rid, spec, [[device]], time.time() + float(spec.get("timeout") or
                                                                    3600.0))
    return rid


def unpin(store: Store, device: str, name: str) -> None:
    if not pins.unpin(store, device, name):
        raise AgentError("not_pinned", "expected a fleet pin of {} on {} (fleet pin), found "
                         "none".format(name, device))
