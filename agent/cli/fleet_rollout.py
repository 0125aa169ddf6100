"""``fleet rollout``: check the model, goldens and calibration set here, build the job
documents (signed with ``--signing-key``) and check every shape before the broker sees anything;
then ``--dry-run`` shows the plan, or ``fleet_serve`` submits the rollout to a service or runs
it embedded.
"""

import argparse
import hashlib
import json
import os
import tempfile
from typing import Any, Dict, List, Optional

from agent import fleet
from agent.cli import EXIT_OK, fleet_serve
from agent.cli.fleet_connect import add_connection_args, connect
from agent.cli.fleet_registry import registry_db
from agent.errors import AgentError
from agent.wire import job_signer, protocol

ROLLOUT_EPILOG = (
    "exit status: 0 every device SUCCEEDED; 1 otherwise; 2 bad input (nothing published); "
    "130 Ctrl-C. Ctrl-C with a fleet service (--submit, or one is up on --db): detaches, the "
    "service drives the rollout on (fleet rollouts attach ID). Ctrl-C embedded (no service): "
    "nothing would follow the devices once this process ends, so every device not finished "
    "is cancelled, running ones included, and shown CANCELED.")
GATE_STATS = ("elemwise", "max", "mean", "median")
SEARCH_MODES = ("minimal", "bisect", "linear", "worst-first")
CALIB_ALGORITHMS = ("entropy2", "minmax", "percentile", "legacy")


def add_parser(fsub: Any) -> None:
    r = fsub.add_parser("rollout", help="deploy a model to devices in stages",
                        description="Deploy a model to devices in stages; see docs/fleet.md.",
                        epilog=ROLLOUT_EPILOG)
    add_rollout_args(r)
    add_connection_args(r)
    r.set_defaults(func=run_rollout)
    fleet_serve.add_rollout_mode_args(r)


def add_rollout_args(r: argparse.ArgumentParser) -> None:
    a = r.add_argument_group("what to deploy")
    a.add_argument("--model", required=True, metavar="M.onnx")
    a.add_argument("--name", metavar="NAME",
                   help="the model's name on the devices ([a-z0-9][a-z0-9_.-]{0,63}): a new "
                        "version of a name replaces the old one there, different names live "
                        "side by side (sent to devices whose status lists the feature "
                        "named_models; older devices name it sha-<12 hex of the model>)")
    a.add_argument("--version", metavar="V",
                   help="with --name: this version ([A-Za-z0-9][A-Za-z0-9_.+-]{0,63}; "
                        "default: the first 12 hex digits of the model's sha256)")
    a.add_argument("--model-set", metavar="ID",
                   help="with --name: this name is one of a model set, switched and committed "
                        "with the other names of the set or rolled back with them (one "
                        "rollout per name, each with the same --model-set and "
                        "--model-set-names; sent to devices whose status lists model_sets)")
    a.add_argument("--model-set-names", metavar="A,B",
                   help="with --model-set: every name of the set (2 to 8, comma-separated)")
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
    g.add_argument("--class-labels", "--labels", dest="labels", metavar="F",
                   help="true classes of the input rows (.npy); --labels is its older name")
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
    from agent.fleet.rollouts.spec import spec_from_flags

    _check_numbers(args)
    from agent.fleet.rollouts.spec import model_name_version, model_set_spec

    model_name_version(args.name, args.version, "0" * 64)  # checked before any work
    model_set_spec(args.model_set, args.model_set_names, args.name)
    fleet.check_policy(fleet.Policy(args.success_threshold, args.abort_failure_rate,
                                    args.min_executed))
    user_layers = parse_layer_precisions(args.layer_precisions)
    if args.share_group is not None and not protocol.valid_id(args.share_group):
        raise AgentError("bad_argument", "--share-group must be 1-64 characters of "
                         "[A-Za-z0-9._-], found {!r}".format(args.share_group))
    rollout_id = fleet.check_rollout_id(args.rollout_id or fleet.new_rollout_id(
        args.model, base=args.name))
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
        spec = spec_from_flags(vars(args), artifacts, user_layers, args.timeout)
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
    from agent.fleet.admission import admission
    from agent.fleet.database.store import Store
    from agent.fleet.rollouts import preview

    registry: Dict[str, Dict[str, Any]] = {}
    url = registry_db(args)
    if url:
        store = Store(url, schema="read")
        try:
            for dev in store.devices():
                registry[dev["device"]] = {"status": dev["status"],
                                           "last_seen": dev["last_seen"]}
            admission.check_members(store, args.devices or [], registry)
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

