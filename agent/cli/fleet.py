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
- ``fleet keygen --out DIR``: an Ed25519 key pair for signing job documents
  (docs/security.md); ``fleet rollout --signing-key KEY`` signs with it.
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
import uuid
from typing import Any, Dict, List, Optional

from agent import fleet
from agent.errors import AgentError
from agent.wire import job_signer, protocol
from agent.wire.topics import DEFAULT_PREFIX, TopicInfo

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
ROLLOUT_EPILOG = (
    "exit status: 0 every device SUCCEEDED; 1 otherwise; 2 bad input (nothing published); "
    "130 Ctrl-C. Ctrl-C with a fleet service (--submit, or one is up on --db): detaches, the "
    "service drives the rollout on (fleet rollouts attach ID). Ctrl-C embedded (no service): "
    "nothing would follow the devices once this process ends, so every device not finished "
    "is cancelled, running ones included, and shown CANCELED.")
GATE_STATS = ("elemwise", "max", "mean", "median")
SEARCH_MODES = ("minimal", "bisect", "linear", "worst-first")
CALIB_ALGORITHMS = ("entropy2", "minmax", "percentile", "legacy")


# ---------------------------------------------------------------------------- arguments

def add_connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("broker")
    g.add_argument("--broker", metavar="URL",
                   default=os.environ.get("JETSON_AGENT_FLEET_BROKER", "mqtt://localhost:1883"),
                   help="mqtt://HOST:PORT or mqtts://HOST:PORT (default $JETSON_AGENT_FLEET_BROKER "
                        "or mqtt://localhost:1883)")
    g.add_argument("--prefix", default=DEFAULT_PREFIX,
                   help="topic prefix (default %(default)s)")
    g.add_argument("--username", help="MQTT user name")
    g.add_argument("--password-file", metavar="FILE", help="file holding the MQTT password")
    g.add_argument("--ca-file", metavar="FILE", help="CA bundle for TLS (implies TLS)")
    g.add_argument("--cert-file", metavar="FILE",
                   help="client certificate for mutual TLS (with --key-file; implies TLS)")
    g.add_argument("--key-file", metavar="FILE", help="the client certificate's private key")
    g.add_argument("--mqtt", choices=("v5", "v3.1.1"), default="v5",
                   help="MQTT protocol version (default v5)")
    g.add_argument("--connect-timeout", type=float, default=5.0, metavar="S",
                   help="give up connecting after S seconds (default 5)")


def connect(args: argparse.Namespace) -> fleet.FleetConnection:
    password = None
    if args.password_file:
        try:
            with open(args.password_file) as f:
                password = f.read().strip()
        except OSError as exc:
            raise AgentError("file_not_found", "cannot read --password-file {}: {}".format(
                args.password_file, exc.strerror))
    if (args.cert_file is None) != (args.key_file is None):
        raise AgentError("bad_argument", "--cert-file and --key-file go together (mutual TLS); "
                         "found only {}".format("--cert-file" if args.cert_file else
                                                "--key-file"))
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(args, name)
        if path is not None and not os.access(path, os.R_OK):
            raise AgentError("file_not_found", "--{} {} cannot be read".format(
                name.replace("_", "-"), path))
    conn = fleet.FleetConnection(args.broker, args.prefix, username=args.username,
                                 password=password, ca_file=args.ca_file,
                                 protocol_version=args.mqtt,
                                 connect_timeout=args.connect_timeout,
                                 cert_file=args.cert_file, key_file=args.key_file)
    return conn.connect()


def add_parser(sub: Any) -> None:
    p = sub.add_parser("fleet", help="controller: devices, staged rollouts, jobs, telemetry",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    fsub = p.add_subparsers(dest="fleet_command",
                            metavar="devices|rollout|rollouts|serve|rollback|jobs|cancel|telemetry|"
                                   "keygen")

    d = fsub.add_parser("devices", help="devices that reported to the broker")
    add_connection_args(d)
    d.add_argument("--wait", type=float, default=1.0, metavar="S",
                   help="listen S seconds for telemetry (default 1)")
    d.add_argument("--json", action="store_true")
    d.add_argument("--db", metavar="URL", default=os.environ.get("JETSON_AGENT_FLEET_DB"),
                   help="read the registry of 'fleet serve' from this database (every "
                        "device ever heard of, last known board) instead of the broker; "
                        "default: the default database when a service runs on it")
    d.set_defaults(func=run_devices)

    r = fsub.add_parser("rollout", help="deploy a model to devices in stages",
                        description="Deploy a model to devices in stages; see docs/fleet.md.",
                        epilog=ROLLOUT_EPILOG)
    add_rollout_args(r)
    add_connection_args(r)
    r.set_defaults(func=run_rollout)
    from agent.cli import fleet_serve

    fleet_serve.add_rollout_mode_args(r)
    fleet_serve.add_parsers(fsub, add_connection_args, connect)
    from agent.fleet import rollback

    rollback.add_parser(fsub, add_connection_args, connect)

    j = fsub.add_parser("jobs", help="job statuses retained on the broker")
    add_connection_args(j)
    j.add_argument("--device", action="append", metavar="ID", help="only this device "
                   "(repeatable)")
    j.add_argument("--json", action="store_true")
    j.add_argument("--db", metavar="URL", default=os.environ.get("JETSON_AGENT_FLEET_DB"),
                   help="every per-device job of every rollout in the database of 'fleet "
                        "serve' (the broker keeps nothing for finished jobs)")
    j.set_defaults(func=run_jobs)

    c = fsub.add_parser("cancel", help="cancel a job (or a rollout) on devices")
    add_connection_args(c)
    c.add_argument("job_id", metavar="JOB", help="job id, or a rollout id (its search job too)")
    c.add_argument("--devices", nargs="+", metavar="ID", help="only these devices")
    c.add_argument("--wait", type=float, default=15.0, metavar="S",
                   help="wait up to S seconds for each device's own final job state "
                        "(default 15); after that: 'cancel requested'")
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=run_cancel)

    t = fsub.add_parser("telemetry", help="a device's health metrics")
    add_connection_args(t)
    t.add_argument("device", metavar="DEVICE")
    t.add_argument("--follow", action="store_true", help="print every sample until Ctrl-C")
    t.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="without --follow: wait at most S seconds (default 10)")
    t.add_argument("--json", action="store_true")
    t.set_defaults(func=run_telemetry)

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


def add_rollout_args(r: argparse.ArgumentParser) -> None:
    a = r.add_argument_group("what to deploy")
    a.add_argument("--model", required=True, metavar="M.onnx")
    a.add_argument("--precision", required=True, choices=("fp32", "fp16", "int8", "best"))
    a.add_argument("--fallback", choices=("allow", "reject"), default="reject",
                   help="where a device lacks --precision: fall back to a wider one (allow) or "
                        "refuse the job (reject, default)")
    a.add_argument("--calib", metavar="DIR|FILE",
                   help="INT8 calibration data: a directory of .npz/.npy shards or one file")
    a.add_argument("--calib-algorithm", choices=CALIB_ALGORITHMS,
                   help="calibration algorithm (device default: entropy2)")
    a.add_argument("--calib-batch-size", type=int, metavar="N")
    a.add_argument("--layer-precisions", nargs="+", metavar="NAME:PREC", default=[],
                   help="keep these layers in float32/float16")
    a.add_argument("--rollout-id", metavar="ID", help="job id to use (default: from the model)")
    a.add_argument("--artifact-url", action="append", default=[], metavar="ROLE=URL",
                   help="devices may fetch this artifact (model, calibration, inputs, goldens, "
                        "labels) from an HTTP(S) URL with Range requests: a CDN or an object "
                        "store's pre-signed URL (checked against the same hashes; MQTT blocks "
                        "when it fails)")
    g = r.add_argument_group("accuracy gate (Polygraphy semantics)")
    g.add_argument("--inputs", metavar="F", help="inputs the goldens were computed from "
                   "(Polygraphy --save-inputs JSON or .npz)")
    g.add_argument("--golden", metavar="F", help="golden outputs (Polygraphy --save-outputs "
                   "JSON or .npz)")
    g.add_argument("--labels", metavar="F", help="true classes of the input rows (.npy)")
    g.add_argument("--atol", type=float)
    g.add_argument("--rtol", type=float)
    g.add_argument("--check-error-stat", choices=GATE_STATS)
    g.add_argument("--min-top1", type=float, metavar="R",
                   help="classifiers: top-1 agreement with the goldens at least R (0..1)")
    g.add_argument("--no-accuracy-gate", action="store_true",
                   help="deploy without goldens: devices accept any output (refused "
                        "without this flag; the results table says 'not gated')")
    s = r.add_argument_group("precision search (a search job, then a deploy job with its answer)")
    s.add_argument("--search", choices=SEARCH_MODES)
    s.add_argument("--search-direction", choices=("forward", "reverse"))
    s.add_argument("--max-evaluations", type=int, metavar="N")
    s.add_argument("--preflight", action="store_true",
                   help="run the search on this host's emulation (onnxruntime) first; devices "
                   "verify its set with one build and search only if it fails")
    b = r.add_argument_group("benchmark")
    b.add_argument("--bench-iterations", type=int, metavar="N")
    b.add_argument("--bench-warmup", type=int, metavar="N")
    t = r.add_argument_group("targets and stages")
    who = t.add_mutually_exclusive_group(required=True)
    who.add_argument("--devices", nargs="+", metavar="ID")
    who.add_argument("--all", action="store_true", help="every device that reported")
    who.add_argument("--match", metavar="PATTERN", help="device ids matching a glob pattern")
    size = t.add_mutually_exclusive_group()
    size.add_argument("--batch", type=int, metavar="N", help="N devices per stage")
    size.add_argument("--percent", type=float, metavar="P", help="P%% of the devices per stage")
    t.add_argument("--success-threshold", type=float, default=1.0, metavar="R",
                   help="fraction of a stage that must succeed before the next (default 1)")
    t.add_argument("--abort-failure-rate", type=float, metavar="R",
                   help="stop when more than R of the finished devices failed")
    t.add_argument("--min-executed", type=int, default=1, metavar="K",
                   help="judge the failure rate once K devices finished (default 1)")
    t.add_argument("--timeout", type=float, default=3600.0, metavar="S",
                   help="give up on devices not finished after S seconds (default 3600)")
    t.add_argument("--job-timeout", type=float, metavar="S",
                   help="in-progress timeout the devices apply to each job")
    t.add_argument("--share-group", metavar="NAME",
                   help="take block requests through the MQTT v5 shared subscription "
                        "$share/NAME/... (several controllers serving the same files)")
    sg = r.add_argument_group("signing (docs/security.md)")
    sg.add_argument("--signing-key", metavar="KEY",
                    default=os.environ.get("JETSON_AGENT_FLEET_SIGNING_KEY"),
                    help="sign the job documents with this Ed25519 private key (from 'fleet "
                         "keygen'; default $JETSON_AGENT_FLEET_SIGNING_KEY); devices refuse "
                         "unsigned jobs unless they allow_unsigned")
    sg.add_argument("--sequence-file", metavar="F",
                    help="the signer's sequence numbers (default "
                         "$XDG_STATE_HOME/jetson-agent/fleet-sequence.json)")
    sg.add_argument("--valid-for", type=float, default=job_signer.DEFAULT_VALIDITY_S,
                    metavar="S", help="devices refuse the jobs after S seconds (default "
                    "86400); devices offline longer never run them")
    o = r.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    o.add_argument("-q", "--quiet", action="store_true", help="no live progress")
    o.add_argument("--dry-run", action="store_true",
                   help="check everything and show the targets, stages, artifacts, gate and "
                        "each device's precision decision (from its last known platform); "
                        "publish nothing")


def parse_layer_precisions(items: List[str]) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for item in items:
        name, sep, prec = item.rpartition(":")
        if not sep or not name or prec not in ("float32", "float16", "int8"):
            raise AgentError("bad_argument", "--layer-precisions expects NAME:float32, "
                             "NAME:float16 or NAME:int8, found {!r}".format(item))
        out[name] = prec
    return out


# ---------------------------------------------------------------------------- rollout

def _artifact_refs(files: Dict[str, str], work: Optional[str] = None
                   ) -> Dict[str, Dict[str, Any]]:
    """role -> job document reference. With ``work``: each carries its per-block hash list
    (written there and added to ``files`` as ``ROLE.blocks``, served like any artifact)."""
    from agent.wire.block_server import block_digests, sha256_file

    refs: Dict[str, Dict[str, Any]] = {}
    for role, path in sorted(files.items()):
        size = os.path.getsize(path)
        refs[role] = {"sha256": sha256_file(path), "size": size,
                      "name": os.path.basename(path)[:255]}
        if work is not None:
            block_size = protocol.manifest_block_size(size)
            digests = block_digests(path, block_size)
            list_path = os.path.join(work, role + ".blocks")
            with open(list_path, "wb") as f:
                f.write(digests)
            refs[role]["blocks"] = {"block_size": block_size,
                                    "sha256": hashlib.sha256(digests).hexdigest()}
    if work is not None:
        for role in list(refs):
            files[role + ".blocks"] = os.path.join(work, role + ".blocks")
    return refs


def _add_urls(artifacts: Dict[str, Dict[str, Any]], items: List[str]) -> None:
    for item in items:
        role, sep, url = item.partition("=")
        if not sep or role not in artifacts or not url.startswith(("http://", "https://")) \
                or len(url) > 2048 or any(c.isspace() for c in url):
            raise AgentError("bad_argument", "--artifact-url expects ROLE=http(s)://... with "
                             "ROLE one of {} (at most 2048 characters, no spaces), found {!r}"
                             .format(", ".join(sorted(artifacts)), item[:100]))
        artifacts[role]["url"] = url


def _check_numbers(args: argparse.Namespace) -> None:
    for name in ("atol", "rtol"):
        value = getattr(args, name)
        if value is not None and not value >= 0:
            raise AgentError("bad_argument", "--{} must be >= 0, found {}".format(name, value))
    if args.min_top1 is not None and not 0 <= args.min_top1 <= 1:
        raise AgentError("bad_argument", "--min-top1 must be in [0, 1], found {}".format(
            args.min_top1))
    for name in ("calib_batch_size", "max_evaluations", "bench_iterations"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise AgentError("bad_argument", "--{} must be >= 1, found {}".format(
                name.replace("_", "-"), value))
    if args.bench_warmup is not None and args.bench_warmup < 0:
        raise AgentError("bad_argument", "--bench-warmup must be >= 0, found {}".format(
            args.bench_warmup))
    for name in ("timeout", "job_timeout"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise AgentError("bad_argument", "--{} must be > 0, found {}".format(
                name.replace("_", "-"), value))


def make_doc_factory(args: argparse.Namespace, artifacts: Dict[str, Dict[str, Any]],
                     user_layers: Dict[str, str]) -> fleet.DocFactory:
    from agent.fleet.spec import spec_from_args

    return fleet.doc_factory(spec_from_args(args, artifacts, user_layers, args.timeout))


def _signed(docs: fleet.DocFactory, signer: job_signer.Signer) -> fleet.DocFactory:
    """The same documents, signed; the dry run of the checks allocates no sequence."""

    def signed(device: str, job_id: str, kind: str, layers: Optional[Dict[str, str]]
               ) -> Dict[str, Any]:
        doc = signer.sign(docs(device, job_id, kind, layers), dry_run=device == "check")
        size = len(protocol.encode(doc))
        if size > protocol.MAX_BYTES["job"]:
            raise AgentError("bad_argument", "the signed job document is {} bytes; devices "
                             "accept at most {}".format(size, protocol.MAX_BYTES["job"]))
        return doc

    return signed


def run_rollout(args: argparse.Namespace) -> int:
    from agent.cli import fleet_serve
    from agent.fleet.spec import spec_from_args

    _check_numbers(args)
    fleet.check_policy(fleet.Policy(args.success_threshold, args.abort_failure_rate,
                                    args.min_executed))
    user_layers = parse_layer_precisions(args.layer_precisions)
    if args.share_group is not None and not protocol.valid_id(args.share_group):
        raise AgentError("bad_argument", "--share-group must be 1-64 characters of "
                         "[A-Za-z0-9._-], found {!r}".format(args.share_group))
    rollout_id = fleet.check_rollout_id(args.rollout_id or fleet.new_rollout_id(args.model))
    with tempfile.TemporaryDirectory(prefix="jetson-agent-rollout-") as work:
        files = fleet.prepare_rollout(
            args.model, args.precision, work, calib=args.calib, inputs=args.inputs,
            goldens=args.golden, labels=args.labels, layer_precisions=user_layers,
            min_top1=args.min_top1, search=args.search)
        if not args.golden and not args.no_accuracy_gate:
            raise AgentError("no_accuracy_gate", "this rollout has no accuracy gate: expected "
                             "--golden (with --inputs) so devices check the engine's outputs, "
                             "found none; to deploy ungated on purpose add "
                             "--no-accuracy-gate")
        preflight = None
        if args.preflight:
            if not args.search:
                raise AgentError("bad_argument", "--preflight predicts the search's answer: "
                                 "expected --search MODE with it, found none")
            from agent.cli.fleet_preflight import host_preflight

            preflight = host_preflight(args, files)
            args.predicted = preflight["keep"]
        artifacts = _artifact_refs(files, work)
        _add_urls(artifacts, args.artifact_url)
        spec = spec_from_args(args, artifacts, user_layers, args.timeout)
        if preflight is not None:
            spec["preflight"] = preflight
        docs = fleet.doc_factory(spec)
        signer = None
        if args.signing_key:
            signer = job_signer.Signer(args.signing_key, args.sequence_file, args.valid_for)
            docs = _signed(docs, signer)
        # Every document shape is checked now, before the broker sees anything.
        for kind in (["search"] if args.search else []) + ["deploy"]:
            docs("check", rollout_id, kind, None)
        if args.dry_run:
            return _dry_run(args, rollout_id, spec)
        return fleet_serve.submit_or_embed(args, rollout_id, spec, files, artifacts, work,
                                           signer, connect)


def _dry_run(args: argparse.Namespace, rollout_id: str, spec: Dict[str, Any]) -> int:
    """Targets and stages from the registry (the service's database, else the broker's
    retained statuses): subscribes, publishes nothing."""
    from agent.fleet import preview
    from agent.fleet.store import Store

    registry: Dict[str, Dict[str, Any]] = {}
    url = _registry_db(args)
    if url:
        store = Store(url)
        try:
            for dev in store.devices():
                registry[dev["device"]] = {"status": dev["status"],
                                           "last_seen": dev["last_seen"]}
        finally:
            store.close()
    else:
        conn = connect(args)
        try:
            directory = fleet.discover(conn)
        finally:
            conn.close()
        registry = {d: {"status": directory.status[d]} for d in directory.known()}
    devices = fleet.select_devices(list(registry), args.devices, args.all, args.match)
    stages = fleet.plan_stages(devices, args.batch, args.percent)
    job_ids = ([rollout_id + fleet.SEARCH_SUFFIX] if args.search else []) + [rollout_id]
    plan = preview.dry_run_plan(rollout_id, spec, stages, registry, job_ids)
    if args.json:
        print(json.dumps(plan, indent=2, sort_keys=True))
    else:
        print(preview.dry_run_text(plan))
    return EXIT_OK


# ---------------------------------------------------------------------------- devices

def _age(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "-"
    seconds = max(0.0, time.time() - ts)
    if seconds < 120:
        return "{:.0f}s ago".format(seconds)
    if seconds < 7200:
        return "{:.0f}m ago".format(seconds / 60)
    return "{:.0f}h ago".format(seconds / 3600)


def telemetry_summary(metrics: Any) -> str:
    """The first telemetry rows with their units (agent/cli/telemetry_view.py)."""
    from agent.cli import telemetry_view

    return telemetry_view.summary(metrics if isinstance(metrics, dict) else {}, limit=4)


def device_rows(directory: fleet.DeviceDirectory,
                last_seen: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """``last_seen``: device -> when the registry last heard from it (default: the time of
    its last status). An offline device keeps the board its last full status named."""
    rows = []
    for dev in directory.known():
        st = directory.status[dev]
        plat = st.get("platform") or {}
        tele = directory.telemetry.get(dev)
        rows.append({
            "device": dev, "online": st.get("online"), "boot": st.get("boot"),
            "since": st.get("ts"), "reason": st.get("reason"),
            "board": plat.get("board"), "jetpack": plat.get("jetpack"),
            "tensorrt": plat.get("tensorrt"), "backend": plat.get("backend"),
            "precisions": plat.get("precisions"), "agent_version": st.get("agent_version"),
            "active_engines": st.get("active_engines") or [],
            "telemetry": tele,
            "last_seen": (last_seen or {}).get(dev, st.get("ts")),
        })
    return rows


def _db_directory(url: str) -> Any:
    """(directory, device -> last seen) from the registry of 'fleet serve'."""
    from agent.fleet.store import Store

    store = Store(url)
    try:
        directory = fleet.DeviceDirectory()
        seen: Dict[str, Any] = {}
        for dev in store.devices():
            directory.status[dev["device"]] = dev["status"]
            seen[dev["device"]] = dev["last_seen"]
            if dev["telemetry"]:
                directory.telemetry[dev["device"]] = dev["telemetry"]
        return directory, seen
    finally:
        store.close()


def _registry_db(args: argparse.Namespace) -> Optional[str]:
    """--db, else the default database when a fleet service is running on it."""
    from agent.cli.fleet_serve import service_up
    from agent.fleet.store import default_db_url

    if args.db:
        return str(args.db)
    return default_db_url() if service_up(default_db_url()) else None


def run_devices(args: argparse.Namespace) -> int:
    url = _registry_db(args)
    seen = None
    if url:
        directory, seen = _db_directory(url)
    else:
        conn = connect(args)
        try:
            directory = fleet.discover(conn, telemetry_wait=max(0.0, args.wait))
        finally:
            conn.close()
    rows = device_rows(directory, seen)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return EXIT_OK
    if not rows:
        print("no device has reported to {} under {}/".format(args.broker, args.prefix))
        return EXIT_OK
    table = []
    for r in rows:
        online = "yes" if r["online"] else "no ({})".format(r["reason"] or "offline")
        tele = r["telemetry"]
        table.append([r["device"], online, str(r["board"] or "-"), str(r["jetpack"] or "-"),
                      str(r["tensorrt"] or "-"), str(r["backend"] or "-"),
                      ",".join(r["precisions"] or []) or "-", str(len(r["active_engines"])),
                      _age(r["last_seen"]),
                      "{} ({})".format(telemetry_summary(tele.get("metrics")), _age(tele.get(
                          "ts"))) if tele else "-"])
    print(fleet.format_table(["DEVICE", "ONLINE", "BOARD", "JETPACK", "TENSORRT", "BACKEND",
                              "PRECISIONS", "ENGINES", "LAST SEEN", "TELEMETRY"], table))
    return EXIT_OK


# ---------------------------------------------------------------------------- jobs

def _retained_jobs(conn: fleet.FleetConnection) -> Dict[Any, Dict[str, Any]]:
    """(device, job id) -> {"status": last status or None, "document": pending doc or None}"""
    found: Dict[Any, Dict[str, Any]] = {}

    def on_message(info: TopicInfo, msg: Any) -> None:
        if info.kind == "job_status":
            entry = found.setdefault((info.device, info.job_id), {"status": None,
                                                                  "document": None})
            if entry["status"] is None or msg.get("version", 0) > entry["status"].get(
                    "version", 0):
                entry["status"] = msg
        elif info.kind == "job" and msg.payload:
            try:
                doc = protocol.decode("job", msg.payload)
            except AgentError:
                return
            entry = found.setdefault((info.device, info.job_id), {"status": None,
                                                                  "document": None})
            entry["document"] = doc

    base = conn.topics.prefix + "/devices/+"
    conn.subscribe([base + "/status", base + "/jobs/+", base + "/jobs/+/status"])
    conn.settle(on_message)
    return found


def _db_jobs(url: str) -> Dict[Any, Dict[str, Any]]:
    from agent.fleet.store import Store

    store = Store(url)
    try:
        found: Dict[Any, Dict[str, Any]] = {}
        for j in store.device_jobs():
            found[(j["device"], j["job_id"])] = {"status": {
                "kind": j["phase"], "state": j["state"], "stage": j["job_stage"],
                "ts": j["updated"], "error": j["error"]}, "document": None}
        return found
    finally:
        store.close()


def run_jobs(args: argparse.Namespace) -> int:
    url = _registry_db(args)
    if url:
        found = _db_jobs(url)
    else:
        conn = connect(args)
        try:
            found = _retained_jobs(conn)
        finally:
            conn.close()
    rows = []
    for (dev, job_id), entry in sorted(found.items()):
        if args.device and dev not in args.device:
            continue
        st = entry["status"] or {}
        doc = entry["document"] or {}
        state = st.get("state") or "SENT"
        rows.append({"device": dev, "job_id": job_id, "kind": st.get("kind") or doc.get("kind"),
                     "state": state, "stage": None if protocol.is_terminal(state) else
                     st.get("stage"),  # a finished job's last stage (activating) is past
                     "version": st.get("version"), "updated": st.get("ts"),
                     "error": st.get("error"), "pending_document": bool(entry["document"])})
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
        return EXIT_OK
    if not rows:
        print("no retained jobs")
        return EXIT_OK
    table = [[r["device"], r["job_id"], str(r["kind"] or "?"), r["state"],
              str(r["stage"] or "-"), _age(r["updated"]),
              "{}: {}".format(r["error"].get("code"), r["error"].get("message", ""))[:70]
              if r["error"] else "-"] for r in rows]
    print(fleet.format_table(["DEVICE", "JOB", "KIND", "STATE", "STAGE", "UPDATED", "ERROR"],
                             table))
    return EXIT_OK


# ---------------------------------------------------------------------------- cancel

def run_cancel(args: argparse.Namespace) -> int:
    conn = connect(args)
    try:
        found = _retained_jobs(conn)
        known = conn.directory.known()
        if args.devices:
            fleet.select_devices(known, args.devices)
        ids = (args.job_id, args.job_id + fleet.SEARCH_SUFFIX)
        targets: Dict[Any, Dict[str, Any]] = {}
        for (dev, job_id), entry in found.items():
            if job_id not in ids or (args.devices and dev not in args.devices):
                continue
            st = entry["status"]
            if entry["document"] or st is None or not protocol.is_terminal(st.get("state", "")):
                targets[(dev, job_id)] = entry
        if args.devices:
            for dev in args.devices:
                if not any(d == dev for d, _ in targets):
                    targets[(dev, args.job_id)] = {"status": None, "document": None}
        if not targets:
            raise AgentError("unknown_job", "no device has an unfinished job {!r} (nothing "
                             "retained on the broker under {}/)".format(args.job_id,
                                                                        args.prefix))
        replies: Dict[str, Dict[str, Any]] = {}
        requests: Dict[str, Any] = {}
        final: Dict[Any, Dict[str, Any]] = {}  # (device, job) -> its own terminal status
        last: Dict[Any, Dict[str, Any]] = {}

        def on_message(info: TopicInfo, msg: Any) -> None:
            if info.kind == "command_reply" and msg.get("request_id") in requests:
                replies[msg["request_id"]] = msg
            elif info.kind == "job_status" and (info.device, info.job_id) in targets:
                key = (info.device, info.job_id)
                if int(msg.get("version") or 0) > int((last.get(key) or {}).get("version")
                                                      or 0):
                    last[key] = msg
                    if protocol.is_terminal(str(msg.get("state"))):
                        final[key] = msg

        conn.subscribe([conn.topics.prefix + "/devices/+/commands/reply"])
        conn.settle(on_message)
        for key, entry in targets.items():
            if entry["status"]:
                last[key] = entry["status"]
        for (dev, job_id), entry in sorted(targets.items()):
            if entry["document"]:
                conn.publish(conn.topics.job(dev, job_id), b"", qos=1, retain=True)
            rid = "c" + uuid.uuid4().hex[:10]
            requests[rid] = (dev, job_id)
            conn.publish(conn.topics.commands(dev), protocol.encode({
                "protocol": protocol.PROTOCOL_VERSION, "command": "cancel", "request_id": rid,
                "job_id": job_id}), qos=1)
        conn.flush()
        # The device's reply only says the cancel was taken; its job status says when the
        # job really stopped (a build may take seconds to end): wait for that, bounded.
        deadline = time.monotonic() + max(0.0, args.wait)

        def answered(rid: str) -> bool:
            reply = replies.get(rid)
            if reply is None:
                return False
            return not reply.get("ok") or requests[rid] in final

        while not all(answered(rid) for rid in requests) and time.monotonic() < deadline:
            conn.pump(on_message, 0.2)
    finally:
        conn.close()
    out = []
    for rid, (dev, job_id) in sorted(requests.items(), key=lambda kv: kv[1]):
        reply = replies.get(rid)
        entry = targets[(dev, job_id)]
        fin = final.get((dev, job_id))
        out.append({"device": dev, "job_id": job_id,
                    "document_cleared": bool(entry["document"]),
                    "reply": reply, "online": (conn.directory.status.get(dev) or {}).get(
                        "online"),
                    "final_state": fin.get("state") if fin else None,
                    "last_state": (last.get((dev, job_id)) or {}).get("state"),
                    "outcome": _cancel_outcome(reply, fin)})
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return EXIT_OK
    for r in out:
        reply = r["reply"]
        if reply is None:
            what = "no reply{}".format(" (device offline: the broker keeps the command for "
                                       "its session)" if r["online"] is False else "")
        elif not reply.get("ok"):
            err = reply.get("error") or {}
            what = "not cancelled: {} {}".format(err.get("code"), err.get("message", ""))
        elif r["final_state"] == "CANCELED":
            what = "CANCELED (the device's final state)"
        elif r["final_state"]:
            what = "{} (the device's final state: it finished before the cancel)".format(
                r["final_state"])
        else:
            what = "cancel requested; the device reported no final state within {:.0f} s " \
                   "(last: {})".format(args.wait, r["last_state"] or "none")
        if r["document_cleared"]:
            what += "; retained job document cleared"
        print("{} {}: {}".format(r["device"], r["job_id"], what))
    return EXIT_OK


def _cancel_outcome(reply: Optional[Dict[str, Any]], final: Optional[Dict[str, Any]]) -> str:
    """no_reply | refused | cancelled | finished (before the cancel) | requested (no final
    state from the device in time)."""
    if reply is None:
        return "no_reply"
    if not reply.get("ok"):
        return "refused"
    if final is None:
        return "requested"
    return "cancelled" if final.get("state") == "CANCELED" else "finished"


# ---------------------------------------------------------------------------- telemetry

def _print_telemetry(msg: Dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(msg, sort_keys=True), flush=True)
        return
    when = time.strftime("%H:%M:%S", time.localtime(msg.get("ts") or time.time()))
    from agent.cli import telemetry_view

    lines = telemetry_view.table(msg.get("metrics") or {})
    print("{} {} ({})".format(when, msg.get("device"), msg.get("source", "?")), flush=True)
    print("\n".join(lines or ["  (no metrics)"]), flush=True)


def run_telemetry(args: argparse.Namespace) -> int:
    conn = connect(args)
    samples: List[Dict[str, Any]] = []
    try:
        fleet.discover(conn)
        fleet.select_devices(conn.directory.known(), [args.device])
        status = conn.directory.status[args.device]
        rid = "d" + uuid.uuid4().hex[:10]

        def on_message(info: TopicInfo, msg: Any) -> None:
            if info.device != args.device:
                return
            if info.kind == "telemetry":
                samples.append(msg)
            elif info.kind == "command_reply" and msg.get("request_id") == rid and msg.get("ok"):
                tele = (msg.get("result") or {}).get("telemetry")
                if tele and not samples:
                    samples.append({"protocol": 1, "device": args.device, "ts": time.time(),
                                    "source": "diag", "metrics": tele})

        conn.subscribe([conn.topics.telemetry(args.device)], 0)
        conn.subscribe([conn.topics.command_reply(args.device)])
        conn.settle(on_message)
        if status.get("online") is not False:
            # The diag reply carries the last sample: no wait for the next telemetry tick.
            conn.publish(conn.topics.commands(args.device), protocol.encode({
                "protocol": protocol.PROTOCOL_VERSION, "command": "diag", "request_id": rid}),
                qos=1)
        if args.follow:
            try:
                while True:
                    conn.pump(on_message, 0.5)
                    while samples:
                        _print_telemetry(samples.pop(0), args.json)
            except KeyboardInterrupt:
                return EXIT_OK
        deadline = time.monotonic() + args.timeout
        while not samples and time.monotonic() < deadline:
            conn.pump(on_message, 0.2)
    finally:
        conn.close()
    if not samples:
        why = "it is offline since {}".format(_age(status.get("ts"))) \
            if status.get("online") is False else "nothing within {:.0f} s".format(args.timeout)
        print("no telemetry from {}: {}".format(args.device, why), file=sys.stderr)
        return EXIT_FAILED
    _print_telemetry(samples[0], args.json)
    return EXIT_OK


# ---------------------------------------------------------------------------- keygen

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
