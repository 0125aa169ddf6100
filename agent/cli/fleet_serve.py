"""``fleet serve`` (the controller service), ``fleet rollouts ls|show|pause|resume|cancel|
attach`` (rollouts in its database), and how ``fleet rollout`` runs: submitted to a service
that is up on the same database, or embedded (the same service loop, in this process, for
this one rollout). Their arguments and output; what they do is agent.fleet.commands' (``serve``,
``rollouts``, ``rollout_run``). Registered by ``agent.cli.fleet``; the database arguments are
``fleet_db``'s.
"""

import argparse
import json
import os
import sys
import time
from typing import Any, Dict

from agent import fleet
from agent.cli import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK
from agent.cli.fleet_admission import add_admission_args, admission_policy
from agent.cli.fleet_db import add_db_args, db_url
from agent.errors import AgentError
from agent.fleet.database.store import Store
from agent.fleet.service import LEASE_S
from agent.wire import job_signer

# ---------------------------------------------------------------------------- fleet rollout

def submit_or_embed(args: argparse.Namespace, rollout_id: str, spec: Dict[str, Any],
                    files: Dict[str, str], artifacts: Dict[str, Dict[str, Any]], work: str,
                    signer: Any, connect: Any) -> int:
    """The rest of ``fleet rollout`` once everything was checked locally
    (agent.fleet.commands.rollout_run)."""
    from agent.fleet.commands import rollout_run

    opts = rollout_run.RunOptions(
        db=args.db, store=args.store, submit=args.submit, embedded=args.embedded,
        detach=args.detach, quiet=args.quiet, timeout=args.timeout,
        share_group=args.share_group, admission=admission_policy(args),
        targets=rollout_run.Targets(args.devices, args.all, args.match, args.batch,
                                    args.percent),
        model_path=args.model, precision=args.precision, search=args.search,
        broker=getattr(args, "broker", None))
    done = rollout_run.submit_or_embed(opts, rollout_id, spec, files, artifacts, work, signer,
                                       lambda: connect(args), _say)
    if done.detached:
        print(rollout_id)
        return EXIT_OK
    return _finish(done, rollout_id, args.json)


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def _finish(done: Any, rollout_id: str, as_json: bool) -> int:
    """Print how a rollout ended (or that Ctrl-C detached from it); its exit status."""
    if done.report is None:
        print("detached: rollout {} goes on in the fleet service (fleet rollouts attach {})"
              .format(rollout_id, rollout_id), file=sys.stderr)
        return EXIT_INTERRUPTED
    _print_report(done.report, done.rollout, as_json)
    if done.interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if done.rollout.succeeded else EXIT_FAILED


def _print_report(report: Dict[str, Any], ro: fleet.Rollout, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report, indent=2, sort_keys=True, default=str))
    else:
        print(fleet.results_table(report["devices"]))
        if report.get("preflight"):
            print(fleet.preflight_summary(report["preflight"], report["devices"]))
        print(fleet.summary_line(ro))


# ---------------------------------------------------------------------------- fleet serve

def run_serve(args: argparse.Namespace, connect: Any) -> int:
    from agent.device.sdnotify import Notifier
    from agent.fleet.commands.serve import ServeOptions, serve

    serve(ServeOptions(
        db_url=db_url(args), store=args.store, no_db_upgrade=args.no_db_upgrade,
        admission=admission_policy(args), instance=args.instance, share_group=args.share_group,
        lease=args.lease, http=args.http, http_url=args.http_url,
        http_tls_cert=args.http_tls_cert, http_tls_key=args.http_tls_key,
        http_min_bytes=args.http_min_bytes, share_engines=args.share_engines,
        builders=args.builders, share_quorum=args.share_quorum, share_wait=args.share_wait,
        signing_key=args.signing_key, sequence_file=args.sequence_file,
        valid_for=args.valid_for, dashboard=args.dashboard,
        dashboard_token_file=args.dashboard_token_file,
        telemetry_retention=args.telemetry_retention), lambda: connect(args), Notifier())
    return EXIT_OK


# ---------------------------------------------------------------------------- fleet rollouts

def run_rollouts(args: argparse.Namespace) -> int:
    from agent.fleet.commands import rollout_run, rollouts

    store = Store(db_url(args, existing=True), schema="read")
    try:
        if args.action == "ls":
            rows = rollouts.rows(store)
            if args.json:
                print(json.dumps(rows, indent=2, sort_keys=True, default=str))
                return EXIT_OK
            table = [[r["rollout_id"], r["state_text"], r["model_name"] or "-", "{}/{}".format(
                max(r["current_stage"] + 1, 0), len(r["stages"])),
                ", ".join("{} {}".format(n, s) for s, n in sorted(r["counts"].items())),
                time.strftime("%Y-%m-%d %H:%M", time.localtime(r["created"] or 0)),
                (r["reason"] or "-")[:60]] for r in rows]
            print(fleet.format_table(["ROLLOUT", "STATE", "MODEL", "STAGE", "DEVICES",
                                      "CREATED", "REASON"], table) if table else "no rollouts")
            return EXIT_OK
        if not args.rollout_id:
            raise AgentError("bad_argument", "fleet rollouts {} needs a rollout id".format(
                args.action))
        if args.action in rollouts.CONTROLS:
            row = rollouts.control(store, args.rollout_id, args.action)
            print("rollout {}: {} requested (was {}); the service applies it within a second"
                  .format(args.rollout_id, args.action, row["state"]))
            return EXIT_OK
        if args.action == "attach":
            return _finish(rollout_run.attach(store, args.rollout_id, False), args.rollout_id,
                           args.json)
        report, ro, summary = rollouts.show(store, args.rollout_id, args.history)
        if args.json:
            print(json.dumps(report, indent=2, sort_keys=True, default=str))
        else:
            print("rollout {}: {} (stage {}/{}); model {}".format(
                ro.rollout_id, summary["state_text"], max(ro.current + 1, 0), len(ro.stages),
                summary.get("model_name") or "-"))
            print(fleet.results_table(report["devices"]))
            print(fleet.summary_line(ro))
            for b in summary.get("rollbacks") or []:
                print("rollback of {} ({}, request {}): {}".format(
                    b["device"], b["name"] or (b["model"] or "")[:12], b["request_id"],
                    b["outcome"]))
        return EXIT_OK
    finally:
        store.close()


def add_parsers(fsub: Any, add_connection_args: Any, connect: Any) -> None:
    s = fsub.add_parser("serve", help="the fleet controller as a service (rollouts in a "
                        "database, served until stopped)",
                        description="Run the fleet controller service: keeps the device "
                        "registry, drives every submitted rollout, serves artifacts; see "
                        "docs/fleet.md.")
    add_connection_args(s)
    add_db_args(s)
    add_admission_args(s)
    s.add_argument("--no-db-upgrade", action="store_true",
                   help="refuse a database that is not at this version's schema (with the "
                        "`fleet db upgrade` command to run) instead of upgrading it on start")
    s.add_argument("--instance", metavar="NAME", help="this instance's name for rollout "
                   "leases (default HOST-HASH of the database: stable across restarts, so a "
                   "restart takes its dead predecessor's rollouts back at once; a second live "
                   "service on the host gets HOST-HASH-PID; a NAME a live service holds is "
                   "refused)")
    s.add_argument("--share-group", metavar="NAME", help="take block requests through "
                   "$share/NAME/... (several instances; each serves every artifact in the "
                   "database, so --store must be shared)")
    s.add_argument("--http", metavar="HOST:PORT", help="also serve the artifact store over "
                   "HTTP (Range requests) on this address (:PORT: loopback only; devices need "
                   "an address they reach, e.g. 0.0.0.0:8470, with a warning)")
    s.add_argument("--http-url", metavar="URL", help="the base URL devices use to reach --http "
                   "(default http://HOST:PORT, https://HOST:PORT with --http-tls-cert; a "
                   "reverse proxy with TLS, a CDN)")
    s.add_argument("--http-tls-cert", metavar="FILE", help="with --http: serve HTTPS (TLS 1.2 "
                   "or later) with this PEM certificate (chain); devices verify it with their "
                   "transfer.http_ca_file or broker.tls.ca_file (docs/security.md)")
    s.add_argument("--http-tls-key", metavar="FILE", help="the private key of --http-tls-cert "
                   "(PEM)")
    s.add_argument("--http-min-bytes", type=int, default=1 << 20, metavar="N",
                   help="with --http: artifacts of at least N bytes carry the URL in their job "
                        "documents (default 1 MiB); smaller ones go over MQTT blocks only")
    s.add_argument("--share-engines", action="store_true",
                   help="with --http: fleet engine sharing; the first designated builder of "
                        "each class builds and uploads its engine, the others of its class "
                        "adopt it once the builder's signed report names it "
                        "(docs/fleet.md, Engine sharing)")
    s.add_argument("--builders", metavar="ID,...",
                   help="with --share-engines: the designated builders, the only devices whose "
                        "engines are shared (besides those labelled role=builder by an "
                        "operator); the others of a class with none in the rollout build "
                        "themselves")
    s.add_argument("--share-quorum", type=int, default=1, metavar="K",
                   help="with --share-engines: K designated builders of a class build, and "
                        "the others adopt only once K of them reported the same outputs on "
                        "the rollout's inputs (default 1)")
    s.add_argument("--share-wait", type=float, default=900.0, metavar="S",
                   help="with --share-engines: a device waits at most S s for its class's "
                        "engine, then builds itself (default 900)")
    s.add_argument("--lease", type=float, default=LEASE_S, metavar="S",
                   help="another instance takes over a rollout S seconds (on the database's "
                        "clock) after this one stopped renewing its lease (default "
                        "{:g})".format(LEASE_S))
    s.add_argument("--signing-key", metavar="KEY",
                   default=os.environ.get("JETSON_AGENT_FLEET_SIGNING_KEY"))
    s.add_argument("--sequence-file", metavar="F")
    s.add_argument("--valid-for", type=float, default=job_signer.DEFAULT_VALIDITY_S, metavar="S")
    _add_dashboard_args(s)
    s.set_defaults(func=lambda a: run_serve(a, connect))

    r = fsub.add_parser("rollouts", help="rollouts in the fleet database: ls, show, pause, "
                        "resume, cancel, attach")
    r.add_argument("action", choices=("ls", "show", "pause", "resume", "cancel", "attach"))
    r.add_argument("rollout_id", nargs="?", metavar="ID")
    r.add_argument("--history", action="store_true", help="show: every job status received")
    r.add_argument("--json", action="store_true")
    add_db_args(r)
    r.set_defaults(func=run_rollouts)


def _add_dashboard_args(p: argparse.ArgumentParser) -> None:
    from agent.fleet.database import history

    g = p.add_argument_group("dashboard and metrics")
    g.add_argument("--dashboard", metavar="HOST:PORT", default=os.environ.get(
        "JETSON_AGENT_FLEET_DASHBOARD"), help="serve the dashboard and Prometheus /metrics here "
        "(e.g. :8480, loopback only; 0.0.0.0:8480 for every interface, with a warning; off "
        "by default)")
    g.add_argument("--dashboard-token-file", metavar="F", help="a file holding the token that "
                   "enables dashboard actions (pause/resume/cancel, rollback), or one "
                   "NAME:TOKEN per line (the audit trail names who acted); without it the "
                   "dashboard is read-only")
    g.add_argument("--telemetry-retention", type=float, default=history.RETENTION_S / 86400,
                   metavar="DAYS", help="how long telemetry history is kept (default "
                   "%(default)s days; also capped at {} samples per device)".format(
                       history.MAX_ROWS_PER_DEVICE))


def add_rollout_mode_args(r: argparse.ArgumentParser) -> None:
    add_admission_args(r)
    g = r.add_argument_group("service")
    add_db_args(r)
    mode = g.add_mutually_exclusive_group()
    mode.add_argument("--submit", action="store_true", help="hand the rollout to 'fleet serve' "
                      "on --db (default when one is up there)")
    mode.add_argument("--embedded", action="store_true", help="run it in this process even if "
                      "a service is up")
    g.add_argument("--detach", action="store_true", help="with --submit: print the rollout id "
                   "and return at once")
