"""``jetson-agent fleet``: the controller side of a fleet, over MQTT (docs/fleet.md).

- ``fleet devices``: the devices that reported (retained status): online, board, JetPack,
  TensorRT, precisions, active engines, and telemetry heard within ``--wait`` seconds.
- ``fleet rollout``: check the model, goldens and calibration set here, publish a job per
  device in stages, serve the artifact blocks each device asks for, follow the progress, and
  print a results table (``--json`` for machines). Exit status 0 only when every targeted
  device SUCCEEDED, 1 otherwise, 2 on bad input (nothing published), 130 on Ctrl-C
  (submitted to ``fleet serve``: detaches, the rollout goes on; embedded: every device not
  finished is cancelled, running ones included). ``--dry-run`` publishes nothing.
- ``fleet jobs``: job statuses and pending job documents retained on the broker.
- ``fleet cancel JOB``: clear a job's retained documents, send cancel commands and report
  each device's own final job state (waiting up to ``--wait`` seconds for it).
- ``fleet telemetry DEVICE [--follow]``: a device's health metrics.
- ``fleet db upgrade|current|history``: the fleet database's schema migrations.
- ``fleet models push|ls|show|rm``: the model registry (name@version, immutable).
- ``fleet deploy NAME@VERSION --to SELECTOR``: desired state that ``fleet serve`` converges;
  ``fleet deployments ls|show|pause|resume|rm|retry``; ``fleet label DEVICE key=value``.
- ``fleet keygen --out DIR``: an Ed25519 key pair for signing job documents
  (docs/security.md); ``fleet rollout --signing-key KEY`` signs with it.
- ``fleet audit [--since] [--json]``: who changed the fleet, when, how it ended (every command
  here that changes the fleet is recorded: ``agent.cli.fleet_audit``).
"""

import argparse
import json
from typing import Any

from agent.cli import (
    EXIT_OK,
    fleet_audit,
    fleet_commands,
    fleet_db,
    fleet_deploy,
    fleet_engines,
    fleet_models,
    fleet_registry,
    fleet_rollback,
    fleet_rollout,
    fleet_serve,
)
from agent.cli.fleet_connect import add_connection_args, connect
from agent.wire import job_signer


def add_parser(sub: Any) -> None:
    """One module per command group; registered in the order ``--help`` lists them."""
    p = sub.add_parser("fleet", help="controller: devices, staged rollouts, jobs, telemetry",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fsub = p.add_subparsers(dest="fleet_command",
                            metavar="devices|rollout|rollouts|serve|db|rollback|models|deploy|"
                                   "deployments|label|pin|unpin|jobs|cancel|telemetry|engines|"
                                   "keygen|audit")
    fleet_registry.add_devices_parser(fsub)
    fleet_rollout.add_parser(fsub)
    fleet_serve.add_parsers(fsub, add_connection_args, connect)
    fleet_db.add_db_parser(fsub)
    from agent.fleet.deployments import pins  # a governed device's rollback becomes a pin

    fleet_rollback.add_parser(fsub, add_connection_args, connect,
                        (pins.rollback_pins, pins.on_rollback_reply))
    fleet_models.add_parser(fsub)
    fleet_deploy.add_parsers(fsub)
    fleet_registry.add_jobs_parser(fsub)
    fleet_commands.add_cancel_parser(fsub)
    fleet_commands.add_telemetry_parser(fsub)
    fleet_audit.add_parser(fsub)
    fleet_engines.add_parser(fsub, add_connection_args, connect)

    k = fsub.add_parser("keygen", help="create an Ed25519 key pair for signing job documents",
                        description="Write NAME.key (private, mode 0600: keep it on the "
                        "controller) and NAME.pub (list it in the devices' "
                        "security.trusted_keys). See docs/security.md.")
    k.add_argument("--out", required=True, metavar="DIR", help="directory for the two files")
    k.add_argument("--name", default="jetson-agent-signing",
                   help="file name stem (default %(default)s)")
    k.add_argument("--json", action="store_true")
    k.set_defaults(func=run_keygen)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def run_keygen(args: argparse.Namespace) -> int:
    made = job_signer.generate_keypair(args.out, args.name)
    if args.json:
        print(json.dumps(made, indent=2, sort_keys=True))
        return EXIT_OK
    print("private key: {}  (mode 0600: keep it on the controller; fleet rollout "
          "--signing-key)".format(made["private_key"]))
    print("public key:  {}  (key id {})".format(made["public_key"], made["key_id"]))
    print("device config:\n  security:\n    trusted_keys:\n      - {}\n"
          "      # or inline: ed25519:{}".format(made["public_key"], made["public_base64"]))
    return EXIT_OK
