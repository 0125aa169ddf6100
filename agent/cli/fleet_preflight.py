"""``fleet rollout --search ... --preflight``: the precision search on this host's emulation
(the onnxruntime backend) before anything is sent. It runs ``jetson-agent search`` in a
subprocess, so the controller never imports the worker's heavy dependencies; its set goes into
the search job as ``search.predicted``, which each device verifies with one build and searches
further only if that build fails (docs/search.md, pre-flight)."""

import argparse
import json
import subprocess
import sys
from typing import Any, Dict, List, Mapping

from agent.errors import AgentError

MAX_PREDICTED, MAX_NAME = 4096, 256  # the job schema's bounds on search.predicted


def search_argv(args: argparse.Namespace, files: Mapping[str, str]) -> List[str]:
    """The ``jetson-agent search`` command line that mirrors the devices' search job."""
    argv = [sys.executable, "-m", "agent", "search", args.model, "--" + args.precision,
            "--backend", "onnxruntime", "--mode", args.search, "--json", "-q",
            "--load-inputs", files["inputs"], "--load-outputs", files["goldens"]]
    if args.search_direction:
        argv += ["--direction", args.search_direction]
    if args.max_evaluations:
        argv += ["--max-evaluations", str(args.max_evaluations)]
    for flag in ("atol", "rtol", "check_error_stat"):
        value = getattr(args, flag)
        if value is not None:
            argv += ["--" + flag.replace("_", "-"), str(value)]
    if args.layer_precisions:
        argv += ["--layer-precisions"] + list(args.layer_precisions)
    if args.calib:
        argv += ["--calib", args.calib]
        if args.calib_algorithm:
            argv += ["--calib-algo", args.calib_algorithm]
        if args.calib_batch_size:
            argv += ["--calib-batch-size", str(args.calib_batch_size)]
    return argv


def host_preflight(args: argparse.Namespace, files: Mapping[str, str]) -> Dict[str, Any]:
    """Run the host search; returns its summary (keep, evaluations, passed). Raises
    ``search_failed`` when it did not find a passing set (the devices would search anyway:
    run without --preflight)."""
    if not args.quiet:
        print("pre-flight: searching on the host emulation (onnxruntime)...", file=sys.stderr)
    proc = subprocess.run(search_argv(args, files), capture_output=True, text=True)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        raise AgentError("search_failed", "the host pre-flight search ended with status {} "
                         "and no result: {}".format(proc.returncode,
                                                    proc.stderr.strip()[-400:] or "no output"))
    keep = doc.get("keep") if isinstance(doc, dict) else None
    if not (isinstance(doc, dict) and doc.get("passed") and isinstance(keep, list)):
        raise AgentError("search_failed", "the host pre-flight search found no passing set "
                         "(expected one to predict the devices' answer, found: {}); run the "
                         "rollout without --preflight".format(
                             str(doc.get("message") if isinstance(doc, dict) else doc)[:400]))
    if len(keep) > MAX_PREDICTED or any(len(str(n)) > MAX_NAME for n in keep):
        raise AgentError("search_failed", "the host pre-flight kept {} layer(s); a job "
                         "carries at most {} names of at most {} characters".format(
                             len(keep), MAX_PREDICTED, MAX_NAME))
    return {"backend": "onnxruntime", "keep": [str(n) for n in keep],
            "evaluations": doc.get("evaluations"), "seconds": doc.get("seconds")}
