"""``jetson-agent cache ls|verify|purge|stats``: inspect and tidy the engine cache.

``ls`` lists entries by last use; ``verify`` re-checks every engine's size and sha256 against
its meta.json and drops the corrupt ones; ``purge`` removes all entries, one key (a unique
prefix is enough), or those unused for DAYS (entries in use by a build are skipped).
"""

import argparse
import json
import time
from typing import Any, Dict, List

from agent.cache import engine_loader
from agent.commands import build as build_cmd
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
    p.add_argument("--state-dir", metavar="DIR",
                   help="state and caches (default $JETSON_AGENT_STATE_DIR, systemd's "
                        "StateDirectory, else ~/.cache/jetson-agent)")
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


def _resolve_key(keys: List[str], prefix: str) -> str:
    matches = [k for k in keys if k.startswith(prefix.lower())]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise AgentError("bad_argument", "no cache entry has a key starting with {!r} "
                         "({} entries)".format(prefix, len(keys)))
    raise AgentError("bad_argument", "key prefix {!r} matches {} entries: give more "
                     "characters".format(prefix, len(matches)))


def run(args: argparse.Namespace) -> int:
    cache, _state = build_cmd.open_cache(args)
    if args.action != "purge" and (args.all or args.key or args.older_than is not None):
        raise AgentError("bad_argument", "--all, --key and --older-than go with 'purge'")
    out: Dict[str, Any]
    if args.action == "ls":
        entries = [e.to_dict() for e in cache.ls()]
        out = {"root": cache.root, "entries": entries}
        if not args.json:
            now = time.time()
            print("{} entries, {} in {}".format(len(entries), _size(sum(
                e["bytes"] for e in entries)), cache.root))
            for e in entries:
                print("{}  {:>10}  {:<5} {:<12} {:<14} {}".format(
                    e["key"][:16], _size(e["bytes"]), e["precision"] or "?",
                    e["backend"] or "?", _age(now - e["last_used"]), e["model_name"] or ""))
    elif args.action == "verify":
        out = cache.verify(load=engine_loader())
        if not args.json:
            print("checked {checked}: {ok} ok, {dropped} corrupt dropped, {stale_staging_removed}"
                  " stale staging directories removed".format(**out))
            for bad in out["corrupt"]:
                print("corrupt {}: {}{}".format(bad["key"][:16], bad["problem"],
                                                "" if bad["dropped"] else " (in use: kept)"))
    elif args.action == "purge":
        key = _resolve_key([e.key for e in cache.ls()], args.key) if args.key else None
        out = cache.purge(everything=args.all, key=key, older_than_days=args.older_than)
        if not args.json:
            print("removed {} entries{}".format(len(out["removed"]), "; {} in use kept".format(
                len(out["skipped_in_use"])) if out["skipped_in_use"] else ""))
    else:
        out = cache.stats()
        if not args.json:
            print("{entries} entries, {bytes} bytes in {root}".format(**out))
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    if args.action == "verify" and out["corrupt"]:
        return 1
    return 0
