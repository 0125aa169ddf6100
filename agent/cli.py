"""``jetson-agent`` / ``python -m agent``: one subcommand per module in ``agent.commands``.

Exit codes: 0 success; 1 the check ran and failed (e.g. ``compare`` outside tolerances);
2 an ``AgentError`` (bad input, unsupported platform, ...; printed as ``error [code]: message``,
or as JSON with ``--json``); 3 an unexpected internal error; 130 interrupted.
"""

import argparse
import importlib
import json
import logging
import sys
from typing import List, Optional

from agent import __version__
from agent.errors import AgentError
from agent.log import setup_logging

# Subcommand name -> module in agent.commands exposing add_parser(subparsers) and run(args).
COMMANDS = {
    "diag": "diag",
    "build": "build",
    "bench": "bench",
    "cache": "cache",
    "compare": "compare",
    "search": "search",
    "run": "run",
    "status": "status",
    "jobs": "jobs",
    "fleet": "fleet",
}

EXIT_OK, EXIT_FAILED, EXIT_ERROR, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jetson-agent",
        description="Edge deployment agent for NVIDIA Jetson fleets.",
    )
    parser.add_argument("--version", action="version", version="jetson-agent " + __version__)
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output (repeat for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in COMMANDS.values():
        try:
            module = importlib.import_module("agent.commands." + module_name)
        except ImportError as exc:
            if exc.name != "agent.commands." + module_name:
                raise
            continue  # not built yet
        module.add_parser(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_ERROR
    setup_logging(args.verbose)
    try:
        return int(args.func(args) or 0)
    except AgentError as exc:
        if getattr(args, "json", False):
            print(json.dumps({"error": exc.to_dict()}, indent=2))
        print("error [{}]: {}".format(exc.code, exc.message), file=sys.stderr)
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
