"""A rollout's specification as stored in the database (``rollouts.spec``): what to deploy and
how, enough to rebuild the job documents after a restart (``doc_factory``) and the policy.
``fleet rollout`` builds it from its flags' values (``spec_from_flags``)."""

from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from agent.fleet.rollouts.documents import Checked, job_document
from agent.fleet.rollouts.policy import Policy
from agent.fleet.rollouts.rollout import DocFactory

# The ``fleet rollout`` arguments a job document depends on.
DOC_KEYS = ("precision", "fallback", "atol", "rtol", "check_error_stat", "min_top1",
            "calib_algorithm", "calib_batch_size", "search", "search_direction",
            "max_evaluations", "bench_iterations", "bench_warmup", "job_timeout", "predicted")


Features = Callable[[str], Any]  # device -> the features its status lists (a set of strings)


def model_name_version(name: Any, version: Any, model_sha: str
                       ) -> Tuple[Optional[str], Optional[str]]:
    """``--name`` / ``--version`` checked (bad_model_name, bad_model_version); the version
    defaults to the first 12 hex digits of the model's sha256. No name: (None, None), the
    devices name the model ``sha-<12 hex>`` themselves."""
    from agent.errors import AgentError
    from agent.wire import model_names

    if name is None:
        if version is not None:
            raise AgentError("bad_argument", "--version names a version of a model: expected "
                             "--name NAME with it, found none")
        return None, None
    return (model_names.validate_name(name),
            model_names.validate_version(version) if version is not None
            else model_names.default_version(model_sha))


def model_set_spec(set_id: Any, names: Any, model_name: Optional[str]
                   ) -> Optional[Dict[str, Any]]:
    """``--model-set ID --model-set-names a,b`` -> the job's ``model_set`` (None without them;
    bad_argument), as the job document's schema wants it."""
    from agent.errors import AgentError
    from agent.wire import model_names, protocol

    if set_id is None and names is None:
        return None
    listed = [n.strip() for n in str(names or "").split(",") if n.strip()]
    try:
        for n in listed:
            model_names.validate_name(n)
    except AgentError as exc:
        raise AgentError("bad_argument", "--model-set-names: {}".format(exc.message))
    if set_id is None or not protocol.valid_id(str(set_id)) or not model_name or \
            model_name not in listed or len(set(listed)) != len(listed) or \
            not 2 <= len(listed) <= 8:
        raise AgentError("bad_argument", "a model set needs --model-set ID, --name NAME and "
                         "--model-set-names listing 2 to 8 distinct names including NAME, "
                         "found --model-set {!r}, --name {!r}, --model-set-names {!r}".format(
                             set_id, model_name, names))
    return {"id": str(set_id), "names": listed}


def spec_from_flags(flags: Mapping[str, Any], artifacts: Mapping[str, Mapping[str, Any]],
                    user_layers: Mapping[str, str], timeout: float) -> Dict[str, Any]:
    """``flags``: ``fleet rollout``'s values by name (the document keys, ``name``, ``version``,
    ``model_set``, ``model_set_names``, ``model``, and the policy's ``success_threshold``,
    ``abort_failure_rate``, ``min_executed``)."""
    spec: Dict[str, Any] = {k: flags.get(k) for k in DOC_KEYS}
    spec["model_name"], spec["model_version"] = model_name_version(
        flags.get("name"), flags.get("version"), str(artifacts["model"]["sha256"]))
    model_set = model_set_spec(flags.get("model_set"), flags.get("model_set_names"),
                               spec["model_name"])
    if model_set is not None:
        spec["model_set"] = model_set
    spec.update({"artifacts": {k: dict(v) for k, v in artifacts.items()},
                 "layer_precisions": dict(user_layers), "timeout": float(timeout),
                 "model_path": flags.get("model"),
                 "policy": {"success_threshold": flags["success_threshold"],
                            "abort_failure_rate": flags["abort_failure_rate"],
                            "min_executed": flags["min_executed"]}})
    return spec


def policy_of(spec: Mapping[str, Any]) -> Policy:
    p = spec.get("policy") or {}
    return Policy(float(p.get("success_threshold", 1.0)), p.get("abort_failure_rate"),
                  int(p.get("min_executed", 1)))


def doc_factory(spec: Mapping[str, Any],
                url_for: Optional[Callable[[Mapping[str, Any]], Optional[str]]] = None,
                offer_url: Optional[Callable[[str], Optional[str]]] = None,
                features: Optional[Features] = None) -> DocFactory:
    """device, job id, kind, layers -> an unsigned job document for ``spec``. ``url_for``:
    an artifact reference -> the HTTP(S) URL devices may fetch it from, or None.
    ``offer_url``: device -> the one-time URL a builder uploads its engine to (engine
    sharing), or None. ``features``: device -> what its status says it understands; the
    model's name and version go only to devices with ``named_models`` (None: to every device,
    as for the "check" documents built before anything is sent)."""
    from agent.platform import FALLBACK_CHAINS
    from agent.wire.model_names import FEATURE

    precision = str(spec["precision"])
    artifacts = {role: dict(ref) for role, ref in dict(spec["artifacts"]).items()}
    for ref in artifacts.values():
        url = url_for(ref) if url_for is not None and "url" not in ref else None
        if url:  # an operator's --artifact-url (a CDN) wins over the service's own store
            ref["url"] = url
    user_layers = dict(spec.get("layer_precisions") or {})
    fallback = list(FALLBACK_CHAINS.get(precision, ())) if spec.get("fallback") == "allow" \
        else []
    gate = {k: spec.get(k) for k in ("atol", "rtol", "check_error_stat", "min_top1")
            if spec.get(k) is not None}
    calibration = {k: v for k, v in (("algorithm", spec.get("calib_algorithm")),
                                     ("batch_size", spec.get("calib_batch_size")))
                   if v is not None}
    search = {k: v for k, v in (("mode", spec.get("search")),
                                ("direction", spec.get("search_direction")),
                                ("max_iterations", spec.get("max_evaluations")))
              if v is not None}
    if spec.get("predicted") is not None:  # host pre-flight (fleet rollout --preflight)
        search["predicted"] = [str(x) for x in spec["predicted"]]
    bench = {k: v for k, v in (("iterations", spec.get("bench_iterations")),
                               ("warmup", spec.get("bench_warmup"))) if v is not None}

    names = {k: spec[k] for k in ("model_name", "model_version") if spec.get(k)}
    checked = Checked()

    def docs(device: str, job_id: str, kind: str, layers: Optional[Dict[str, str]],
             share: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
        plan: Dict[str, Any] = {"precision": precision}
        merged = dict(user_layers)
        merged.update(layers or {})
        if merged:
            plan["layer_precisions"] = merged
            plan["precision_constraints"] = "obey"
        if "calibration" in artifacts and calibration:
            plan["calibration"] = dict(calibration)
        arts = artifacts
        shared: Dict[str, Any] = (share or {}).get("engine") or {}
        engine_ok = shared.get("builder") and (
            features is None or "signed_engines" in features(device))
        if engine_ok:  # signed with the document like the model, with its builder's proof
            engine = dict(shared)
            url = url_for(engine) if url_for is not None else None
            if url:
                engine["url"] = url
            arts = dict(artifacts, engine=engine)
        named = bool(names) and (features is None or FEATURE in features(device))
        with_set = bool(spec.get("model_set")) and named and (
            features is None or "model_sets" in features(device))
        # (A shared engine's reference differs by device: such documents are checked each.)
        shape = None if engine_ok else (job_id, kind, tuple(sorted(merged.items())), named,
                                         with_set)
        doc = checked.like(shape, device)
        if doc is None:
            doc = job_document(
                job_id, kind, device, arts, plan, fallback=fallback, gate=gate,
                search=search if kind == "search" else None,
                bench=bench if kind == "deploy" else None, timeout_s=spec.get("job_timeout"),
                names=names if named else None)
            if with_set:  # a device before model sets refuses the key
                doc["model_set"] = dict(spec["model_set"])
            if shape is not None:
                checked.keep(shape, doc)
        url = offer_url(device) if share and share.get("offer") and offer_url else None
        if url:
            doc["share"] = {"offer": url}
        return doc

    return docs
