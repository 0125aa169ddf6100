"""``jetson-agent cache ls|verify|purge|stats``: inspect and tidy the engine cache.

``ls`` lists entries by last use; ``verify`` re-checks every engine's size and sha256 against
its meta.json and drops the corrupt ones; ``purge`` removes all entries, one key (a unique
prefix is enough), or those unused for DAYS (entries in use by a build are skipped, and the
engines of the models directory's versions are kept and named: ``--force`` removes them too);
``stats`` shows the size against the budget (the engines in use count outside it). ``--config``
finds the daemon's cache (its cache.dir, or the unit's /var/cache/jetson-agent) and models
directory; looking creates nothing.
"""

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

from agent import fsio
from agent.cli import STATE_DIR_HELP
from agent.cli.models_location import add_models_dir_arg, models_dir
from agent.device import config
from agent.device.models import guard as models_guard
from agent.device.state_lock import check_state_dir
from agent.engines.cache import EngineCache
from agent.engines.cache_upkeep import engine_loader
from agent.errors import AgentError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cache", help="list, verify or purge the engine cache",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("action", choices=("ls", "verify", "purge", "stats"))
    which = p.add_mutually_exclusive_group()
    which.add_argument("--all", action="store_true", help="purge: every entry")
    which.add_argument("--key", metavar="KEY", help="purge: the entry with this key (or prefix)")
    which.add_argument("--older-than", type=float, metavar="DAYS",
                       help="purge: entries not used for DAYS days")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--state-dir", metavar="DIR", help=STATE_DIR_HELP)
    where.add_argument("--config", metavar="FILE",
                       help="the daemon's YAML config: its engine cache and budget, e.g. "
                            "/etc/jetson-agent/config.yaml")
    p.add_argument("--force", action="store_true",
                   help="purge: also remove the engines the models directory's versions use "
                        "(an application may be running them)")
    add_models_dir_arg(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=run)


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return "{:.0f} {}".format(value, unit) if unit == "B" else "{:.1f} {}".format(
                value, unit)
        value /= 1024.0
    return "{:.1f} GiB".format(value)


def _age(seconds: float) -> str:
    if seconds < 3600:
        return "{:.0f} min ago".format(seconds / 60)
    if seconds < 86400 * 2:
        return "{:.1f} h ago".format(seconds / 3600)
    return "{:.1f} d ago".format(seconds / 86400)


def _budget(budget: Optional[int]) -> str:
    return "no budget" if not budget else "budget {}".format(_size(budget))


def _stats_line(out: Dict[str, Any]) -> str:
    budget = out.get("budget_bytes")
    held = out.get("protected_bytes") or 0
    counted = out["bytes"] - held
    used = " ({:.0f} % of {})".format(100.0 * counted / budget, _budget(budget)) \
        if budget else " ({})".format(_budget(budget))
    line = "{} entries, {}{} in {}".format(out["entries"], _size(out["bytes"]), used,
                                           out["root"])
    if out.get("protected_entries"):
        line += "\n{} in use by the models directory: {} outside the budget{}".format(
            out["protected_entries"], _size(held), "; more than the budget alone: kept"
            if out.get("protected_over_budget") else "")
    return line


def _purge_lines(out: Dict[str, Any]) -> List[str]:
    lines = ["removed {} entries{}".format(len(out["removed"]), "; {} in use by a build "
                                           "kept".format(len(out["skipped_in_use"]))
                                           if out["skipped_in_use"] else "")]
    for held in out.get("kept_protected", []):
        lines.append("kept {} ({}): used by {}".format(held["key"][:16], _size(held["bytes"]),
                                                       ", ".join(held["users"])))
    if out.get("kept_protected"):
        lines.append("(--force removes them too; the application would lose its engine)")
    for held in out.get("forced_protected", []):
        lines.append("warning: removed {} although {} use{} it".format(
            held["key"][:16], ", ".join(held["users"]), "s" if len(held["users"]) == 1
            else ""))
    return lines


def _empty(args: argparse.Namespace, root: str, budget: Optional[int]) -> int:
    out: Dict[str, Any]
    if args.action == "ls":
        out = {"root": root, "entries": [], "exists": False}
    elif args.action == "verify":
        out = {"checked": 0, "ok": 0, "dropped": 0, "corrupt": [], "stale_staging_removed": 0,
               "exists": False}
    elif args.action == "purge":
        if not (args.all or args.key or args.older_than is not None):
            raise AgentError("bad_argument", "purge needs --all, --key KEY or --older-than "
                             "DAYS")
        out = {"removed": [], "skipped_in_use": [], "kept_protected": [],
               "forced_protected": [], "exists": False}
    else:
        out = {"root": root, "entries": 0, "bytes": 0, "budget_bytes": budget, "exists": False}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print("no engine cache at {} (nothing built there yet; the daemon's: --config "
              "FILE)".format(root))
    return 0


def _resolve_key(keys: List[str], prefix: str) -> str:
    matches = [k for k in keys if k.startswith(prefix.lower())]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise AgentError("bad_argument", "no cache entry has a key starting with {!r} "
                         "({} entries)".format(prefix, len(keys)))
    raise AgentError("bad_argument", "key prefix {!r} matches {} entries: give more "
                     "characters".format(prefix, len(matches)))


def _locate(args: argparse.Namespace) -> Tuple[str, Optional[int], str]:
    """(the engines directory, its budget, the models directory) from --config or
    --state-dir (and --models-dir); nothing is created."""
    if args.config:
        from agent.cli.status import daemon_dirs

        cfg, state, cache_dir = daemon_dirs(args.config)
        return (os.path.join(cache_dir, "engines"), cfg.cache.engine_budget_bytes,
                models_dir(args, state, cfg))
    state = check_state_dir(fsio.state_dir(args.state_dir), create=False)
    return (os.path.join(state, "engines"), config.CacheConfig().engine_budget_bytes,
            models_dir(args, state))


def run(args: argparse.Namespace) -> int:
    if args.action != "purge" and (args.all or args.key or args.older_than is not None
                                   or args.force):
        raise AgentError("bad_argument", "--all, --key, --older-than and --force go with "
                         "'purge'")
    root, budget, models = _locate(args)
    if not os.path.isdir(root):
        # Nothing to show, and `ls --state-dir /typo` must not leave a directory behind.
        return _empty(args, root, budget)
    cache = EngineCache(root, budget_bytes=budget, protected=models_guard.protection(models))
    out: Dict[str, Any]
    if args.action == "ls":
        listed = cache.ls()
        users = cache.protected_users(listed)
        entries = [dict(e.to_dict(), in_use_by=users.get(e.key, [])) for e in listed]
        out = {"root": cache.root, "entries": entries}
        if not args.json:
            now = time.time()
            print("{} entries, {} in {}".format(len(entries), _size(sum(
                e["bytes"] for e in entries)), cache.root))
            for e in entries:
                print("{}  {:>10}  {:<5} {:<12} {:<14} {}{}".format(
                    e["key"][:16], _size(e["bytes"]), e["precision"] or "?",
                    e["backend"] or "?", _age(now - e["last_used"]),
                    e["model_label"] or (e["model"] or "")[:12],
                    "  [in use: {}]".format(", ".join(e["in_use_by"])) if e["in_use_by"]
                    else ""))
    elif args.action == "verify":
        users = cache.protected_users()
        out = cache.verify(load=engine_loader())
        for bad in out["corrupt"]:
            bad["in_use_by"] = users.get(bad["key"], [])
        if not args.json:
            print("checked {checked}: {ok} ok, {dropped} corrupt dropped, {stale_staging_removed}"
                  " stale staging directories removed".format(**out))
            for bad in out["corrupt"]:
                print("corrupt {}: {}{}{}".format(
                    bad["key"][:16], bad["problem"], "" if bad["dropped"] else " (in use: kept)",
                    "; used by {}: deploy it again (`jetson-agent diag --verify` checks the "
                    "deployed copy)".format(", ".join(bad["in_use_by"])) if bad["in_use_by"]
                    else ""))
    elif args.action == "purge":
        key = _resolve_key([e.key for e in cache.ls()], args.key) if args.key else None
        out = cache.purge(everything=args.all, key=key, older_than_days=args.older_than,
                          force=args.force)
        if not args.json:
            print("\n".join(_purge_lines(out)))
        elif out["forced_protected"]:
            for line in _purge_lines(out)[1:]:
                print(line, file=sys.stderr)
    else:
        out = cache.stats()
        if not args.json:
            print(_stats_line(out))
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    if args.action == "verify" and out["corrupt"]:
        return 1
    return 0
