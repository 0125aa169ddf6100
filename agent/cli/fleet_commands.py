"""``fleet cancel`` and ``fleet telemetry``: the two commands that send a device command
(``cancel``, ``diag``) and wait, bounded, for the devices' own answer.
"""

import argparse
import json
import sys
import time
import uuid
from typing import Any, Dict, List

from agent import fleet
from agent.cli import EXIT_FAILED, EXIT_OK
from agent.cli.fleet_connect import add_connection_args, connect
from agent.cli.fleet_registry import age
from agent.wire import protocol
from agent.wire.topics import TopicInfo


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
    conn = connect(args)
    samples: List[Dict[str, Any]] = []
    try:
        fleet.discover(conn)
        fleet.select_devices(conn.directory.known(), [args.device])
        status = conn.directory.status[args.device]
        rid = "d" + uuid.uuid4().hex[:10]

        def on_message(info: TopicInfo, msg: Any) -> None:
            if info.device != args.device:
                return
            if info.kind == "telemetry":
                samples.append(msg)
            elif info.kind == "command_reply" and msg.get("request_id") == rid and msg.get("ok"):
                tele = (msg.get("result") or {}).get("telemetry")
                if tele and not samples:
                    samples.append({"protocol": 1, "device": args.device, "ts": time.time(),
                                    "source": "diag", "metrics": tele})

        conn.subscribe([conn.topics.telemetry(args.device)], 0)
        conn.subscribe([conn.topics.command_reply(args.device)])
        conn.settle(on_message)
        if status.get("online") is not False:
            # The diag reply carries the last sample: no wait for the next telemetry tick.
            conn.publish(conn.topics.commands(args.device), protocol.encode({
                "protocol": protocol.PROTOCOL_VERSION, "command": "diag", "request_id": rid}),
                qos=1)
        if args.follow:
            try:
                while True:
                    conn.pump(on_message, 0.5)
                    while samples:
                        _print_telemetry(samples.pop(0), args.json)
            except KeyboardInterrupt:
                return EXIT_OK
        deadline = time.monotonic() + args.timeout
        while not samples and time.monotonic() < deadline:
            conn.pump(on_message, 0.2)
    finally:
        conn.close()
    if not samples:
        why = "it is offline since {}".format(age(status.get("ts"))) \
            if status.get("online") is False else "nothing within {:.0f} s".format(args.timeout)
        print("no telemetry from {}: {}".format(args.device, why), file=sys.stderr)
        return EXIT_FAILED
    _print_telemetry(samples[0], args.json)
    return EXIT_OK
