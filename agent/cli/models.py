"""``jetson-agent models``: the named models on this device (docs/daemon.md).

    models ls [--json]                 every name: version, state, previous, precision, engine
    models show NAME [--json]          its kept versions, meta.json of the current one, rejections
    models commit NAME [--version V]   commit the pending version (the app socket)
    models rollback NAME [--version V] back to a kept version (the app socket)
    models pin NAME VERSION            keep NAME at VERSION (switches to it if kept): jobs to
                                       another version are refused (model_pinned)
    models unpin NAME                  let jobs switch NAME again
    models samples export NAME --out F.npz
                                       the app's donated inputs of NAME, in one .npz (they
                                       leave the device only this way)
    models recalibrate NAME [--out DIR]
                                       the donated inputs as a calibration set (.npz shards,
                                       what a build's --calib reads) for NAME's next build

``state``: pending (switched, waiting for its confirmation), committed, or another state the
journal records; ``health``: ``ok``, the app's last problem, or why the name was rolled back.

``ls`` and ``show`` read the daemon's journal and the models directory (the daemon may run);
``commit``, ``rollback``, ``retry``, ``pin`` and ``unpin`` ask the running daemon over its app
socket, which takes them from root, the service user and the configured app users/group only
(``retry``, ``pin`` and ``unpin``: root and the service user).
"""

import argparse
import json
import os
import socket
import time
from typing import Any, Dict, List

from agent.cli.status import add_state_args, daemon_dirs, open_journal, when
from agent.errors import AgentError
from agent.wire.model_names import validate_name, validate_version

MAX_REPLY_BYTES = 1 << 20


def add_parser(sub: Any) -> None:
    p = sub.add_parser("models", help="named models on this device: list, show, commit, "
                       "roll back", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    ms = p.add_subparsers(dest="models_command",
                          metavar="ls|show|commit|rollback|retry|pin|unpin|samples|recalibrate")
    ms.required = True
    for name, helptext in (("ls", "every model name and its active version"),
                           ("show", "one name: kept versions, meta.json, rejections"),
                           ("commit", "commit a pending version"),
                           ("rollback", "go back to a kept version"),
                           ("retry", "forget that the app rejected a version"),
                           ("pin", "keep a name at a version on this device"),
                           ("unpin", "let jobs switch a pinned name again")):
        q = ms.add_parser(name, help=helptext)
        add_state_args(q)
        q.add_argument("--json", action="store_true", help="machine-readable output")
        if name != "ls":
            q.add_argument("name", help="the model name")
        if name == "retry":
            q.add_argument("version", help="the rejected version")
        elif name == "pin":
            q.add_argument("version", help="a version this device keeps")
        elif name in ("commit", "rollback"):
            q.add_argument("--version", help="a specific version (default: the pending one / "
                           "the previous one)")
        q.set_defaults(func=globals()["run_" + name])
    q = ms.add_parser("samples", help="the app's donated inputs kept on this device")
    ss = q.add_subparsers(dest="samples_command", metavar="export")
    ss.required = True
    e = ss.add_parser("export", help="write a name's donated inputs to one .npz")
    r = ms.add_parser("recalibrate", help="a calibration set from a name's donated inputs")
    for q, out_help in ((e, "the .npz to write"), (r, "the folder to write the shards to "
                                                   "(default: <state dir>/calibration/NAME)")):
        add_state_args(q)
        q.add_argument("--json", action="store_true", help="machine-readable output")
        q.add_argument("name", help="the model name")
        q.add_argument("--out", required=q is e, help=out_help)
    e.set_defaults(func=run_samples_export)
    r.set_defaults(func=run_recalibrate)


def _list(journal: Any, notes: Any = None) -> List[Dict[str, Any]]:
    rejected: Dict[str, List[str]] = {}
    unconfirmed: Dict[str, List[str]] = {}  # rolled back with nobody answering: not refused
    for r in journal.rejected_versions():
        (unconfirmed if r.get("state") == "unconfirmed" else rejected).setdefault(
            r["name"], []).append(r["version"])
    pins = notes.pins if notes is not None else {}
    health = notes.health if notes is not None else {}
    return [{"name": r["name"], "version": r["version"], "state": r["state"],
             "previous": r["previous"], "precision": r["precision"],
             "engine_key": r["engine_key"], "job_id": r["job_id"], "activated": r["activated"],
             "rejected": rejected.get(r["name"], []),
             "unconfirmed": unconfirmed.get(r["name"], []),
             "retries": int((r.get("info") or {}).get("unconfirmed_retries") or 0),
             "pinned": pins.get(r["name"]), "health": health.get(r["name"], "ok")}
            for r in journal.active_versions()]


def _notes(args: argparse.Namespace) -> Any:
    """The daemon's pins and last health per name (agent.device.models.notes), read-only."""
    from agent.device.models.notes import ModelNotes

    _, state_dir, _ = daemon_dirs(args.config, args.state_dir)
    return ModelNotes.in_state_dir(state_dir)


def run_ls(args: argparse.Namespace) -> int:
    from agent.device.models.sets import ModelSets

    with open_journal(args) as journal:
        rows = _list(journal, _notes(args))
    rec = ModelSets.in_state_dir(daemon_dirs(args.config, args.state_dir)[1]).open or \
        {"members": {}}
    for r in rows:  # switched in a model set that may still revert
        if (rec["members"].get(r["name"]) or {}).get("version") == r["version"]:
            r["set"] = {"id": rec["id"], "state": "open"}
    if args.json:
        print(json.dumps({"models": rows}, indent=2, sort_keys=True))
        return 0
    if not rows:
        print("no models on this device")
        return 0
    line = "{:<24} {:<16} {:<12} {:<16} {:<9} {:<16} {:<8} {}"
    print(line.format("NAME", "VERSION", "STATE", "PREVIOUS", "PRECISION", "ENGINE", "PINNED",
                      "HEALTH"))
    for r in rows:
        state = r["state"] + (" (set {} open)".format(r["set"]["id"]) if r.get("set") else "")
        print(line.format(
            r["name"], r["version"], state, r["previous"] or "-", r["precision"] or "-",
            r["engine_key"][:16], r["pinned"] or "-", r["health"][:80]))
    return 0


def run_show(args: argparse.Namespace) -> int:
    from agent.device.models.directory import ModelsDir, read_meta, version_problem

    name = validate_name(args.name)
    cfg, _, _ = daemon_dirs(args.config, args.state_dir)
    with open_journal(args) as journal:
        versions = journal.model_versions(name)
        rejected = journal.rejected_versions(name)
        handoff = (journal.note("handoff") or {}).get(name)  # the daemon's last heal() of it
    if not versions and not rejected:
        raise AgentError("bad_argument", "expected a model name this device holds, found "
                         "{!r} (jetson-agent models ls lists them)".format(name))
    models = ModelsDir(cfg.models_dir)
    current = models.current(name)
    meta: Dict[str, Any] = {}
    problem = None
    if current:
        path = models.version_dir(name, current)
        problem = version_problem(path)
        try:
            meta = read_meta(path)
        except (OSError, ValueError):
            meta = {}
    notes = _notes(args)
    out = {"name": name, "current": current, "dir": models.name_dir(name),
           "problem": problem, "meta": meta, "pinned": notes.pins.get(name),
           "health": notes.health.get(name, "ok"),
           "versions": [{k: v[k] for k in ("version", "active", "state", "precision",
                                            "engine_key", "job_id", "activated", "previous")}
                        for v in versions],
           "rejected": rejected, "handoff": handoff,
           "live_check": meta.get("live_check"), "field": _field(args, name)}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return 0
    print("{}: current {} ({})".format(name, current or "none", out["dir"]))
    if problem:
        print("  problem: {}".format(problem))
    print("  health: {}".format(out["health"]))
    if out["pinned"]:
        print("  pinned to {} (jetson-agent models unpin {})".format(out["pinned"], name))
    if handoff:
        print("  hand-off: {}".format(handoff))
    for v in out["versions"]:
        print("  {:<16} {:<10} {:<9} engine {}  job {}  since {}{}".format(
            v["version"], v["state"] if v["active"] else "kept", v["precision"] or "-",
            v["engine_key"][:16], v["job_id"], when(v["activated"]),
            "  (active)" if v["active"] else ""))
    for r in rejected:
        print("  {} {}: {} ({})".format(r.get("state", "rejected"), r["version"], r["reason"],
                                         when(r["at"])))
    print("  live check: {}".format(_live_text(out["live_check"])))
    field = out["field"]
    if field:
        print("  INT8 ranges in the field ({} samples): clipping up to {:.2%}{}{}".format(
            field.get("samples"), field.get("clip_max", 0.0),
            "; calibration_stale: " + ", ".join(field["stale"]) if field.get("stale") else "",
            "; drifted: " + ", ".join(field["drifted"]) if field.get("drifted") else ""))
    if meta:
        print("  meta.json: {} {}, inputs {}, outputs {}".format(
            meta.get("precision"), meta.get("backend"),
            ", ".join(t["name"] for t in meta.get("inputs") or []),
            ", ".join(t["name"] for t in meta.get("outputs") or [])))
    return 0


def _field(args: argparse.Namespace, name: str) -> Any:
    """The daemon's last INT8 range figures of ``name`` (None: none measured)."""
    from agent.device.models.live_samples import SampleStore

    _, state_dir, _ = daemon_dirs(args.config, args.state_dir)
    return SampleStore(os.path.join(state_dir, "samples")).read_field(name)


def _live_text(figures: Any) -> str:
    if not figures:
        return "none recorded"
    if figures.get("skipped"):
        return "skipped: " + str(figures["skipped"])
    agreement, error = figures.get("agreement"), figures.get("error")
    return "{} on {} donated samples against {}: top-1 agreement {}, {} error {}".format(
        "passed" if figures.get("passed") else "failed", figures.get("samples"),
        figures.get("running"), "n/a" if agreement is None else "{:.3f}".format(agreement),
        figures.get("error_stat"), "NaN or infinite" if error is None else
        "{:.4g}".format(error))


def ask(path: str, request: Dict[str, Any], timeout: float = 30.0) -> Dict[str, Any]:
    """One request to the daemon's app socket; AgentError with the daemon's code."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
        s.sendall(json.dumps(request).encode("utf-8") + b"\n")
        data = b""
        while not data.endswith(b"\n") and len(data) < MAX_REPLY_BYTES:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    except PermissionError as exc:  # the socket's mode and ACL: not an app user or group
        raise AgentError("app_not_allowed", "expected a user the daemon allows on {} (root, "
                         "the service user, models.app_users, models.app_group), found uid {} "
                         "refused: {}".format(path, os.getuid(), exc.strerror or exc))
    except OSError as exc:
        raise AgentError("file_not_found", "expected the daemon's app socket at {}, found: {} "
                         "(is the daemon running, and may this user use it?)".format(
                             path, exc.strerror or exc))
    finally:
        s.close()
    try:
        reply = json.loads(data.decode("utf-8"))
    except ValueError:
        raise AgentError("internal_error", "the daemon's answer is not JSON: {!r}".format(
            data[:200]))
    if not reply.get("ok"):
        err = reply.get("error") or {}
        raise AgentError(str(err.get("code") or "internal_error"),
                         str(err.get("message") or reply))
    return reply


def _socket_op(args: argparse.Namespace, op: str) -> int:
    cfg, state_dir, _ = daemon_dirs(args.config, args.state_dir)
    request: Dict[str, Any] = {"op": op, "name": validate_name(args.name)}
    version = getattr(args, "version", None)
    if version is not None:
        request["version"] = validate_version(version)
    started = time.monotonic()
    reply = ask(cfg.models.socket or os.environ.get("JETSON_AGENT_SOCKET") or os.path.join(
        state_dir, "app.sock"), request)
    if args.json:
        print(json.dumps(reply, indent=2, sort_keys=True))
    else:
        print("{} {}: {} ({:.1f} s)".format(op, args.name, ", ".join(
            "{} {}".format(k, v) for k, v in sorted(reply.items()) if k not in ("ok", "name")),
            time.monotonic() - started))
    return 0


def run_commit(args: argparse.Namespace) -> int:
    return _socket_op(args, "commit")


def run_rollback(args: argparse.Namespace) -> int:
    return _socket_op(args, "rollback")


def run_retry(args: argparse.Namespace) -> int:
    return _socket_op(args, "retry")


def run_pin(args: argparse.Namespace) -> int:
    return _socket_op(args, "pin")


def run_unpin(args: argparse.Namespace) -> int:
    return _socket_op(args, "unpin")


SHARD_ROWS = 64  # rows per calibration shard (a build loads one shard at a time)


def _samples(args: argparse.Namespace) -> Dict[str, Any]:
    """The name's donated inputs (newest ``keep`` rows); AgentError no_samples without."""
    from agent.device.models.live_samples import SampleStore

    name = validate_name(args.name)
    cfg, state_dir, _ = daemon_dirs(args.config, args.state_dir)
    live = cfg.models.live_check
    arrays = SampleStore(os.path.join(state_dir, "samples"), live.keep,
                         live.keep_bytes).load(name)
    if not arrays:
        raise AgentError("no_samples", "expected donated inputs of {} on this device (the app's "
                         "agent.client.donate), found none".format(name))
    return arrays


def _npz(arrays: Dict[str, Any]) -> bytes:
    import io

    import numpy as np

    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def run_samples_export(args: argparse.Namespace) -> int:
    from agent.fsio import atomic_write

    arrays = _samples(args)
    atomic_write(args.out, _npz(arrays))
    rows = len(next(iter(arrays.values())))
    out = {"name": args.name, "out": os.path.abspath(args.out), "samples": rows}
    print(json.dumps(out, sort_keys=True) if args.json else
          "{} donated samples of {} written to {}".format(rows, args.name, out["out"]))
    return 0


def run_recalibrate(args: argparse.Namespace) -> int:
    """The donated rows as .npz shards (shard_000.npz ...): a calibration set in the form a
    build's --calib folder takes; older shards in the folder are replaced."""
    from agent.fsio import atomic_write

    arrays = _samples(args)
    _, state_dir, _ = daemon_dirs(args.config, args.state_dir)
    folder = os.path.abspath(args.out or os.path.join(state_dir, "calibration", args.name))
    rows = len(next(iter(arrays.values())))
    shards = []
    for i, start in enumerate(range(0, rows, SHARD_ROWS)):
        path = os.path.join(folder, "shard_{:03d}.npz".format(i))
        atomic_write(path, _npz({k: v[start:start + SHARD_ROWS] for k, v in arrays.items()}))
        shards.append(os.path.basename(path))
    for old in os.listdir(folder):  # a larger set made earlier: its extra shards go
        if old.startswith("shard_") and old.endswith(".npz") and old not in shards:
            os.unlink(os.path.join(folder, old))
    out = {"name": args.name, "dir": folder, "samples": rows, "shards": shards}
    print(json.dumps(out, sort_keys=True) if args.json else
          "calibration set of {} from {} donated samples: {} ({} shards); build with --calib "
          "{}".format(args.name, rows, folder, len(shards), folder))
    return 0
