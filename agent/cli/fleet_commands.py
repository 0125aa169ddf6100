"""``fleet cancel`` and ``fleet telemetry``: the two commands that send a device command
(``cancel``, ``diag``) and wait, bounded, for the devices' own answer.
"""

import argparse
import json
import sys
import time
from typing import Any, Dict, List

from agent.cli import EXIT_FAILED, EXIT_OK
from agent.cli.fleet_connect import add_connection_args, connect
from agent.cli.fleet_registry import age


def add_cancel_parser(fsub: Any) -> None:
    c = fsub.add_parser("cancel", help="cancel a job (or a rollout) on devices")
    add_connection_args(c)
    c.add_argument("job_id", metavar="JOB", help="job id, or a rollout id (its search job too)")
    c.add_argument("--devices", nargs="+", metavar="ID", help="only these devices")
    c.add_argument("--wait", type=float, default=15.0, metavar="S",
                   help="wait up to S seconds for each device's own final job state "
                        "(default 15); after that: 'cancel requested'")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=run_cancel)


def add_telemetry_parser(fsub: Any) -> None:
    t = fsub.add_parser("telemetry", help="a device's health metrics")
    add_connection_args(t)
    t.add_argument("device", metavar="DEVICE")
    t.add_argument("--follow", action="store_true", help="print every sample until Ctrl-C")
    t.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="without --follow: wait at most S seconds (default 10)")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=run_telemetry)


def run_cancel(args: argparse.Namespace) -> int:
    from agent.fleet.commands.jobs import cancel

    out = cancel(lambda: connect(args), args.job_id, args.devices, args.wait)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return EXIT_OK
    for r in out:
        reply = r["reply"]
        if reply is None:
            what = "no reply{}".format(" (device offline: the broker keeps the command for "
                                       "its session)" if r["online"] is False else "")
        elif not reply.get("ok"):
            err = reply.get("error") or {}
            what = "not cancelled: {} {}".format(err.get("code"), err.get("message", ""))
        elif r["final_state"] == "CANCELED":
            what = "CANCELED (the device's final state)"
        elif r["final_state"]:
            what = "{} (the device's final state: it finished before the cancel)".format(
                r["final_state"])
        else:
            what = "cancel requested; the device reported no final state within {:.0f} s " \
                   "(last: {})".format(args.wait, r["last_state"] or "none")
        if r["document_cleared"]:
            what += "; retained job document cleared"
        print("{} {}: {}".format(r["device"], r["job_id"], what))
    return EXIT_OK


# ---------------------------------------------------------------------------- telemetry

def _print_telemetry(msg: Dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(msg, sort_keys=True), flush=True)
        return
    when = time.strftime("%H:%M:%S", time.localtime(msg.get("ts") or time.time()))
    from agent.cli import telemetry_view

    lines = telemetry_view.table(msg.get("metrics") or {})
    print("{} {} ({})".format(when, msg.get("device"), msg.get("source", "?")), flush=True)
    print("\n".join(lines or ["  (no metrics)"]), flush=True)


def run_telemetry(args: argparse.Namespace) -> int:
    from agent.fleet.commands.telemetry import watch

    printed: List[int] = []

    def show(sample: Dict[str, Any]) -> None:
        _print_telemetry(sample, args.json)
        printed.append(1)

    status, interrupted = watch(lambda: connect(args), args.device, args.timeout, args.follow,
                                show)
    if interrupted:
        return EXIT_OK
    if not printed:
        why = "it is offline since {}".format(age(status.get("ts"))) \
            if status.get("online") is False else "nothing within {:.0f} s".format(args.timeout)
        print("no telemetry from {}: {}".format(args.device, why), file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK
