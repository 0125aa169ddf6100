"""``fleet deploy NAME@VERSION --to SELECTOR``, ``fleet deployments ls|show|pause|resume|rm|
retry`` and ``fleet label DEVICE key=value... [--remove key]``: desired state in the fleet
database (``agent.fleet.deployments.deployments``, ``agent.fleet.deployments.labels``); ``fleet
serve`` converges it.
"""

import argparse
import json
import time
import uuid
from typing import Any, Dict

from agent import fleet
from agent.cli import EXIT_OK
from agent.cli.fleet_db import add_db_args, db_url
from agent.errors import AgentError
from agent.fleet.database.store import Store
from agent.fleet.deployments import (
    controls,
    deployments,
    labels,
    pins,
    preview,
    registry,
    revisions,
    selectors,
)
from agent.fleet.rollouts.spec import DOC_KEYS


def add_parsers(fsub: Any) -> None:
    from agent.cli.fleet_rollout import SEARCH_MODES

    d = fsub.add_parser("deploy", help="desired state: every device a selector matches runs "
                        "NAME@VERSION (fleet serve converges it)",
                        description="Record that every eligible device matching --to should "
                        "run a registry version; see docs/fleet.md, Deployments.")
    d.add_argument("ref", metavar="NAME@VERSION")
    d.add_argument("--to", required=True, metavar="SELECTOR",
                   help="Kubernetes label selector: 'site=warehouse-3,board=orin-nano', "
                        "'site!=lab', 'camera in (dock,gate)', '!key', 'key'; '' for every "
                        "device")
    d.add_argument("--id", metavar="ID", help="deployment id (default NAME-VERSION-RANDOM)")
    d.add_argument("--precision", choices=("fp32", "fp16", "int8", "best"),
                   help="default: the version's pushed default")
    d.add_argument("--fallback", choices=("allow", "reject"))
    d.add_argument("--search", choices=SEARCH_MODES)
    d.add_argument("--no-accuracy-gate", action="store_true",
                   help="deploy a version pushed without goldens")
    d.add_argument("--model-set", metavar="ID",
                   help="NAME is one of a model set: switched and committed with the set's "
                        "other names, or rolled back with them (one deployment per name, each "
                        "with the same --model-set and --model-set-names; devices that list "
                        "model_sets)")
    d.add_argument("--model-set-names", metavar="A,B",
                   help="with --model-set: every name of the set (2 to 8, comma-separated)")
    size = d.add_mutually_exclusive_group()
    size.add_argument("--batch", type=int, metavar="N", help="first wave: N devices per stage")
    size.add_argument("--percent", type=float, metavar="P",
                      help="first wave: P%% of the devices per stage")
    d.add_argument("--success-threshold", type=float, default=1.0, metavar="R")
    d.add_argument("--abort-failure-rate", type=float, metavar="R")
    d.add_argument("--min-executed", type=int, default=1, metavar="K")
    d.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                   help="each rollout of the deployment gives up on devices after S s")
    d.add_argument("--job-timeout", type=float, metavar="S")
    d.add_argument("--on-leave", choices=deployments.ON_LEAVE, default="keep",
                   help="a device that leaves the selector (relabelled): keep the model "
                        "(default) or remove it (devices that said they can)")
    d.add_argument("--dry-run", action="store_true",
                   help="list the devices the selector matches and what would change for "
                        "each; record nothing")
    d.add_argument("--allow-empty", action="store_true",
                   help="record the deployment even if the selector matches no eligible "
                        "device now (devices that join later converge)")
    d.add_argument("--max-attempts", type=int, default=deployments.MAX_ATTEMPTS, metavar="N",
                   help="a device may time out in N rollouts (first wave, catch-ups; each "
                   "after an exponential backoff) before the deployment halts with its reason "
                   "(default %(default)s; fleet deployments retry resumes it)")
    d.add_argument("--retry-backoff", type=float, default=deployments.BACKOFF_S, metavar="S",
                   help="the first backoff after a timed-out rollout, doubled each time, capped "
                   "at {:g} s (default %(default)s)".format(deployments.BACKOFF_CAP_S))
    d.add_argument("--json", action="store_true")
    add_db_args(d)
    d.set_defaults(func=run_deploy)

    s = fsub.add_parser("deployments", help="deployments: ls, show, pause, resume, rm, retry, "
                        "undo, history")
    s.add_argument("action", choices=("ls", "show", "pause", "resume", "rm", "retry", "undo",
                                      "history"))
    s.add_argument("deployment_id", nargs="?", metavar="ID")
    s.add_argument("--devices", nargs="+", default=[], metavar="ID",
                   help="retry: only these devices (default every failed one)")
    s.add_argument("--json", action="store_true")
    add_db_args(s)
    s.set_defaults(func=run_deployments)

    p = fsub.add_parser("pin", help="hold a device's model at a version; deployments honour it",
                        description="Record a pin: the device runs NAME@VERSION whatever a "
                        "deployment says (fleet serve sends the version when the device lacks "
                        "it). See docs/fleet.md, One truth.")
    p.add_argument("device", metavar="DEVICE", nargs="?")
    p.add_argument("ref", metavar="NAME@VERSION", nargs="?")
    p.add_argument("--reason", metavar="TEXT", help="why (shown with the pin)")
    p.add_argument("--json", action="store_true")
    add_db_args(p)
    p.set_defaults(func=run_pin)
    u = fsub.add_parser("unpin", help="remove a device's pin: its deployment governs it again")
    u.add_argument("device", metavar="DEVICE")
    u.add_argument("name", metavar="NAME")
    add_db_args(u)
    u.set_defaults(func=run_unpin)

    lab = fsub.add_parser("label", help="a device's labels: show, set key=value, --remove key")
    lab.add_argument("device", metavar="DEVICE")
    lab.add_argument("assignments", nargs="*", metavar="key=value")
    lab.add_argument("--remove", nargs="+", default=[], metavar="KEY")
    lab.add_argument("--json", action="store_true")
    add_db_args(lab)
    lab.set_defaults(func=run_label)


def _open(args: argparse.Namespace, existing: bool = True) -> Store:
    store = Store(db_url(args, existing=existing))
    return store


def build_spec(args: argparse.Namespace, version: Dict[str, Any], dep_id: str
               ) -> Dict[str, Any]:
    """The rollout spec of the deployment: the version's artifacts and defaults, the deploy
    flags over them; every job document shape checked here."""
    merged = dict(version.get("defaults") or {})
    for k in ("precision", "fallback", "search", "job_timeout"):
        if getattr(args, k, None) is not None:
            merged[k] = getattr(args, k)
    if not merged.get("precision"):
        raise AgentError("bad_argument", "fleet deploy: expected --precision (the version has "
                         "no default precision), found none")
    arts = version["artifacts"]
    if "goldens" not in arts and not args.no_accuracy_gate:
        raise AgentError("no_accuracy_gate", "{}@{} was pushed without goldens: expected "
                         "--golden at push, or --no-accuracy-gate here".format(
                             version["name"], version["version"]))
    if merged.get("search") and "goldens" not in arts:
        raise AgentError("bad_argument", "--search judges candidates against goldens; {}@{} "
                         "has none".format(version["name"], version["version"]))
    policy = fleet.check_policy(fleet.Policy(args.success_threshold, args.abort_failure_rate,
                                             args.min_executed))
    if args.batch is not None or args.percent is not None:
        fleet.plan_stages(["check"], args.batch, args.percent)  # the numbers checked
    if not args.timeout > 0:
        raise AgentError("bad_argument", "--timeout must be > 0, found {}".format(args.timeout))
    attempts = getattr(args, "max_attempts", deployments.MAX_ATTEMPTS)
    backoff = getattr(args, "retry_backoff", deployments.BACKOFF_S)
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
                 "timeout": float(args.timeout), "model_path": None,
                 "batch": args.batch, "percent": args.percent,
                 "max_attempts": attempts, "retry_backoff": float(backoff),
                 "policy": {"success_threshold": policy.success_threshold,
                            "abort_failure_rate": policy.abort_failure_rate,
                            "min_executed": policy.min_executed}})
    from agent.fleet.rollouts.spec import model_set_spec

    model_set = model_set_spec(getattr(args, "model_set", None),
                               getattr(args, "model_set_names", None), version["name"])
    if model_set is not None:
        spec["model_set"] = model_set
    docs = fleet.doc_factory(spec)
    for kind in (["search"] if spec.get("search") else []) + ["deploy"]:
        docs("check", dep_id + "-c0", kind, None)
    return spec


def _dep_id(name: str, version: str) -> str:
    base = "{}-{}".format(name[:20], "".join(c if c.isalnum() or c in "._-" else "."
                                              for c in version[:12]))
    return "{}-{}".format(base, uuid.uuid4().hex[:4])


def run_deploy(args: argparse.Namespace) -> int:
    name, version = registry.parse_ref(args.ref)
    if version is None:
        raise AgentError("bad_argument", "fleet deploy: expected NAME@VERSION, found {!r}"
                         .format(args.ref))
    selector = selectors.parse(args.to)
    dep_id = fleet.check_rollout_id(args.id or _dep_id(name, version))
    if len(dep_id) > 40:
        raise AgentError("bad_argument", "--id: expected at most 40 characters, found {}"
                         .format(len(dep_id)))
    store = _open(args)  # a mistyped --db is an error, not a new empty database
    try:
        spec = build_spec(args, registry.get(store, name, version), dep_id)
        spec["on_leave"] = args.on_leave
        if args.dry_run:
            return _dry_run(args, store, {"deployment_id": dep_id, "name": name,
                                          "version": version, "selector": selector.text,
                                          "spec": spec}, selector)
        if not args.allow_empty and not preview.matching(store, selector, eligible_only=True):
            raise AgentError("selector_matches_nothing", "fleet deploy: the selector '{}' "
                             "matches no eligible device (expected at least one; fleet devices "
                             "--selector '{}' lists what it matches); --allow-empty records it "
                             "anyway".format(selector.text, selector.text))
        older = deployments.insert(store, dep_id, name, version, selector.text, spec,
                                   pins.actor())
    finally:
        store.close()
    if args.json:
        print(json.dumps({"deployment_id": dep_id, "selector": selector.text,
                          "superseded": older}, indent=2, sort_keys=True))
    else:
        print("deployment {}: {}@{} to '{}'{}; fleet serve converges it (fleet deployments "
              "show {})".format(dep_id, name, version, selector.text,
                                "; supersedes " + ", ".join(older) if older else "", dep_id))
    return EXIT_OK


def _dry_run(args: argparse.Namespace, store: Store, dep: Dict[str, Any], selector: Any
             ) -> int:
    """``fleet deploy --dry-run``: what the service would do for each matched device."""
    rows = preview.plan(store, dep, selector)
    older = [r["deployment_id"] for r in deployments.rows(store, deployments.LIVE)
             if r["name"] == dep["name"] and r["selector"] == selector.text]
    if args.json:
        print(json.dumps({"dry_run": True, "deployment_id": dep["deployment_id"],
                          "selector": selector.text, "would_supersede": older,
                          "on_leave": dep["spec"]["on_leave"], "devices": rows},
                         indent=2, sort_keys=True))
        return EXIT_OK
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["action"]] = counts.get(r["action"], 0) + 1
    print("dry run: {}@{} to '{}' matches {} device(s){}{}; nothing recorded".format(
        dep["name"], dep["version"], selector.text or "(all)", len(rows),
        " ({})".format(", ".join("{} {}".format(n, a) for a, n in sorted(counts.items())))
        if rows else "", "; would supersede " + ", ".join(older) if older else ""))
    if rows:
        print(fleet.format_table(
            ["DEVICE", "ONLINE", "LABELS", "NOW", "ACTION", "DETAIL"],
            [[r["device"], "yes" if r["online"] else "no", preview.label_text(r["labels"]),
              r["current"] or "-", r["action"], r["detail"]]
             for r in rows[:preview.MAX_LISTED]]))
        if len(rows) > preview.MAX_LISTED:
            print("... {} more (--json lists every one)".format(len(rows) - preview.MAX_LISTED))
    elif not args.allow_empty:
        print("the selector matches no device: fleet deploy refuses it without --allow-empty")
    return EXIT_OK


def _counts(s: Dict[str, Any]) -> str:
    failed = ", ".join("{} {}".format(n, r) for r, n in sorted(s["failed_by"].items()))
    waiting = ", ".join("{} {}".format(n, r) for r, n in sorted(s["waiting_by"].items()))
    return "{}/{} converged, {} in progress, {} retrying, {} failed{}, {} waiting{}".format(
        s["converged"], s["desired"], s["in_progress"], s.get("retrying", 0), s["failed"],
        " ({})".format(failed) if failed else "", s["waiting"],
        " ({})".format(waiting) if waiting else "")


EMPTY = deployments.empty_summary()


def run_deployments(args: argparse.Namespace) -> int:
    store = _open(args)
    try:
        if args.action == "ls":
            rows = deployments.rows(store)
            sums = deployments.summary(store)
            for r in rows:
                r["summary"] = sums.get(r["deployment_id"], EMPTY)
            if args.json:
                print(json.dumps(rows, indent=2, sort_keys=True, default=str))
            elif rows:
                print(fleet.format_table(
                    ["DEPLOYMENT", "MODEL", "SELECTOR", "STATE", "DEVICES", "CREATED"],
                    [[r["deployment_id"], "{}@{}".format(r["name"], r["version"]),
                      r["selector"] or "(all)", r["state"], _counts(r["summary"]),
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"] or 0))]
                     for r in rows]))
            else:
                print("no deployments (fleet deploy)")
            return EXIT_OK
        if not args.deployment_id:
            raise AgentError("bad_argument", "fleet deployments {}: expected a deployment id"
                             .format(args.action))
        dep = deployments.get(store, args.deployment_id)
        did = dep["deployment_id"]
        if args.action == "show":
            dep["summary"] = deployments.summary(store, [did]).get(did, EMPTY)
            dep["devices"] = deployments.device_states(store, did)
            dep["rollouts"] = deployments.rollouts_of(store, did)
            dep["on_leave"] = (dep.get("spec") or {}).get("on_leave") or "keep"
            dep["revision"] = (revisions.history(store, did) or [{"revision": 0}])[-1]["revision"]
            dep["max_attempts"] = deployments.max_attempts(dep["spec"])
            dep["pins"] = [p for p in pins.list_pins(store, [d["device"] for d in dep["devices"]])
                           if p["name"] == dep["name"]]
            dep.pop("spec", None)
            if args.json:
                print(json.dumps(dep, indent=2, sort_keys=True, default=str))
                return EXIT_OK
            print("deployment {}: {}@{} to '{}': {}{}".format(
                did, dep["name"], dep["version"], dep["selector"] or "(all)", dep["state"],
                " ({})".format(dep["reason"]) if dep["reason"] else ""))
            print("devices: " + _counts(dep["summary"]))
            print("on leave: " + dep["on_leave"])
            print("revision {}; rollouts: {}".format(dep["revision"], ", ".join(
                dep["rollouts"]) or "none yet"))
            for p in dep["pins"]:
                print("pin: {} {}@{} ({}{}{})".format(
                    p["device_id"], p["name"], p["version"] or "(rollback in flight)",
                    p["source"], ", by " + p["actor"] if p["actor"] else "",
                    ": " + p["reason"] if p["reason"] else ""))
            table = [[d["device"], d["state"], d["reason"] or "-"] for d in dep["devices"]
                     if d["state"] != "converged"][:200]
            if table:
                print(fleet.format_table(["DEVICE", "STATE", "REASON"], table))
            return EXIT_OK
        if args.action == "history":
            revs = revisions.history(store, did)
            if args.json:
                print(json.dumps(revs, indent=2, sort_keys=True, default=str))
            else:
                print(fleet.format_table(["REVISION", "VERSION", "SELECTOR", "BY", "CREATED"], [
                    [str(r["revision"]), r["version"], r["selector"] or "(all)",
                     r["actor"] or "-", time.strftime("%Y-%m-%d %H:%M:%S",
                                                      time.localtime(r["created"] or 0))]
                    for r in revs]))
            return EXIT_OK
        row = controls.apply(store, did, args.action, args.devices, pins.actor())
        if args.action == "undo":
            print("deployment {}: {}@{} to '{}' again ({}); fleet serve converges it".format(
                did, row["name"], row["version"], row["selector"] or "(all)", row["reason"]))
        else:
            print("deployment {}: {} recorded; fleet serve applies it within a second".format(
                did, args.action))
        return EXIT_OK
    finally:
        store.close()


def run_label(args: argparse.Namespace) -> int:
    store = _open(args)
    try:
        if args.assignments or args.remove:
            labels.assign(store, args.device, labels.parse_assignments(args.assignments),
                          args.remove)
        dev = store.device(args.device)
        if dev is None:
            raise AgentError("unknown_device", "expected a device that reported to this fleet "
                             "database, found {!r}".format(args.device))
        mine = labels.assigned(store, [args.device]).get(args.device, {})
        out = {"device": args.device, "derived": labels.derived(dev["status"]),
               "assigned": mine, "reported": labels.reported(dev["status"]),
               "selectable": labels.selectable(dev["status"], mine)}
    finally:
        store.close()
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        for part in ("derived", "assigned", "reported"):
            print("{:<9} {}".format(part + ":", ", ".join(
                "{}={}".format(k, v) for k, v in sorted(out[part].items())) or "-"))
    return EXIT_OK


def run_pin(args: argparse.Namespace) -> int:
    store = _open(args)
    try:
        if not args.device:  # the list
            rows = pins.list_pins(store)
            if args.json:
                print(json.dumps(rows, indent=2, sort_keys=True, default=str))
            elif rows:
                print(fleet.format_table(["DEVICE", "MODEL", "SOURCE", "BY", "REASON"], [
                    [p["device_id"], "{}@{}".format(p["name"], p["version"] or "?"),
                     p["source"], p["actor"] or "-", p["reason"] or "-"] for p in rows]))
            else:
                print("no pins (fleet pin DEVICE NAME@VERSION)")
            return EXIT_OK
        name, version = registry.parse_ref(args.ref or "")
        if version is None:
            raise AgentError("bad_argument", "fleet pin: expected DEVICE NAME@VERSION, found "
                             "{!r}".format(args.ref))
        if store.device(args.device) is None:
            raise AgentError("unknown_device", "expected a device that reported to this fleet "
                             "database, found {!r}".format(args.device))
        record = registry.get(store, name, version)  # a version the fleet can send
        row = pins.pin(store, args.device, name, version, reason=args.reason)
        row["rollout_id"] = _send_pinned(store, args.device, record)
    finally:
        store.close()
    if args.json:
        print(json.dumps(row, indent=2, sort_keys=True))
    else:
        print("{} pinned to {}@{}; deployments leave it there (fleet unpin {} {}){}".format(
            args.device, name, version, args.device, name,
            "; it runs another version: rollout {} sends it (fleet rollouts show {})".format(
                row["rollout_id"], row["rollout_id"]) if row["rollout_id"] else ""))
    return EXIT_OK


def _send_pinned(store: Store, device: str, record: Dict[str, Any]) -> Any:
    """A pin to a version the device does not run: a one-device rollout of it (the
    governing deployment's settings, else the version's defaults), driven by ``fleet serve``
    like any. None when the device runs it already."""
    from agent.fleet.database import device_models

    name, version = record["name"], record["version"]
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
                    artifacts={k: dict(v) for k, v in record["artifacts"].items()})
        if "goldens" not in spec["artifacts"]:
            spec["search"] = None  # a search judges against goldens this version lacks
    else:
        spec = build_spec(argparse.Namespace(
            precision=None, fallback=None, search=None, job_timeout=None,
            no_accuracy_gate=True, success_threshold=1.0, abort_failure_rate=None,
            min_executed=1, batch=None, percent=None, timeout=3600.0), record, rid)
    store.insert_rollout(rid, spec, [[device]], time.time() + float(spec.get("timeout") or
                                                                    3600.0))
    return rid


def run_unpin(args: argparse.Namespace) -> int:
    store = _open(args)
    try:
        if not pins.unpin(store, args.device, args.name):
            raise AgentError("not_pinned", "expected a fleet pin of {} on {} (fleet pin), found "
                             "none".format(args.name, args.device))
    finally:
        store.close()
    print("{} {}: unpinned; its deployment governs it again".format(args.device, args.name))
    return EXIT_OK
