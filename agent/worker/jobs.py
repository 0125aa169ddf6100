"""What a job does once its artifacts are on disk: deploy, search, bench (runs in the worker).

The daemon writes a *job spec* (``make_spec``): the job document's parameters plus the local
facts it decided (artifact paths in the store, the precision after the platform check, the
backend, cache directories, the platform fingerprint). ``run_job(spec, emit, should_stop)``
executes it, reporting progress through ``emit`` and returning the result dict that goes into
the job status.

- deploy: build (calibrating INT8 per plan) through the engine cache, gate accuracy against the
  goldens (Polygraphy comparator, plus top-1 agreement and label accuracy for classifiers),
  benchmark, and return the engine key for the daemon to activate (the journal is the daemon's).
- search: the precision search (which layers must stay in higher precision); a stop request
  returns the partial result.
- bench: build (or reuse) the engine and measure latency/throughput.

Beside it: ``context`` (``JobContext``: the spec checked, artifacts staged, the steps the kinds
share) and ``accuracy`` (the gate).

Worker side: Python >= 3.6. Heavy modules are imported inside the functions.
"""

import os
from typing import Any, Dict, Optional

from agent.errors import AgentError
from agent.worker.accuracy import accuracy_report, gate_failure
from agent.worker.context import MAX_LISTED, SPEC_VERSION, Emit, JobContext, ShouldStop

SEARCH_SUMMARY_KEYS = ("mode", "direction", "precision", "keep_precision", "candidates", "keep",
                       "layer_precisions", "passed", "complete", "interrupted", "exhausted",
                       "evaluations", "builds", "cache_hits", "seconds", "engine_key", "message",
                       "comparison", "suspects", "prediction_passed", "one_minimal",
                       "out_of_reach", "layers_kept", "candidate_nodes")


def make_spec(
    job_id: str,
    kind: str,
    plan: Dict[str, Any],
    artifacts: Dict[str, str],
    backend: str,
    work_dir: str,
    cache_dir: str,
    calibration_dir: str,
    platform_fingerprint: Dict[str, str],
    engine_budget_bytes: Optional[int] = None,
    gate: Optional[Dict[str, Any]] = None,
    bench: Optional[Dict[str, Any]] = None,
    search: Optional[Dict[str, Any]] = None,
    fallback_reason: Optional[str] = None,
    limits: Optional[Dict[str, Any]] = None,
) -> Dict[str, Any]:
    """The worker's instructions (JSON-serialisable). ``plan`` has ``precision`` already set to
    what the platform check decided; ``artifacts`` maps roles to files in the store;
    ``limits`` the caps on what artifacts may inflate to (``agent.engines.safe_npz.configure``) and
    the worker's memory limit (named in an ``out_of_memory`` error)."""
    return {
        "spec_version": SPEC_VERSION,
        "job_id": job_id,
        "kind": kind,
        "plan": plan,
        "artifacts": dict(artifacts),
        "backend": backend,
        "work_dir": work_dir,
        "cache_dir": cache_dir,
        "calibration_dir": calibration_dir,
        "platform_fingerprint": dict(platform_fingerprint),
        "engine_budget_bytes": engine_budget_bytes,
        "gate": dict(gate or {}),
        "bench": dict(bench or {}),
        "search": dict(search or {}),
        "fallback_reason": fallback_reason,
        "limits": dict(limits or {}),
    }


def run_deploy(job: JobContext) -> Dict[str, Any]:
    job.progress("checking", 0, 0)
    data = job.load_goldens()
    record = job.build()
    digest = None  # the engine's outputs on the rollout's inputs (engine sharing's quorum)
    if job.should_stop():
        raise AgentError("cancelled", "stopped after building the engine")
    result = job.common(record)
    with job.cache.pin(record.key):
        with job.backend.open(record.engine_path) as runner:
            feeds = None
            if data is not None:
                job.progress("verifying", 0, len(data["inputs"]))
                outputs = []
                for i, feed in enumerate(data["inputs"]):
                    outputs.append(runner.infer(feed))
                    job.progress("verifying", i + 1, len(data["inputs"]))
                report = accuracy_report(outputs, data["outputs"], job.spec.get("gate", {}),
                                         data["labels"])
                result["accuracy"] = report
                if not report["passed"]:
                    raise gate_failure(report)
                feeds = data["inputs"][0]
                digest = outputs_digest(outputs)
            else:
                result["accuracy"] = None  # nothing to gate against: said so in the result
            if job.should_stop():
                raise AgentError("cancelled", "stopped after verifying the engine")
            result.update(job.bench(runner, feeds))
            # The engine's inputs and outputs, for the model version's meta.json (the daemon
            # takes them out of the job's result).
            result["io"] = {"inputs": [t.to_dict() for t in runner.inputs],
                            "outputs": [t.to_dict() for t in runner.outputs]}
    result["activate"] = True
    result["engine"] = record.engine_path
    calibration = _calibration_cache(job, record)
    if calibration:  # beside the version's engine: DeepStream's int8-calib-file
        result["calibration_cache"] = calibration
    _share_result(job, record, result, digest)
    # What the controller's results table shows: layers pinned away from the plan's precision.
    result["layers_kept"] = dict(job.plan.layer_precisions)
    return result


def run_bench(job: JobContext) -> Dict[str, Any]:
    data = job.load_goldens()
    feeds = None
    if data is None and "inputs" in job.files:
        from agent.precision import golden

        feeds = golden.load_inputs(job.files["inputs"])[0]
    elif data is not None:
        feeds = data["inputs"][0]
    record = job.build()
    result = job.common(record)
    with job.cache.pin(record.key):
        with job.backend.open(record.engine_path) as runner:
            result.update(job.bench(runner, feeds))
    return result


def run_search(job: JobContext) -> Dict[str, Any]:
    from agent.precision.searcher import run_search as search

    data = job.load_goldens()
    if data is None:
        raise AgentError("golden_mismatch", "a search job needs 'inputs' and 'goldens' "
                         "artifacts to judge each candidate")
    opts = job.spec.get("search", {})
    gate = job.spec.get("gate", {})
    compare_options = {k: gate[k] for k in ("atol", "rtol", "check_error_stat",
                                            "error_quantile") if gate.get(k) is not None}
    max_evaluations = opts.get("max_iterations")
    job.progress("searching", 0, 0)
    found = search(job.files["model"], job.plan, data["inputs"], data["outputs"], job.backend,
                   job.cache, job.spec["platform_fingerprint"],
                   mode=opts.get("mode", "minimal"), direction=opts.get("direction", "forward"),
                   compare_options=compare_options, progress=job.progress,
                   should_stop=job.should_stop,
                   max_evaluations=int(max_evaluations) if max_evaluations else None,
                   calibration_dir=job.spec["calibration_dir"],
                   predicted=opts.get("predicted"))
    full = found.to_dict()
    # The job status stays small (controllers cap it at 64 KiB): a summary of the search,
    # the last evaluations, and the layers kept in higher precision.
    result = {k: full.get(k) for k in SEARCH_SUMMARY_KEYS if k in full}
    result["iterations"] = [{k: it.get(k) for k in ("index", "size", "passed", "seconds",
                                                    "cache_hit")}
                            for it in (full.get("iterations") or [])[-MAX_LISTED:]]
    result["sensitivity"] = (full.get("sensitivity") or [])[:MAX_LISTED]
    untested = full.get("untested_removals") or []
    result["untested_removals"] = untested[:MAX_LISTED]
    result["untested_removals_count"] = len(untested)
    result["layers_kept"] = {name: full.get("keep_precision", "float32")
                             for name in (full.get("keep") or [])}
    result["fallback_reason"] = job.spec.get("fallback_reason")
    result["backend"] = job.backend.name
    result["emulated"] = job.backend.name != "tensorrt"
    result["partial"] = bool(job.should_stop()) or bool(full.get("partial"))
    return result


RUNNERS = {"deploy": run_deploy, "search": run_search, "bench": run_bench}


def run_job(spec: Dict[str, Any], emit: Emit, should_stop: ShouldStop) -> Dict[str, Any]:
    kind = spec.get("kind")
    if kind not in RUNNERS:
        raise AgentError("unknown_job_kind", "the worker runs {} jobs, found {!r}".format(
            ", ".join(sorted(RUNNERS)), kind))
    job = JobContext(spec, emit, should_stop)
    return RUNNERS[kind](job)


def outputs_digest(outputs: Any) -> str:
    """SHA-256 of an engine's outputs on the job's inputs, in order, by output name; floats
    rounded to float16 first (so two builds that differ only below fp16 agree). What builders
    report for the quorum (``fleet serve --share-quorum``)."""
    import hashlib

    import numpy as np

    digest = hashlib.sha256()
    for out in outputs:
        for name in sorted(out):
            arr = np.asarray(out[name])
            if arr.dtype.kind == "f":
                arr = arr.astype(np.float16)
            digest.update(name.encode("utf-8") + b"\0" + str(arr.shape).encode("ascii"))
            digest.update(np.ascontiguousarray(arr).tobytes())
    return digest.hexdigest()


def _share_result(job: JobContext, record: Any, result: Dict[str, Any],
                  digest: Optional[str] = None) -> None:
    """``result["share"]``: whether this device built its engine or adopted the fleet's (and
    why it fell back); a device its job document asks to offer its engine uploads it now,
    and reports the digest of its outputs on the job's inputs."""
    share = dict(job.share)
    offer_url = (job.spec.get("share") or {}).get("offer")
    if offer_url and share.get("mode") != "adopted":
        entry = job.cache.get(record.key, touch=False)
        info = dict(entry.meta) if entry is not None else {}
        share.update(engine_share_offer(offer_url, record, info, job))
        if digest:
            share["outputs_sha256"] = digest
    if share:
        share.setdefault("mode", "cached" if record.cache_hit else "built")
        result["share"] = share


def _calibration_cache(job: JobContext, record: Any) -> Optional[str]:
    """The TensorRT calibration cache an INT8 engine was built from, if it is on disk."""
    entry = job.cache.get(record.key, touch=False)
    calib = (((entry.meta if entry is not None else {}).get("plan") or {}).get(
        "calibration") or {}).get("cache")
    return calib if isinstance(calib, str) and os.path.isfile(calib) else None


def engine_share_offer(url: str, record: Any, info: Dict[str, Any], job: JobContext
                       ) -> Dict[str, Any]:
    from agent.engines import share as engine_share

    calib = ((info.get("plan") or {}).get("calibration") or {}).get("cache")
    share = job.spec.get("share") or {}
    return engine_share.offer(url, record.key, record.engine_path, info,
                              str(job.spec.get("device") or ""), job.spec["work_dir"],
                              calibration_cache=calib if isinstance(calib, str) else None,
                              signer=share.get("signer"), job_id=str(job.spec.get("job_id")),
                              engine_class=share.get("engine_class"),
                              ca_file=share.get("ca_file"))
