"""The audit trail from the CLI: every ``fleet`` subcommand that changes the fleet is recorded
by ``audited`` (called by the dispatcher, ``agent.cli.main``), and ``fleet audit [--since]
[--json]`` lists the trail (agent.fleet.database.audit).

Which commands change the fleet is one table (``MUTATING``) plus a rule for commands added
later: a sub-action named by a mutating verb (``accept``, ``rm``, ``pin`` ...) is recorded too.
Who: the OS user (``sudo``: the user who ran it). Recording never changes a command's outcome:
a database without the audit table, or one that cannot be opened, is skipped with a warning.
"""

import argparse
import getpass
import json
import logging
import os
import re
import time
from typing import Any, Callable, Dict, List, Optional

from agent.cli import EXIT_OK
from agent.errors import AgentError

log = logging.getLogger("agent.cli")

# fleet subcommand -> sub-actions that change the fleet (None: the command itself does).
MUTATING: Dict[str, Any] = {
    "devices": {"accept", "reject", "trust-legacy", "rm", "rekey", "decommission"},
    "rollout": None, "rollback": None, "cancel": None, "deploy": None,
    "rollouts": {"pause", "resume", "cancel"},
    "deployments": {"pause", "resume", "rm", "retry", "undo"},
    "models": {"push", "rm"}, "db": {"upgrade"}, "pin": None, "unpin": None,
}
# A sub-action spelled by one of these is recorded even when MUTATING does not know it yet.
VERBS = {"accept", "reject", "rm", "remove", "delete", "push", "deploy", "pause", "resume",
         "retry", "undo", "rollback", "pin", "unpin", "rekey", "cancel", "decommission",
         "upgrade", "set", "add", "create", "halt"}
# Arguments never recorded: how to reach the database and broker, output form, logging.
SKIP = {"func", "command", "fleet_command", "verbose", "sub_verbose", "json", "db", "store",
        "broker", "prefix", "username", "ca_file", "cert_file", "mqtt", "connect_timeout",
        "wait", "action"}
TARGETS = ("deployment_id", "device", "ref", "rollout_id", "job_id", "name@version", "model",
           "rollout", "name")


def sub_action(args: argparse.Namespace) -> Optional[str]:
    """The sub-action of a fleet command group (``devices accept``, ``models push`` ...)."""
    if isinstance(getattr(args, "action", None), str):
        return str(args.action)
    for key, value in sorted(vars(args).items()):
        if key.endswith("_command") and key not in ("command", "fleet_command") and \
                isinstance(value, str):
            return value
    return None


def action_of(args: argparse.Namespace) -> Optional[str]:
    """``"deployments pause"``, ``"deploy"`` ...; None for a command that changes nothing."""
    if getattr(args, "command", None) != "fleet":
        return None
    cmd = getattr(args, "fleet_command", None)
    if not cmd or getattr(args, "dry_run", False):
        return None
    sub = sub_action(args)
    if cmd == "label":  # `fleet label DEV` shows; with assignments or --remove it sets
        return "label" if (getattr(args, "assignments", None) or getattr(args, "remove", None)) \
            else None
    known = MUTATING.get(cmd, ())
    if known is None:
        return cmd
    if sub and (sub in (known or ()) or sub in VERBS):
        return "{} {}".format(cmd, sub)
    if sub is None and cmd in VERBS:
        return cmd
    return None


def target_of(args: argparse.Namespace) -> Optional[str]:
    for key in TARGETS:
        if key == "name@version":  # models push NAME VERSION
            name, version = getattr(args, "name", None), getattr(args, "version", None)
            value = "{}@{}".format(name, version) if name and version else None
        else:
            value = getattr(args, key, None)
        if isinstance(value, list):
            value = ",".join(str(v) for v in value[:20]) or None
        if value:
            return str(value)
    return None


def args_of(args: argparse.Namespace, argv: Optional[List[str]] = None) -> Dict[str, Any]:
    """The arguments of the command; with ``argv``, only those the operator typed (a flag
    given, or a positional value), not every default."""
    out = {k: v for k, v in vars(args).items()
           if k not in SKIP and not k.endswith("_command") and not callable(v)}
    if argv is None:
        return out
    words = set(argv)
    flags = {w.split("=", 1)[0] for w in argv if w.startswith("--")}

    def typed(key: str, value: Any) -> bool:
        if "--" + key.replace("_", "-") in flags:
            return True
        values = value if isinstance(value, list) else [value]
        return bool(values) and all(isinstance(v, str) and v in words for v in values)

    return {k: v for k, v in out.items() if typed(k, v)}


def actor() -> str:
    """The OS user; under sudo, the user who ran it."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry (a container): still record the uid
        user = "uid{}".format(os.getuid()) if hasattr(os, "getuid") else "unknown"
    sudo = os.environ.get("SUDO_USER")
    return "{} (sudo)".format(sudo) if sudo and user == "root" else user


def _db_url(args: argparse.Namespace) -> Optional[str]:
    from agent.fleet.database.db import sqlite_path
    from agent.fleet.database.store import default_db_url

    url = getattr(args, "db", None) or os.environ.get("JETSON_AGENT_FLEET_DB") or \
        default_db_url()
    if url.startswith("sqlite:") and not os.path.isfile(sqlite_path(url)):
        return None  # recording must not create a database
    return url


def write(args: argparse.Namespace, action: str, outcome: str, message: Optional[str],
          argv: Optional[List[str]] = None) -> None:
    from agent.fleet.database import audit
    from agent.fleet.database.store import Store

    url = _db_url(args)
    if url is None:
        log.debug("audit: no fleet database to record %s in", action)
        return
    try:
        store = Store(url, schema="read")
    except Exception as exc:  # noqa: BLE001 - the command's outcome stands
        log.warning("audit: %s not recorded: %s", action, exc)
        return
    try:
        if not audit.record(store, actor(), "cli", action, target_of(args),
                            args_of(args, argv), outcome, message):
            log.warning("audit: %s not recorded: the fleet database has no audit table "
                        "(fleet db upgrade)", action)
    except Exception as exc:  # noqa: BLE001
        log.warning("audit: %s not recorded: %s", action, exc)
    finally:
        store.close()


def audited(args: argparse.Namespace, func: Callable[[argparse.Namespace], Any],
            argv: Optional[List[str]] = None) -> int:
    """Run a command; when it changes the fleet, record it with its outcome (``ok``, ``exit
    N``, the error code, ``interrupted``) and the arguments typed (``argv``)."""
    action = action_of(args)
    if action is None:
        return int(func(args) or 0)
    outcome, message = "internal_error", None
    try:
        rc = int(func(args) or 0)
        outcome = "ok" if rc == 0 else "exit {}".format(rc)
        return rc
    except AgentError as exc:
        outcome, message = exc.code, exc.message
        raise
    except KeyboardInterrupt:
        outcome = "interrupted"
        raise
    finally:
        write(args, action, outcome, message, argv)


# ---------------------------------------------------------------------------- fleet audit

def add_parser(fsub: Any) -> None:
    from agent.cli.fleet_db import add_db_args

    a = fsub.add_parser("audit", help="who did what to the fleet, and when",
                        description="The audit trail: every operator action through the CLI "
                        "or the dashboard (who, when, what, outcome), oldest first. See "
                        "docs/fleet.md, Audit trail.")
    a.add_argument("--since", metavar="DURATION|TIMESTAMP", help="only actions since then: "
                   "30m, 12h, 7d, or 2026-11-27T10:00:00 (local time), or a Unix time")
    a.add_argument("--limit", type=int, default=1000, metavar="N",
                   help="at most the last N actions (default %(default)s)")
    a.add_argument("--json", action="store_true")
    add_db_args(a)
    a.set_defaults(func=run_audit)


UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_since(text: str, now: Optional[float] = None) -> float:
    now = time.time() if now is None else now
    t = text.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", t)
    if m:
        return now - float(m.group(1)) * UNITS[m.group(2)]
    if re.fullmatch(r"\d{9,11}(\.\d+)?", t):
        return float(t)
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d"):
        try:
            return time.mktime(time.strptime(t, fmt))
        except ValueError:
            continue
    raise AgentError("bad_argument", "--since expects a duration (30m, 12h, 7d), a local time "
                     "(2026-11-27T10:00:00) or a Unix time, found {!r}".format(text[:80]))


def run_audit(args: argparse.Namespace) -> int:
    from agent.cli.fleet_db import db_url
    from agent.fleet.database import audit
    from agent.fleet.database.store import Store

    since = parse_since(args.since) if args.since else None
    if not 1 <= args.limit <= audit.MAX_ROWS:
        raise AgentError("bad_argument", "--limit expects 1..{}, found {}".format(
            audit.MAX_ROWS, args.limit))
    store = Store(db_url(args, existing=True), schema="read")
    try:
        rows = audit.rows(store, since=since, limit=args.limit)
    finally:
        store.close()
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return EXIT_OK
    if not rows:
        print("no actions recorded{}".format(" since then" if since else ""))
        return EXIT_OK
    for r in rows:
        print("{}  {:<12} {:<9} {:<22} {:<24} {}{}".format(
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["ts"])), r["actor"], r["via"],
            r["action"], r["target"] or "-", r["outcome"],
            "  " + " ".join("{}={}".format(k, v) for k, v in sorted(r["args"].items()))
            if r["args"] else ""))
    return EXIT_OK
