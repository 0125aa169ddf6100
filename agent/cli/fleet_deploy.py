"""``fleet deploy NAME@VERSION --to SELECTOR``, ``fleet deployments ls|show|pause|resume|rm|
retry`` and ``fleet label DEVICE key=value... [--remove key]``: desired state in the fleet
database (``agent.fleet.deployments.deployments``, ``agent.fleet.deployments.labels``); ``fleet
serve`` converges it.
"""

import argparse
import json
import time
from typing import TYPE_CHECKING, Any, Dict

from agent import fleet
from agent.cli import EXIT_OK
from agent.cli.fleet_db import add_db_args, db_url
from agent.errors import AgentError
from agent.fleet.database.store import Store
from agent.fleet.deployments import deployments, pins, preview

if TYPE_CHECKING:
    from agent.fleet.commands import deploy


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


def _options(args: argparse.Namespace) -> "deploy.DeployOptions":
    from agent.fleet.commands import deploy  # dataclasses: kept off the light commands

    return deploy.DeployOptions(
        precision=args.precision, fallback=args.fallback, search=args.search,
        job_timeout=args.job_timeout, no_accuracy_gate=args.no_accuracy_gate,
        success_threshold=args.success_threshold, abort_failure_rate=args.abort_failure_rate,
        min_executed=args.min_executed, batch=args.batch, percent=args.percent,
        timeout=args.timeout, max_attempts=args.max_attempts,
        retry_backoff=args.retry_backoff, model_set=args.model_set,
        model_set_names=args.model_set_names, on_leave=args.on_leave)


def run_deploy(args: argparse.Namespace) -> int:
    from agent.fleet.commands import deploy  # dataclasses: kept off the light commands

    dep, selector = deploy.parse(args.ref, args.to, args.id)
    store = _open(args)  # a mistyped --db is an error, not a new empty database
    try:
        dep = deploy.with_spec(store, dep, _options(args))
        if args.dry_run:
            return _print_dry_run(args, dep, deploy.dry_run(store, dep, selector))
        out = deploy.record(store, dep, selector, args.allow_empty)
    finally:
        store.close()
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        older = out["superseded"]
        print("deployment {}: {}@{} to '{}'{}; fleet serve converges it (fleet deployments "
              "show {})".format(dep["deployment_id"], dep["name"], dep["version"],
                                out["selector"], "; supersedes " + ", ".join(older)
                                if older else "", dep["deployment_id"]))
    return EXIT_OK


def _print_dry_run(args: argparse.Namespace, dep: Dict[str, Any], plan: Dict[str, Any]) -> int:
    rows, older, text = plan["devices"], plan["would_supersede"], plan["selector"]
    if args.json:
        print(json.dumps(plan, indent=2, sort_keys=True))
        return EXIT_OK
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["action"]] = counts.get(r["action"], 0) + 1
    print("dry run: {}@{} to '{}' matches {} device(s){}{}; nothing recorded".format(
        dep["name"], dep["version"], text or "(all)", len(rows),
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


def run_deployments(args: argparse.Namespace) -> int:
    from agent.fleet.commands import deploy  # dataclasses: kept off the light commands

    store = _open(args)
    try:
        if args.action == "ls":
            rows = deploy.rows(store)
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
        if args.action == "show":
            dep = deploy.show(store, args.deployment_id)
            did = dep["deployment_id"]
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
            revs = deploy.history(store, args.deployment_id)
            if args.json:
                print(json.dumps(revs, indent=2, sort_keys=True, default=str))
            else:
                print(fleet.format_table(["REVISION", "VERSION", "SELECTOR", "BY", "CREATED"], [
                    [str(r["revision"]), r["version"], r["selector"] or "(all)",
                     r["actor"] or "-", time.strftime("%Y-%m-%d %H:%M:%S",
                                                      time.localtime(r["created"] or 0))]
                    for r in revs]))
            return EXIT_OK
        row = deploy.control(store, args.deployment_id, args.action, args.devices)
        did = row["deployment_id"]
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
    from agent.fleet.commands import deploy  # dataclasses: kept off the light commands

    store = _open(args)
    try:
        out = deploy.label(store, args.device, args.assignments, args.remove)
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
    from agent.fleet.commands import deploy  # dataclasses: kept off the light commands

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
        row = deploy.pin(store, args.device, args.ref, args.reason)
    finally:
        store.close()
    name, version = row["name"], row["version"]
    if args.json:
        print(json.dumps(row, indent=2, sort_keys=True))
    else:
        print("{} pinned to {}@{}; deployments leave it there (fleet unpin {} {}){}".format(
            args.device, name, version, args.device, name,
            "; it runs another version: rollout {} sends it (fleet rollouts show {})".format(
                row["rollout_id"], row["rollout_id"]) if row["rollout_id"] else ""))
    return EXIT_OK


def run_unpin(args: argparse.Namespace) -> int:
    from agent.fleet.commands import deploy  # dataclasses: kept off the light commands

    store = _open(args)
    try:
        deploy.unpin(store, args.device, args.name)
    finally:
        store.close()
    print("{} {}: unpinned; its deployment governs it again".format(args.device, args.name))
    return EXIT_OK
