"""``jetson-agent`` / ``python -m agent``: one subcommand per module in ``agent.cli``.

Exit codes: 0 success; 1 the check ran and failed (e.g. ``compare`` outside tolerances);
2 an ``AgentError`` (bad input, unsupported platform, ...; printed as ``error [code]: message``,
or as JSON with ``--json``); 3 an unexpected internal error; 130 interrupted.

Owns argument parsing, exit codes and ``--json`` output; each subcommand is its own module here
(``add_parser(sub)`` sets ``func``), imported only when chosen, plus ``telemetry_view`` (samples
for people); ``fleet`` registers its command groups from the ``fleet_*`` modules here, which
parse, call ``agent.fleet.commands`` and print. May import every package: the CLI is the top;
nothing imports it.
"""

import argparse
import importlib
import json
import logging
import sys
from typing import Any, List, Optional

from agent import __version__
from agent.errors import AgentError
from agent.log import setup_logging, stderr_is_journal

# Subcommand -> one-line help. Each lives in agent.cli.<name> with add_parser(subparsers).
# Only the chosen one is imported, so `run` (the daemon) and `diag` stay small.
COMMANDS = {
    "diag": "show the board, versions, supported precisions and problems to fix",
    "selftest": "acceptance run: build, check and time the bundled examples on this board",
    "build": "build an engine (through the engine cache)",
    "bench": "measure latency and throughput of a model or engine",
    "inspect": "the per-layer view of a model or engine (types, precisions, placement)",
    "cache": "list, verify or purge the engine cache",
    "compare": "build, run and compare an engine with golden outputs (Polygraphy-style)",
    "search": "find the layers that must stay in higher precision (precision search)",
    "run": "run the device daemon (MQTT jobs, worker, telemetry)",
    "status": "local state of the device daemon",
    "jobs": "jobs the device daemon received",
    "models": "named models on this device: list, show, commit, roll back",
    "fleet": "controller: devices, staged rollouts, jobs, telemetry",
    "keygen": "make this device's own key pair (device identity, docs/security.md)",
}

EXIT_OK, EXIT_FAILED, EXIT_ERROR, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
STATE_DIR_HELP = ("state and caches (default $JETSON_AGENT_STATE_DIR, systemd's StateDirectory, "
                  "else ~/.cache/jetson-agent)")


class Parser(argparse.ArgumentParser):
    """No prefix matching (``--precision`` must never mean ``--precision-constraints``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


class SubcommandParser(Parser):
    """A subcommand's parser: ``-v`` works after the subcommand too, and an unknown flag is
    reported with this subcommand's usage (argparse would hand it up to the top level)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.add_argument("-v", "--verbose", dest="sub_verbose", action="count",
                          default=argparse.SUPPRESS, help="more log output (repeat for debug)")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error("unrecognized arguments: {}".format(" ".join(extras)))
        return parsed, extras


def verbosity(args: argparse.Namespace) -> int:
    return int(getattr(args, "verbose", 0) or 0) + int(getattr(args, "sub_verbose", 0) or 0)


def _chosen_command(argv: List[str]) -> Optional[str]:
    # Top-level options take no values, so the first bare word is the subcommand.
    return next((a for a in argv if not a.startswith("-")), None)


def build_parser(argv: Optional[List[str]] = None) -> argparse.ArgumentParser:
    parser = Parser(
        prog="jetson-agent",
        description="Edge deployment agent for NVIDIA Jetson fleets.",
    )
    parser.add_argument("--version", action="version", version="jetson-agent " + __version__)
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output (repeat for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                parser_class=SubcommandParser)
    chosen = _chosen_command(sys.argv[1:] if argv is None else argv)
    for name, text in COMMANDS.items():
        if name == chosen:
            importlib.import_module("agent.cli." + name).add_parser(sub)
        else:
            sub.add_parser(name, help=text)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_ERROR
    args.verbose = verbosity(args)
    setup_logging(args.verbose)
    try:
        if args.command == "fleet":  # the audit trail records what changes the fleet
            from agent.cli.fleet_audit import audited

            return audited(args, args.func, sys.argv[1:] if argv is None else list(argv))
        return int(args.func(args) or 0)
    except AgentError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": exc.to_dict()}, indent=2))
        # Under systemd the line carries the error priority (journalctl -p err shows it).
        print("{}error [{}]: {}".format("<3>" if stderr_is_journal() else "", exc.code,
                                         exc.message), file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `jetson-agent ... --json | head`: the reader left; not an error of ours.
        sys.stderr.close()
        return EXIT_OK
    except Exception:  # noqa: BLE001 - last resort: report, do not hide
        logging.getLogger("agent").exception("internal error")
        return EXIT_INTERNAL
