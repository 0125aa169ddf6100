"""The errors users and controllers see: one exception type, stable codes.

Every failure a user or a controller can cause is an ``AgentError`` whose ``code`` is one of
``CODES`` (documented in docs/errors.md; a test keeps the two in step). The message says what
was expected and what was found. Worker side: keep this module Python 3.6-compatible.
"""

from typing import Any, Dict, Optional

# code -> one line for docs/errors.md. Codes are part of the wire protocol: never rename one.
CODES = {
    # configuration and input files
    "bad_config": "The YAML config (or a command-line override) is invalid.",
    "bad_argument": "A command-line argument or job parameter has an invalid value.",
    "file_not_found": "A file named by the user or the job does not exist or cannot be read.",
    "disk_full": "Not enough free disk space for a download, an engine or a cache write.",
    # platform
    "bad_platform_data": "A device-tree, release file or support-matrix entry cannot be parsed.",
    "unsupported_precision": "The requested precision is not supported on this platform.",
    "backend_unavailable": "The requested backend (tensorrt, onnxruntime) cannot be used here.",
    "unsupported_tensorrt": "The installed TensorRT is older than the oldest this agent builds "
    "with (8.0.1).",
    # models and builds
    "bad_model": "The model bytes are not a valid ONNX model.",
    "bad_model_name": "A model name is not 1-64 characters of [a-z0-9_.-] starting with a "
    "lower-case letter or digit.",
    "bad_model_version": "A model version is not 1-64 characters of [A-Za-z0-9_.+-] starting "
    "with a letter or digit.",
    "unsupported_model": "The model uses an operator, type or shape the backend cannot build.",
    "dynamic_shape": "The model has dynamic dimensions and no shape profile was given.",
    "build_failed": "The backend failed to build an engine.",
    "bad_engine": "An engine file is corrupt or was built for another backend or platform.",
    "engine_platform_mismatch": "An engine's recorded platform (TensorRT, GPU, SM count, CUDA, "
    "DLA core) differs from this device's: refused, not loaded (rebuild it here).",
    "shared_engine_rejected": "A shared engine (fleet engine sharing) is not a valid engine "
                              "container; the device builds its own engine instead.",
    "unknown_layer": "A layer named in --layer-precisions is not a node of the model.",
    # calibration
    "bad_calibration_data": "Calibration shards do not match the model (name, dtype or shape).",
    "empty_calibration_data": "The calibration dataset holds no samples.",
    "bad_calibration_cache": "A calibration cache is malformed.",
    "calibration_cache_mismatch": "A calibration cache was made by another TensorRT version "
    "or algorithm.",
    # accuracy and search
    "golden_mismatch": "Golden inputs or outputs do not match the model (names, shapes, dtypes) "
    "or hold NaN.",
    "bad_golden_file": "A golden inputs/outputs file (Polygraphy JSON or .npz) cannot be read.",
    "reference_mismatch": "Even the full-precision build fails the goldens: the problem is not "
    "precision.",
    "accuracy_gate_failed": "The engine's outputs are outside the tolerances against the goldens.",
    "search_failed": "The precision search found no set of layers that passes.",
    "cancelled": "The work was cancelled.",
    # cache
    "cache_corrupt": "A cache entry failed verification; it was dropped.",
    "cache_locked": "Another process holds the cache lock for too long.",
    # daemon / protocol
    "bad_message": "An MQTT payload is not valid JSON or violates its schema.",
    "message_too_large": "An MQTT payload is larger than the configured limit.",
    "unknown_job_kind": "The job document names a job kind this agent does not know.",
    "unknown_artifact": "A block or reference names an artifact the agent does not expect.",
    "hash_mismatch": "An assembled artifact does not match its announced sha256 or size.",
    "duplicate_job": "A job with this id was already received.",
    "unknown_job": "A command or state change names a job id the agent does not know.",
    "bad_state_transition": "A job state change is not allowed from its current state "
    "(e.g. cancelling a finished job).",
    "job_timed_out": "The job ran longer than its timeout.",
    "worker_crashed": "The worker process exited abnormally.",
    "out_of_memory": "The worker hit its memory ceiling (limits.worker_memory_bytes or the "
    "unit's MemoryMax=); the daemon carries on.",
    "broker_unreachable": "The MQTT broker cannot be reached.",
    "state_dir_in_use": "Another jetson-agent daemon holds this state directory (its PID is "
    "named).",
    "session_taken_over": "Another client connected with this device's client id and the broker "
    "closed this device's connection (log and `status`; bind client ids to identities).",
    "unknown_device": "The controller names a device that has never reported.",
    "device_busy": "A targeted device is already in another unfinished rollout.",
    "instance_in_use": "A live fleet service already holds this --instance name (its host and "
    "PID are named): stop it, or give this one another name.",
    "db_schema": "The fleet database is not at the schema this jetson-agent uses: older (run "
    "the `fleet db upgrade` command the message names; `fleet serve` does it on start unless "
    "--no-db-upgrade) or newer (upgrade jetson-agent).",
    "no_accuracy_gate": "A rollout has no goldens (no accuracy gate) and was not given "
    "--no-accuracy-gate.",
    "signing_required": "An unsigned rollout targets devices that require signed jobs (they "
    "would drop the documents): sign it with --signing-key, or leave those devices out.",
    "unsigned_job": "The job document carries no signature and the device requires one "
    "(ignored: logged and counted, no job is recorded).",
    "bad_signature": "The job signature does not verify, or its key is not trusted "
    "(ignored: logged and counted, no job is recorded).",
    "device_key_unreadable": "The device's own key (security.device_key) is missing or not an "
    "Ed25519 private key: the daemon does not start (make one: jetson-agent keygen --device).",
    "bad_report_signature": "A device's message is not signed by the key its controller pinned "
    "for it, or its signature does not match (dropped and counted).",
    "device_not_admitted": "The device is not admitted by the fleet controller (pending, "
    "rejected or unknown): its messages are dropped, it is never targeted.",
    "upload_refused": "A shared-engine upload was refused: its token is unknown, expired or "
    "revoked, or it is not the engine its builder signed (size, hash, signature, format).",
    "server_untrusted": "An HTTPS server (the fleet service's --http with --http-tls-cert) "
    "presented a certificate that does not verify with the device's CA (transfer.http_ca_file, "
    "else broker.tls.ca_file): artifacts come over MQTT instead, the engine is not offered.",
    "wrong_target": "A correctly signed job names another device (ignored: logged and counted).",
    "job_not_yet_valid": "The signed job's not-before time is in the future (check the clock).",
    "job_expired": "The signed job's expiry time has passed.",
    "job_replayed": "The signed job's sequence is not above the last one accepted from its key.",
    "rate_limited": "Too many new jobs in a short time (send it again later under a new id), or "
    "too many requests from one user on the app socket (ask again later).",
    "unauthorized": "A dashboard action came without the service's token, or the dashboard is "
    "read-only (no --dashboard-token-file).",
    "no_previous_engine": "A rollback names a model with no previous engine on the device.",
    "agent_unreachable": "The agent's app socket does not answer (the daemon is not running, or "
    "the socket path is wrong).",
    "handoff_failed": "Handing a model version to the application failed before the switch "
    "(repository or config files, the app's API); the previous version stays.",
    "app_not_allowed": "A process that is not the configured app user or group (nor root, nor "
    "the agent itself) spoke on the app socket.",
    "internal_error": "An unexpected error; the message carries the details.",
    "handoff_rolled_back": "The application did not confirm a new model version (unhealthy "
    "report or commit timeout); the device went back to the previous version.",
    "version_rejected": "The application rejected this model version on this device before; "
    "it is not activated again until an operator retries it.",
    "no_previous_version": "A rollback names a model with no kept version to go back to.",
    "not_pending": "A commit or health report names a version that is not pending.",
    # fleet registry, labels and deployments
    "bad_label": "A device label (config labels:, a status, fleet label) is not a Kubernetes-"
    "style key=value, is reserved, or there are too many.",
    "bad_selector": "A label selector (fleet deploy --to) does not parse as Kubernetes' "
    "label-selector syntax.",
    "unknown_model_version": "A model name@version is not in the fleet's model registry "
    "(fleet models push).",
    "model_version_exists": "A model name@version is already in the registry with other "
    "artifacts or settings: versions are immutable (push a new version).",
    "model_in_use": "A registry version cannot be removed while a deployment uses it or devices "
    "keep it (active or as a rollback target).",
    "unknown_deployment": "A deployment id is not in the fleet database.",
    # Named models on the device: pins and model sets
    "model_pinned": "A job would switch a model name that an operator pinned on the device to "
    "another version (jetson-agent models pin / unpin).",
    "bad_model_set": "A job's model_set is malformed, does not name the job's model, or mixes "
    "with the model set open on the device (one set at a time).",
    # The registry's blob store (agent.fleet.database.blobs).
    "artifact_unavailable": "A registry blob cannot be served: missing from the store, or its "
    "bytes no longer match its sha256 (fleet models verify).",
    "blob_store_unset": "The fleet database names no blob store and none was given (--store "
    "on the service's host, or push through the service).",
    "blob_too_large": "An uploaded blob is larger than the service accepts.",
    # Hand-off adapters (Triton, DeepStream) as they run in the field.
    "bad_tensor_name": "A tensor name in a version's meta.json is empty, too long, or holds a "
    "quote, backslash or control character (newline, NUL), so it cannot go into an app's "
    "config file.",
    "no_pipeline": "A model name has no DeepStream pipeline configured (the deepstream "
    "hand-off's pipelines: maps each name to its own nvinfer config).",
    "incompatible_engine": "An on-the-fly model update was refused: the new engine's input or "
    "output names, shapes or types differ from the engine the pipeline runs.",
    # fleet preview, clean-up and decommissioning
    "selector_matches_nothing": "A deployment's selector matches no eligible device (fleet "
    "deploy --allow-empty records it anyway).",
    "model_switching": "A model cannot be removed from a device while its app is switching "
    "versions of it (a hand-off in progress): try again once the switch ended.",
    # fleet pins and deployment revisions (agent.fleet.deployments.pins, revisions)
    "no_previous_revision": "fleet deployments undo: the deployment has no earlier revision to "
    "return to.",
    "not_pinned": "fleet unpin: the device's model has no fleet pin (a device's own pin is "
    "removed on the device).",
    # the app socket (versions that can't be lost)
    "model_not_owned": "An app on the app socket acted on (committed, reported on, rolled "
    "back) a model name that models.app_names does not give to its user or group.",
    # Admission: a sticky identity (agent.fleet.admission).
    "admission_key_ambiguous": "fleet devices accept without --key, for a device id for "
    "which more than one key was seen: name the device's own key (the message lists them).",
    "admission_key_changed": "The key id an operator was shown (the dashboard's accept form) "
    "is not among the keys seen for the device: look again before accepting.",
    "device_already_admitted": "fleet devices accept for a device that is already admitted: "
    "its pinned key changes only by fleet devices rekey ID --key NEW.",
    # TensorRT plugins and DLA (agent.engines.plugins, tensorrt_plan, the hand-offs).
    "plugin_op_on_host": "The model uses TensorRT plugin ops (e.g. EfficientNMS_TRT, or an op "
    "outside the standard ONNX domains) that the host backend cannot emulate: build it with "
    "--backend tensorrt on a device, which decides.",
    "plugin_path_refused": "A plugin library outside the models directory (or too large): "
    "plugin code runs in the worker, so it is loaded only from there; copy it in.",
    "plugin_digest_mismatch": "A plugin library's content is not the SHA-256 pinned in the "
    "plan or job: it changed after the plan was made.",
    "dla_dynamic_shape": "A DLA build with a dynamic shape profile: DLA needs min = opt = max "
    "for every input; give one fixed shape (--shapes NAME:DIMS).",
    "dla_layers_on_gpu": "A DLA build without GPU fallback has layers DLA cannot run (named), "
    "or the layers expected on DLA ran on the GPU.",
    "batch_size_exceeds_profile": "The hand-off's batch size (Triton max_batch_size, "
    "DeepStream batch-size) is above the engine's optimisation profile maximum.",
    "tensorrt_version_mismatch": "The application's TensorRT (Triton's) is not the one the "
    "engine was built with; rebuild the engine or use a matching Triton.",
    # The per-layer view (issue 34).
    "profile_unavailable": "bench --profile on a backend or TensorRT version without a "
    "per-layer profiler.",
    # Live inputs and the live check (agent.device.models.live_samples,
    # agent.device.models.live_check).
    "bad_donation": "An app's donated inputs do not match the model's inputs (names, dtypes, "
    "shapes), are larger than models.live_check.keep_bytes allows, or the name has no active "
    "version to check them against.",
    "live_check_failed": "A new version disagreed with the running one on the app's donated "
    "inputs (top-1 agreement below models.live_check.min_agreement, or the error above "
    "max_error): it was refused and rolled back; the details hold the figures and the worst "
    "samples' indices.",
    "calibration_stale": "An INT8 version clips more of the field's activations than "
    "models.live_check.max_clip_rate allows, or its inputs drifted from the calibration set "
    "beyond models.live_check.max_drift (the calibration no longer matches the inputs): "
    "jetson-agent models recalibrate NAME makes a calibration set from the donated inputs.",
    "no_samples": "models samples export or models recalibrate for a name with no donated "
    "inputs on this device.",
}


class AgentError(Exception):
    """An error with a stable ``code`` and a message fit for the user."""

    def __init__(self, code: str, message: str, details: Optional[Dict[str, Any]] = None) -> None:
        if code not in CODES:
            raise ValueError("unknown error code {!r}".format(code))
        super(AgentError, self).__init__(message)
        self.code = code
        self.message = message
        self.details = dict(details or {})

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"code": self.code, "message": self.message}
        if self.details:
            out["details"] = self.details
        return out

    def __str__(self) -> str:
        return "{}: {}".format(self.code, self.message)
