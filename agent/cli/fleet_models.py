"""``fleet models push|ls|show|rm``: the model registry in the fleet database
(``agent.fleet.deployments.registry``). ``push`` checks the files as ``fleet rollout`` does, copies
them into the service's content-addressed store (each file once) and records the version with its
default settings.
"""

import argparse
import json
import os
import tempfile
import time
from typing import Any, Dict

from agent import fleet
from agent.cli import EXIT_OK
from agent.cli.fleet_db import add_db_args, db_url
from agent.errors import AgentError
from agent.fleet.database.store import Store
from agent.fleet.deployments import registry
from agent.wire import model_names


def add_parser(fsub: Any) -> None:
    from agent.cli.fleet_rollout import CALIB_ALGORITHMS, GATE_STATS, SEARCH_MODES

    p = fsub.add_parser("models", help="the model registry: push, ls, show, rm, verify",
                        description="Model versions the fleet can deploy (fleet deploy "
                        "NAME@VERSION); see docs/fleet.md, Model registry.")
    msub = p.add_subparsers(dest="models_command", metavar="push|ls|show|rm|verify")
    push = msub.add_parser("push", help="store a version: model, calibration set, goldens, "
                           "class labels and default settings (immutable)")
    push.add_argument("model", metavar="M.onnx")
    push.add_argument("--name", required=True, metavar="NAME")
    push.add_argument("--version", required=True, metavar="V")
    push.add_argument("--calib", metavar="DIR|FILE", help="INT8 calibration data")
    push.add_argument("--inputs", metavar="F", help="inputs the goldens were computed from")
    push.add_argument("--golden", metavar="F", help="golden outputs")
    push.add_argument("--class-labels", metavar="F", help="true classes of the input rows "
                      "(.npy; fleet rollout calls it --labels)")
    push.add_argument("--notes", metavar="TEXT", default="")
    d = push.add_argument_group("defaults of fleet deploy (each may be overridden there)")
    d.add_argument("--precision", choices=("fp32", "fp16", "int8", "best"))
    d.add_argument("--fallback", choices=("allow", "reject"))
    d.add_argument("--atol", type=float)
    d.add_argument("--rtol", type=float)
    d.add_argument("--check-error-stat", choices=GATE_STATS)
    d.add_argument("--min-top1", type=float, metavar="R")
    d.add_argument("--calib-algorithm", choices=CALIB_ALGORITHMS)
    d.add_argument("--calib-batch-size", type=int, metavar="N")
    d.add_argument("--search", choices=SEARCH_MODES)
    d.add_argument("--search-direction", choices=("forward", "reverse"))
    d.add_argument("--max-evaluations", type=int, metavar="N")
    d.add_argument("--layer-precisions", nargs="+", metavar="NAME:PREC", default=[])
    push.add_argument("--json", action="store_true")
    h = push.add_argument_group("through the service (from another host)")
    h.add_argument("--server", metavar="URL", default=os.environ.get(
        "JETSON_AGENT_FLEET_SERVER"), help="the service's --http URL (http[s]://HOST:PORT; "
        "default $JETSON_AGENT_FLEET_SERVER): the files are uploaded into its store. Without "
        "it: straight into the store the --db database names (on the service's host)")
    h.add_argument("--token-file", metavar="F", default=os.environ.get(
        "JETSON_AGENT_FLEET_TOKEN_FILE"), help="the operator's token (the service's "
        "--dashboard-token-file; default $JETSON_AGENT_FLEET_TOKEN_FILE)")
    h.add_argument("--ca-file", metavar="F", help="with an https:// --server: the CA that "
                   "signed its certificate (default: the system's)")
    add_db_args(push)
    push.set_defaults(func=run_push)
    for action, text in (("ls", "versions in the registry"),
                         ("show", "one version (NAME@VERSION) or a name's versions"),
                         ("rm", "remove a version (refused while deployed or kept on devices)")):
        a = msub.add_parser(action, help=text)
        a.add_argument("ref", nargs="?" if action == "ls" else None, metavar="NAME[@VERSION]")
        a.add_argument("--json", action="store_true")
        add_db_args(a)
        a.set_defaults(func=run_models, models_action=action)
    v = msub.add_parser("verify", help="hash every blob in the registry's store and check "
                        "every version's references (exit 1 with the problems)")
    v.add_argument("--json", action="store_true")
    add_db_args(v)
    v.set_defaults(func=run_verify)
    p.set_defaults(func=lambda args: p.print_help() or 2)


def run_push(args: argparse.Namespace) -> int:
    from agent.cli.fleet_rollout import _artifact_refs, parse_layer_precisions
    from agent.fleet.commands import models

    name = model_names.validate_name(args.name)
    version = model_names.validate_version(args.version)
    layers = parse_layer_precisions(args.layer_precisions)
    defaults = {k: getattr(args, k) for k in registry.DEFAULT_KEYS
                if k != "layer_precisions" and getattr(args, k, None) is not None}
    if layers:
        defaults["layer_precisions"] = layers
    url = "" if args.server else db_url(args)
    with tempfile.TemporaryDirectory(prefix="jetson-agent-push-") as work:
        files = fleet.prepare_rollout(
            args.model, args.precision or ("int8" if args.calib else "fp32"), work,
            calib=args.calib, inputs=args.inputs, goldens=args.golden,
            labels=args.class_labels, layer_precisions=layers, min_top1=args.min_top1,
            search=args.search)
        artifacts = _artifact_refs(files, work)
        record: Dict[str, Any] = {"artifacts": artifacts, "defaults": defaults,
                                  "notes": str(args.notes)[:4096],
                                  "source": os.path.basename(args.model)[:255]}
        if args.server:
            added = models.push_http(args.server, args.token_file, args.ca_file, name, version,
                                     record, files)
        else:
            added = models.push_local(url, args.store, name, version, record, files)
    out = {"name": name, "version": version, "added": added,
           "model": artifacts["model"]["sha256"], "artifacts": sorted(artifacts)}
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print("{}@{}: {} (model {}, {})".format(
            name, version, "stored" if added else "already stored, identical",
            artifacts["model"]["sha256"][:12], ", ".join(sorted(artifacts))))
    return EXIT_OK


def run_verify(args: argparse.Namespace) -> int:
    from agent.cli import EXIT_FAILED
    from agent.fleet.commands import models

    out = models.verify(db_url(args, existing=True), args.store)
    root, n, problems = out["store"], out["blobs"], out["problems"]
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        for p in problems:
            print("{}  {}  {}  (used by {})".format(p["kind"], p["sha256"][:16], p["message"],
                                                    ", ".join(p["versions"]) or "nothing"))
        print("store {}: {} blob(s), {} reference(s), {}".format(
            root, n, out["references"], "{} problem(s)".format(len(problems)) if problems
            else "all sound"))
    return EXIT_FAILED if problems else EXIT_OK


def _line(v: Dict[str, Any]) -> list:
    return ["{}@{}".format(v["name"], v["version"]),
            v["artifacts"]["model"]["sha256"][:12], ",".join(sorted(v["artifacts"])),
            ",".join("{}={}".format(k, x) for k, x in sorted(v["defaults"].items())
                     if k != "layer_precisions") or "-",
            time.strftime("%Y-%m-%d %H:%M", time.localtime(v["created"] or 0)),
            (v.get("notes") or "-")[:40]]


def run_models(args: argparse.Namespace) -> int:
    store = Store(db_url(args, existing=True))
    try:
        action = args.models_action
        name, version = registry.parse_ref(args.ref) if args.ref else (None, None)
        if action == "rm":
            if name is None or version is None:
                raise AgentError("bad_argument", "fleet models rm: expected NAME@VERSION, "
                                 "found {!r}".format(args.ref))
            registry.remove(store, name, version)
            print("{}@{}: removed from the registry".format(name, version))
            return EXIT_OK
        if action == "show" and name is not None and version is not None:
            from agent.fleet.commands import models

            v = models.show(store, name, version)
            if args.json:
                print(json.dumps(v, indent=2, sort_keys=True, default=str))
            else:
                print("{}@{}  (digest {})".format(name, version, v["digest"][:16]))
                for role, ref in sorted(v["artifacts"].items()):
                    b = v["blobs"].get(role) or {}
                    print("  {:<12} {}  {} bytes  {}  (blob used by {} version(s){})".format(
                        role, ref["sha256"][:16], ref["size"], ref.get("name"),
                        b.get("versions", 0), "; " + b["problem"] if b.get("problem") else ""))
                print("  defaults: {}".format(json.dumps(v["defaults"], sort_keys=True)))
                print("  notes: {}".format(v.get("notes") or "-"))
                print("  deployments: {}".format(", ".join(v["used_by"]["deployments"])
                                                 or "none"))
                print("  kept on {} device(s)".format(len(v["used_by"]["devices"])))
            return EXIT_OK
        rows = registry.versions(store, name)
        if args.json:
            print(json.dumps(rows, indent=2, sort_keys=True, default=str))
        elif rows:
            print(fleet.format_table(["VERSION", "MODEL", "ARTIFACTS", "DEFAULTS", "PUSHED",
                                      "NOTES"], [_line(v) for v in rows]))
        else:
            print("no model versions (fleet models push)")
        return EXIT_OK
    finally:
        store.close()
