"""Device admission from the command line (docs/security.md, "Admission"): the
``--admission`` arguments of ``fleet serve`` and ``fleet rollout`` (defaults from
$JETSON_AGENT_FLEET_ADMISSION and $JETSON_AGENT_FLEET_ADMISSION_KEYS) as the policy
agent.fleet.commands.admission makes an ``Admission`` from, and ``fleet devices
pending|accept|reject|trust-legacy`` on the fleet database.
"""

import argparse
import json
import os
import time
from typing import TYPE_CHECKING

from agent.cli import EXIT_OK
from agent.errors import AgentError
from agent.fleet.admission import admission

if TYPE_CHECKING:
    from agent.fleet.commands.admission import Policy


def add_admission_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("admission (docs/security.md)")
    g.add_argument("--admission", choices=admission.POLICIES,
                   default=os.environ.get("JETSON_AGENT_FLEET_ADMISSION", "manual"),
                   help="which devices are heard: manual (default: new devices wait in 'fleet "
                        "devices pending'), keys (those whose key is in --admission-keys), "
                        "open (labs only: anyone); $JETSON_AGENT_FLEET_ADMISSION")
    g.add_argument("--admission-keys", metavar="FILE",
                   default=os.environ.get("JETSON_AGENT_FLEET_ADMISSION_KEYS"),
                   help="the devices' public keys, one per line, each best after the device "
                        "id it is bound to ('ID KEY'; from manufacturing: jetson-agent keygen "
                        "--device); a key without an id admits its first id only; "
                        "$JETSON_AGENT_FLEET_ADMISSION_KEYS")
    g.add_argument("--max-pending", type=int, default=admission.MAX_PENDING, metavar="N",
                   help="devices the pending list holds (the oldest evicted; default "
                        "%(default)s)")


def admission_policy(args: argparse.Namespace) -> "Policy":
    from agent.fleet.commands.admission import Policy  # dataclasses: off the light commands

    return Policy(args.admission, args.admission_keys, args.max_pending)


def run_admin(args: argparse.Namespace, store_url: str) -> int:
    from agent.fleet.commands import admission as admission_command
    from agent.fleet.database.store import Store

    store = Store(store_url)
    try:
        if args.action == "pending":
            rows = admission_command.pending(store)
            if args.json:
                print(json.dumps(rows, indent=2, sort_keys=True))
            elif not rows:
                print("no device waits for admission")
            else:
                for r in rows:
                    print("{:<32} {:<8} key {}  board {}  ({})".format(
                        r["device"], r["state"], r["key_id"], r["board"] or "-",
                        "legacy, served unsigned until accepted" if r["state"] == "legacy"
                        else "pending"))
            return EXIT_OK
        if args.action == "trust-legacy":
            until = admission_command.trust_legacy(store, float(args.window))
            print("legacy devices' first keys are pinned as they arrive until {} (UTC)".format(
                time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(until))))
            return EXIT_OK
        if not args.device:
            raise AgentError("bad_argument", "fleet devices {} needs a device id".format(
                args.action))
        if args.action == "show":
            view = admission_command.show(store, args.device)
            if args.json:
                print(json.dumps(view, indent=2, sort_keys=True))
            else:
                last = view["last_impostor"] or {}
                print("device {}: {}, key {}; keys seen: {}; impostor events: {}{}".format(
                    args.device, view["state"] or "unknown", view["key_id"] or "-",
                    ", ".join(view["keys_seen"]) or "-", view["impostor_events"],
                    " (last: key {} at {})".format(last.get("key_id"), time.strftime(
                        "%Y-%m-%d %H:%M:%S", time.gmtime(last.get("ts") or 0)))
                    if last else ""))
            return EXIT_OK
        if args.action == "rekey":
            if not args.key:
                raise AgentError("bad_argument", "fleet devices rekey {} needs --key NEW (the "
                                 "device's new public key)".format(args.device))
            row = admission.rekey(store, args.device, args.key)
            print("device {} re-keyed: key {}".format(args.device, row["key_id"]))
            return EXIT_OK
        if args.action == "accept":
            row = admission.accept(store, args.device, args.key)
            print("device {} admitted with key {}{}".format(
                args.device, row["key_id"], "" if args.key else " (the only key seen for it)"))
        elif args.action == "rm":
            from agent.cli.fleet_connect import connect

            cleared = admission_command.decommission(store, args.device, lambda: connect(args),
                                                     args.prefix)
            print("device {} decommissioned: key unpinned, {} retained topic(s) cleared, its "
                  "rows kept as history; a later birth from it waits as a new pending device"
                  .format(args.device, cleared))
        else:
            admission.reject(store, args.device)
            print("device {} rejected: its messages are dropped until it presents a new key "
                  "(then it waits in fleet devices pending) or an operator accepts it (fleet "
                  "devices accept {})".format(args.device, args.device))
        return EXIT_OK
    finally:
        store.close()
