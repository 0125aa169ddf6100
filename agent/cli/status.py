"""``jetson-agent status``: the device's local state, read from the daemon's journal.

Jobs by state, the job in progress, the named models (per name: version, state, previous
version, precision, engine key), the outbox (status messages not yet
acknowledged by the broker), partial downloads, and session takeovers (another client that
connected with this device's client id). Works while the daemon runs.
"""

import argparse
import json
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from agent.device import config
from agent.device.state_lock import check_state_dir, holder, lock_path
from agent.errors import AgentError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="local state of the device daemon",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_state_args(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def add_state_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="the daemon's YAML config (for state_dir)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="the daemon's state directory (systemd: /var/lib/jetson-agent)")


# What the unit's StateDirectory= / CacheDirectory= give the daemon ($STATE_DIRECTORY and
# $CACHE_DIRECTORY are set for the service only, not in an operator's shell).
UNIT_STATE_DIR = "/var/lib/jetson-agent"
UNIT_CACHE_DIR = "/var/cache/jetson-agent"
# The unit's models directory (made by install-jetson) and app socket (RuntimeDirectory=),
# which it hands to the daemon as $JETSON_AGENT_MODELS_DIR and $JETSON_AGENT_SOCKET.
UNIT_MODELS_DIR = "/var/lib/jetson-agent-models"
UNIT_SOCKET = "/run/jetson-agent/app.sock"


def _yaml_sets(path: str, *keys: str) -> bool:
    try:
        import yaml

        with open(path) as f:
            node: Any = yaml.safe_load(f)
    except Exception:  # noqa: BLE001 - config.load reports a bad file properly
        return False
    for key in keys:
        if not isinstance(node, dict) or node.get(key) is None:
            return False
        node = node[key]
    return True


def daemon_dirs(config_path: Optional[str], state_dir: Optional[str] = None
                ) -> Tuple[config.Config, str, str]:
    """(config, state dir, cache dir) of the daemon that runs with ``config_path``: what the
    config and the environment say, with the unit's directories where the config leaves them
    to systemd and they exist."""
    over: Dict[Tuple[str, ...], Any] = {("state_dir",): state_dir} if state_dir else {}
    cfg = config.load(config_path, overrides=over)
    state, cache = cfg.state_dir or "", cfg.cache_dir
    if config_path and not state_dir and not os.environ.get("JETSON_AGENT_STATE_DIR"):
        if not _yaml_sets(config_path, "state_dir") and os.path.isdir(UNIT_STATE_DIR):
            state = UNIT_STATE_DIR
        if not _yaml_sets(config_path, "cache", "dir") and os.path.isdir(UNIT_CACHE_DIR):
            cache = UNIT_CACHE_DIR
        if not _yaml_sets(config_path, "models", "dir") and os.path.isdir(UNIT_MODELS_DIR) \
                and not os.environ.get("JETSON_AGENT_MODELS_DIR"):
            cfg.models.dir = UNIT_MODELS_DIR
        if not _yaml_sets(config_path, "models", "socket") and os.path.isdir(
                os.path.dirname(UNIT_SOCKET)) and not os.environ.get("JETSON_AGENT_SOCKET"):
            cfg.models.socket = UNIT_SOCKET
    return cfg, check_state_dir(state, create=False), cache


def state_dir_of(args: argparse.Namespace) -> str:
    """The daemon's state directory, located like the daemon locates it."""
    return daemon_dirs(args.config, args.state_dir)[1]


def open_journal(args: argparse.Namespace) -> Any:
    """The daemon's journal, located like the daemon locates it; never created here."""
    from agent.device.daemon import journal_path
    from agent.device.journal.store import Journal

    path = journal_path(state_dir_of(args))
    if not os.path.isfile(path):
        raise AgentError("file_not_found", "no journal at {}: expected the state directory of a "
                         "daemon that has run (--state-dir or --config)".format(path))
    return Journal(path)


def daemon_line(state_dir: str) -> Tuple[Dict[str, Any], str]:
    """Whether a daemon holds the state directory's lock, as JSON and as one line."""
    held = holder(state_dir)
    if held is None:
        return {"running": False}, "daemon: not running (no process holds {})".format(
            lock_path(state_dir))
    if "unknown" in held:  # another user's state directory
        return {"running": None, "why": held["unknown"]}, "daemon: unknown ({}; try sudo)".format(
            held["unknown"])
    info = {"running": True, "pid": held.get("pid"), "device": held.get("device"),
            "since": held.get("started")}
    return info, "daemon: running, PID {}{}{}".format(
        info["pid"] or "unknown", ", device {}".format(info["device"]) if info["device"] else "",
        ", since {}".format(when(info["since"])) if info["since"] else "")


def summary(journal: Any) -> Dict[str, Any]:
    jobs = journal.jobs()
    counts: Dict[str, int] = {}
    for row in jobs:
        counts[row["state"]] = counts.get(row["state"], 0) + 1
    running = [_brief(r) for r in jobs if r["state"] in ("QUEUED", "IN_PROGRESS")]
    recent = [_brief(r) for r in sorted(jobs, key=lambda r: r["updated"])[-10:]]
    return {
        "path": journal.path,
        "boot": journal.boot(),
        "jobs": counts,
        "unfinished": running,
        "recent": recent,
        "active_engines": journal.active_engines(),
        "models": [{k: r[k] for k in ("name", "version", "state", "previous", "precision",
                                      "engine_key", "job_id", "activated")}
                   for r in journal.active_versions()],
        "outbox": journal.outbox_count(),
        "transfers": partials(journal),
        "connection": journal.note("connection") or {},
    }


def partials(journal: Any) -> List[Dict[str, Any]]:
    """Partial downloads: what each holds on disk, how far it got, since when it is idle, and
    whether an unfinished job still names it (if not, the daemon reclaims it)."""
    from agent.wire import protocol

    wanted = journal.referenced_artifacts()
    root = os.path.join(os.path.dirname(os.path.abspath(journal.path)), "artifacts", "partial")
    out = []
    for t in journal.transfers():
        try:
            on_disk = os.stat(os.path.join(root, t["sha256"] + ".part")).st_blocks * 512
        except OSError:
            on_disk = 0
        blocks = protocol.block_count(t["size"], t["block_size"])
        out.append({"sha256": t["sha256"], "size": t["size"], "block_size": t["block_size"],
                    "updated": t["updated"], "blocks": blocks,
                    "received": protocol.bitmap_count(t["bitmap"], blocks),
                    "on_disk": on_disk, "referenced": t["sha256"] in wanted})
    return out


def _brief(row: Dict[str, Any]) -> Dict[str, Any]:
    out = {k: row[k] for k in ("job_id", "kind", "state", "version", "stage", "progress",
                               "updated", "attempts")}
    if row.get("error"):
        out["error"] = {"code": row["error"].get("code"), "message": row["error"].get("message")}
    return out


def when(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def run(args: argparse.Namespace) -> int:
    daemon, line = daemon_line(state_dir_of(args))
    try:
        journal = open_journal(args)
    except AgentError as exc:
        if daemon["running"] is None:  # the journal is as unreadable as the lock
            raise AgentError("file_not_found", "{}: {}; run it as the daemon's user, a member "
                             "of its group, or with sudo".format(exc.message, daemon["why"]))
        if not daemon["running"]:
            raise
        journal = None  # started, journal not written yet
    if journal is None:
        s: Dict[str, Any] = {"daemon": daemon}
    else:
        with journal:
            s = summary(journal)
        s["daemon"] = daemon
    if args.json:
        print(json.dumps(s, indent=2, sort_keys=True))
        return 0
    print(line)
    if journal is None:
        return 0
    print("journal {} (boot {})".format(s["path"], s["boot"]))
    print("jobs: " + (", ".join("{} {}".format(n, st) for st, n in sorted(s["jobs"].items()))
                      or "none"))
    for row in s["unfinished"]:
        prog = row["progress"]
        print("  {:<24} {:<7} {:<11} {}{}".format(
            row["job_id"], row["kind"], row["state"], row["stage"] or "",
            " {}/{}".format(prog["done"], prog["of"]) if prog else ""))
    print("models: {}".format(len(s["models"])))
    for m in s["models"]:
        print("  {}@{} ({})  previous {}  {}  engine {}  job {}  since {}".format(
            m["name"], m["version"], m["state"], m["previous"] or "-", m["precision"],
            m["engine_key"][:12], m["job_id"], when(m["activated"])))
    print("outbox: {} message(s) waiting for the broker".format(s["outbox"]))
    if s["transfers"]:
        print("partial downloads: {} ({} bytes of the store budget)".format(
            len(s["transfers"]), sum(t["size"] for t in s["transfers"])))
        for t in s["transfers"]:
            print("  {}  {} bytes, {}/{} blocks, {} bytes on disk, idle since {}{}".format(
                t["sha256"][:12], t["size"], t["received"], t["blocks"], t["on_disk"],
                when(t["updated"]), "" if t["referenced"] else " (no job needs it: reclaimed)"))
    taken = s["connection"].get("taken_over")
    if taken:
        print("connection: session taken over {} time(s), last at {}: another client used this "
              "device's client id {!r}".format(taken, when(s["connection"]["last_taken_over"]),
                                               s["connection"].get("client_id")))
    return 0
