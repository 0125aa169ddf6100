"""Job documents, and the checks a device would make, done on the controller first.

``prepare_rollout`` checks what devices would refuse before anything is published (model,
goldens and inputs against the model, labels, calibration set, which a directory of shards is
packed into one .npz for); ``job_document`` builds a document that passes the job schema and
size limit.
"""

import os
import time
import uuid
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from agent.errors import AgentError
from agent.wire import protocol

LAYER_RANK = {"int8": 0, "float16": 1, "float32": 2}


# ============================================================================ job documents

def new_rollout_id(model_path: str, clock: Callable[[], float] = time.time,
                   base: Optional[str] = None) -> str:
    """``<name>-<time><random>``: ``base`` (the model's name) or the model's file stem (its
    directory when the file is called model.onnx), made fit for a job id."""
    base = base or os.path.splitext(os.path.basename(model_path))[0]
    if base in ("model", "") and os.path.dirname(os.path.abspath(model_path)):
        base = os.path.basename(os.path.dirname(os.path.abspath(model_path))) or base
    clean = "".join(c if c.isalnum() or c in "-_" else "-" for c in base).strip("-_")
    stamp = "{:x}{}".format(int(clock()), uuid.uuid4().hex[:4])
    return "{}-{}".format((clean or "rollout")[:32], stamp)


def job_document(job_id: str, kind: str, device: str, artifacts: Mapping[str, Any],
                 plan: Mapping[str, Any], fallback: Sequence[str] = (),
                 gate: Optional[Mapping[str, Any]] = None,
                 search: Optional[Mapping[str, Any]] = None,
                 bench: Optional[Mapping[str, Any]] = None,
                 timeout_s: Optional[float] = None, created: Optional[float] = None,
                 names: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """A job document, checked against the schema and the 32 KiB limit (bad_argument).
    ``names``: ``model_name`` / ``model_version`` (only for devices with the feature
    ``named_models``: a device of an earlier release refuses keys it does not know)."""
    doc: Dict[str, Any] = {"protocol": protocol.PROTOCOL_VERSION, "job_id": job_id,
                           "kind": kind, "device": device,
                           "created": time.time() if created is None else created,
                           "artifacts": {k: dict(v) for k, v in artifacts.items()},
                           "plan": dict(plan)}
    if fallback:
        doc["fallback"] = list(fallback)
    if gate:
        doc["gate"] = dict(gate)
    if search:
        doc["search"] = dict(search)
    if bench:
        doc["bench"] = dict(bench)
    if timeout_s is not None:
        doc["timeout_s"] = timeout_s
    for key, value in (names or {}).items():
        if key in ("model_name", "model_version") and value:
            doc[key] = value
    try:
        protocol.validate("job", doc)
    except AgentError as exc:
        raise AgentError("bad_argument", "the job document would be refused by the devices: "
                         "{}".format(exc.message))
    size = len(protocol.encode(doc))
    if size > protocol.MAX_BYTES["job"]:
        raise AgentError("bad_argument", "the job document is {} bytes; devices accept at most "
                         "{} (fewer --layer-precisions?)".format(size, protocol.MAX_BYTES["job"]))
    return doc


class Checked(object):
    """Job documents already checked, by shape: a stage's documents differ only in their device
    and time, and the schema check and size of each (``job_document``: 40 us a document, a
    seventh of the service's measured steps for one) gave the same answer 50,000 times.
    ``like`` copies a checked document for another device (top-level keys only: a document's
    parts are never changed after it is built, agent.fleet.rollouts.doc_parts), its id
    checked and its size within the limit by a margin the device id and time cannot use up."""

    KEPT = 64  # shapes (a search's deploy documents differ by device: those are not kept)
    MARGIN = 160  # bytes: a longer device id (64 characters at most) and another time

    def __init__(self) -> None:
        self._docs: Dict[Any, Dict[str, Any]] = {}

    def like(self, shape: Any, device: str) -> Optional[Dict[str, Any]]:
        doc = self._docs.get(shape)
        if doc is None or not protocol.valid_id(device):
            return None
        return dict(doc, device=device, created=time.time())

    def keep(self, shape: Any, doc: Dict[str, Any]) -> None:
        if len(self._docs) < self.KEPT and \
                len(protocol.encode(doc)) + self.MARGIN <= protocol.MAX_BYTES["job"]:
            self._docs[shape] = dict(doc)  # (the caller may add to its own, e.g. "share")


def layers_above(layer_precisions: Mapping[str, str], precision: str) -> Dict[str, str]:
    """The entries of ``layer_precisions`` that are wider than a build ``precision``."""
    target = {"fp32": "float32", "fp16": "float16", "int8": "int8", "best": "int8"}.get(
        precision, "int8")
    return {name: p for name, p in sorted(layer_precisions.items())
            if LAYER_RANK.get(p, 0) > LAYER_RANK[target]}


# ============================================================================ local checks

def _classifier_rows(goldens: Sequence[Mapping[str, Any]]) -> Optional[int]:
    """Rows of the first classifier-like output ([..., classes > 1]) over all iterations."""
    first = goldens[0]
    for name in first:
        arr = first[name]
        if getattr(arr, "ndim", 0) >= 2 and arr.shape[-1] > 1:
            return sum(int(it[name].size // it[name].shape[-1]) for it in goldens)
    return None


def _pack_calibration(path: str, specs: Sequence[Any], out_dir: str) -> str:
    """Check a calibration set against the model's inputs; a directory of shards becomes one
    .npz (the job carries one artifact per role), a single file is sent as it is."""
    import io
    import zipfile

    import numpy as np

    from calib.dataset import CalibrationDataset

    dims = [s.shape[0] if s.shape else None for s in specs]
    fixed = [int(d) for d in dims if isinstance(d, int) and d > 0]
    batch = fixed[0] if fixed else 256
    dataset = CalibrationDataset(path, list(specs), batch)
    if not os.path.isdir(path):
        return path
    pieces: Dict[str, List[Any]] = {}
    for feed in dataset:
        for name, arr in feed.items():
            pieces.setdefault(name, []).append(np.asarray(arr))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        for name in sorted(pieces):
            member = io.BytesIO()
            np.lib.format.write_array(member, np.concatenate(pieces[name], axis=0),
                                      allow_pickle=False)
            # A fixed time stamp: the same shards give the same sha256, so devices that
            # hold the artifact already do not fetch it again.
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            zf.writestr(info, member.getvalue())
    from agent.fsio import atomic_write

    packed = os.path.join(out_dir, "calibration.npz")
    atomic_write(packed, buf.getvalue())
    return packed


def prepare_rollout(model: str, precision: str, work_dir: str, calib: Optional[str] = None,
                    inputs: Optional[str] = None, goldens: Optional[str] = None,
                    labels: Optional[str] = None,
                    layer_precisions: Optional[Mapping[str, str]] = None,
                    min_top1: Optional[float] = None, search: Optional[str] = None
                    ) -> Dict[str, str]:
    """Everything a device would refuse, checked here before anything is published. Returns
    role -> local file to serve (a calibration directory is packed into ``work_dir``)."""
    import numpy as np

    from agent.engines.backends.layer_precisions import resolve_precisions
    from agent.engines.backends.onnx_model import input_specs, load_model, output_specs
    from agent.precision import golden

    if precision not in ("fp32", "fp16", "int8", "best"):
        raise AgentError("bad_argument", "--precision must be fp32, fp16, int8 or best, found "
                         "{!r}".format(precision))
    if not os.path.isfile(model):
        raise AgentError("file_not_found", "model {} does not exist (expected an .onnx file)"
                         .format(model))
    onnx_model = load_model(model)
    in_specs, out_specs = input_specs(onnx_model), output_specs(onnx_model)
    resolve_precisions(onnx_model, precision, dict(layer_precisions or {}))
    files = {"model": model}
    if (inputs is None) != (goldens is None):
        raise AgentError("golden_mismatch", "goldens need the inputs they were computed from: "
                         "give --golden and --inputs together (found only {})".format(
                             "--golden" if goldens else "--inputs"))
    loaded_goldens = None
    if inputs is not None and goldens is not None:
        feeds = golden.load_inputs(inputs)
        golden.validate_inputs(feeds, in_specs)
        loaded_goldens = golden.load_outputs(goldens)
        golden.validate_goldens(loaded_goldens, out_specs, len(feeds))
        files["inputs"], files["goldens"] = inputs, goldens
    rows = _classifier_rows(loaded_goldens) if loaded_goldens else None
    if labels is not None:
        if loaded_goldens is None:
            raise AgentError("bad_argument", "--labels are compared with the outputs for "
                             "--inputs: give --inputs and --golden too")
        if not os.path.isfile(labels):
            raise AgentError("file_not_found", "labels file {} does not exist".format(labels))
        try:
            loaded = np.load(labels, allow_pickle=False)
            array = loaded[loaded.files[0]] if hasattr(loaded, "files") else loaded
        except (OSError, ValueError) as exc:
            raise AgentError("bad_golden_file", "{}: expected a .npy (or .npz) array of class "
                             "indices: {}".format(labels, exc))
        if rows is None or np.asarray(array).reshape(-1).shape[0] != rows:
            raise AgentError("golden_mismatch", "{} holds {} labels; the goldens hold {} "
                             "classifier rows".format(labels, np.asarray(array).size,
                                                      rows if rows is not None else "no"))
        files["labels"] = labels
    if min_top1 is not None and rows is None:
        raise AgentError("bad_argument", "--min-top1 needs goldens with a classifier output "
                         "([..., classes]); {}".format(
                             "no --golden given" if loaded_goldens is None else
                             "the goldens hold {}".format({n: list(v.shape) for n, v in
                                                          loaded_goldens[0].items()})))
    if search is not None:
        if loaded_goldens is None:
            raise AgentError("bad_argument", "--search judges each candidate against goldens: "
                             "give --inputs and --golden")
        if precision == "fp32":
            raise AgentError("bad_argument", "--search needs a reduced precision (fp16, int8 "
                             "or best), found fp32")
    if precision in ("int8", "best"):
        if calib is None:
            raise AgentError("bad_argument", "--precision {} calibrates on the device: give "
                             "--calib DIR|FILE (shards of model inputs)".format(precision))
    if calib is not None:
        files["calibration"] = _pack_calibration(calib, in_specs, work_dir)
    return files
