"""``fleet devices`` and ``fleet jobs``: read-only views of the fleet, from the registry of
``fleet serve`` (its database) when one runs, else from what the broker retains (device
statuses, telemetry, job statuses and pending job documents).
"""

import argparse
import json
import os
import time
from typing import Any, Optional

from agent import fleet
from agent.cli import EXIT_OK
from agent.cli.fleet_connect import add_connection_args, connect


def add_devices_parser(fsub: Any) -> None:
    d = fsub.add_parser("devices", help="devices that reported to the broker; pending, accept, "
                        "reject (admission)")
    d.add_argument("action", nargs="?", choices=("ls", "pending", "accept", "reject",
                                                 "trust-legacy", "rm", "show", "rekey"),
                   default="ls",
                   help="ls (default); pending: devices waiting for admission; accept ID / "
                        "reject ID; trust-legacy --window S: pin legacy devices' first keys "
                        "for S seconds; rm ID: decommission a device (its key unpinned, its "
                        "retained topics cleared, its rows kept as history); show ID: its "
                        "identity (pinned key, keys seen, impostor events); rekey ID --key NEW: "
                        "pin a new key (docs/security.md)")
    d.add_argument("device", nargs="?", metavar="ID")
    d.add_argument("--key", metavar="PUBKEY", help="accept: the key expected (a .pub file, or "
                   "the key as PEM, ssh-ed25519 or base64 text), one of those seen for the "
                   "device (without it: the only key ever seen); rekey: the device's new key")
    d.add_argument("--window", type=float, default=7 * 24 * 3600.0, metavar="S",
                   help="trust-legacy: how long (default 7 days)")
    add_connection_args(d)
    d.add_argument("--wait", type=float, default=1.0, metavar="S",
                   help="listen S seconds for telemetry (default 1)")
    d.add_argument("--selector", metavar="SELECTOR",
                   help="ls: only the devices this label selector matches (fleet deploy --to's "
                        "syntax; with the registry, operator labels count too)")
    d.add_argument("--json", action="store_true")
    d.add_argument("--db", metavar="URL", default=os.environ.get("JETSON_AGENT_FLEET_DB"),
                   help="read the registry of 'fleet serve' from this database (every "
                        "device ever heard of, last known board) instead of the broker; "
                        "default: the default database when a service runs on it")
    d.set_defaults(func=run_devices)


def add_jobs_parser(fsub: Any) -> None:
    j = fsub.add_parser("jobs", help="job statuses retained on the broker")
    add_connection_args(j)
    j.add_argument("--device", action="append", metavar="ID", help="only this device "
                   "(repeatable)")
    j.add_argument("--json", action="store_true")
    j.add_argument("--db", metavar="URL", default=os.environ.get("JETSON_AGENT_FLEET_DB"),
                   help="every per-device job of every rollout in the database of 'fleet "
                        "serve' (the broker keeps nothing for finished jobs)")
    j.set_defaults(func=run_jobs)


def age(ts: Any) -> str:
    """How long ago ``ts`` (epoch seconds) was, for a table cell; "-" when unknown."""
    if not isinstance(ts, (int, float)):
        return "-"
    seconds = max(0.0, time.time() - ts)
    if seconds < 120:
        return "{:.0f}s ago".format(seconds)
    if seconds < 7200:
        return "{:.0f}m ago".format(seconds / 60)
    return "{:.0f}h ago".format(seconds / 3600)


def telemetry_summary(metrics: Any) -> str:
    """The first telemetry rows with their units (agent/cli/telemetry_view.py)."""
    from agent.cli import telemetry_view

    return telemetry_view.summary(metrics if isinstance(metrics, dict) else {}, limit=4)


def registry_db(args: argparse.Namespace) -> Optional[str]:
    """--db, else the default database when a fleet service is running on it."""
    from agent.fleet.commands.db import recording_url

    return recording_url(args.db, required=False)


def run_devices(args: argparse.Namespace) -> int:
    if args.action != "ls":
        from agent.cli.fleet_admission import run_admin
        from agent.fleet.commands.db import resolve_url

        return run_admin(args, resolve_url(args.db, existing=True))
    from agent.fleet.commands.devices import MEMBERS, devices
    from agent.fleet.deployments import preview, selectors

    selector = selectors.parse(args.selector) if args.selector is not None else None
    rows = devices(registry_db(args), lambda: connect(args), args.wait, selector)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return EXIT_OK
    if not rows:
        print("no device matches the selector '{}'".format(selector.text) if selector is not None
              else "no device has reported to {} under {}/".format(args.broker, args.prefix))
        return EXIT_OK
    table = []
    outside = [r for r in rows if r["admission"] not in MEMBERS]
    rows = [r for r in rows if r["admission"] in MEMBERS]
    for r in rows:
        online = "yes" if r["online"] else "no ({})".format(r["reason"] or "offline")
        tele = r["telemetry"]
        name = r["device"] + (" (legacy)" if r["admission"] == "legacy" else "")
        table.append([name, online, str(r["board"] or "-"), str(r["jetpack"] or "-"),
                      str(r["tensorrt"] or "-"), str(r["backend"] or "-"),
                      ",".join(r["precisions"] or []) or "-", r["models_text"],
                      preview.label_text(r["labels"], 40), age(r["last_seen"]),
                      "{} ({})".format(telemetry_summary(tele.get("metrics")), age(tele.get(
                          "ts"))) if tele else "-"])
    print(fleet.format_table(["DEVICE", "ONLINE", "BOARD", "JETPACK", "TENSORRT", "BACKEND",
                              "PRECISIONS", "MODELS", "LABELS", "LAST SEEN", "TELEMETRY"],
                             table)
          if table else "no admitted device")
    if outside:
        print("\nnot fleet members (births unsigned or not admitted; docs/security.md, "
              "\"Admission\"):")
        print(fleet.format_table(["DEVICE", "ADMISSION", "ONLINE", "BOARD", "AGENT"], [
            [r["device"], r["admission"], "yes" if r["online"] else "no",
             str(r["board"] or "-"), str(r["agent_version"] or "-")] for r in outside]))
    return EXIT_OK


# ---------------------------------------------------------------------------- jobs

def run_jobs(args: argparse.Namespace) -> int:
    from agent.fleet.commands.jobs import jobs

    rows = jobs(registry_db(args), lambda: connect(args), args.device)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return EXIT_OK
    if not rows:
        print("no retained jobs")
        return EXIT_OK
    table = [[r["device"], r["job_id"], str(r["kind"] or "?"), r["state"],
              str(r["stage"] or "-"), age(r["updated"]),
              "{}: {}".format(r["error"].get("code"), r["error"].get("message", ""))[:70]
              if r["error"] else "-"] for r in rows]
    print(fleet.format_table(["DEVICE", "JOB", "KIND", "STATE", "STAGE", "UPDATED", "ERROR"],
                             table))
    return EXIT_OK
