"""Controller side of a fleet: device directory, staged rollouts, block serving, results.

Speaks only the protocol of docs/protocol.md. The policy is pure and comes first:

- target selection (``select_devices``) and staging (``plan_stages``: ``--batch N`` or
  ``--percent P`` devices per stage, in the order given);
- ``abort_reason`` (AWS IoT Jobs abort criteria: once at least ``min_executed`` devices have
  finished, stop when more than ``abort_failure_rate`` of them FAILED / REJECTED / TIMED_OUT)
  and ``stage_verdict`` (hawkBit-style success threshold: the next stage starts once enough
  devices of the current one SUCCEEDED; a stage that can no longer reach it halts the rollout);
- ``prepare_rollout``: what devices would refuse, checked on the controller before anything
  is published (model, goldens and inputs against the model, labels, calibration set, which
  a directory of shards is packed into one .npz for);
- ``Rollout``: the state machine, fed job statuses, answering with ``Action``s (publish a
  retained job document, clear one, send a cancel command); with a precision search each device
  runs a ``search`` job, then a ``deploy`` job that keeps the layers the search found;
- the results (``result_row``, ``format_table``) and the live progress view.

``FleetConnection`` and ``run_rollout`` are the I/O edge: one MQTT connection (agent.mqtt),
``agent.transfer.BlockServer`` answering every device's block requests while the rollout runs.
"""

import fnmatch
import logging
import math
import os
import queue
import sys
import time
import uuid
from typing import IO, Any, Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence

from agent import protocol
from agent.errors import AgentError

log = logging.getLogger("agent.fleet")

FAILURE_STATES = frozenset(("FAILED", "REJECTED", "TIMED_OUT"))
EXECUTED_STATES = FAILURE_STATES | {"SUCCEEDED"}
PENDING = "PENDING"  # controller side: the device's stage has not started yet
SEARCH_SUFFIX = ".search"
MAX_ROLLOUT_ID = 64 - len(SEARCH_SUFFIX)
LAYER_RANK = {"int8": 0, "float16": 1, "float32": 2}


# ============================================================================ targets and stages

def select_devices(known: Iterable[str], ids: Optional[Sequence[str]] = None,
                   all_devices: bool = False, pattern: Optional[str] = None) -> List[str]:
    """The targeted device ids. ``known``: ids with a retained status (online or not).
    Explicit ids keep their order (duplicates dropped); ``--all`` / ``--match`` are sorted.
    AgentError unknown_device when an id has never reported or nothing matches."""
    known_set = set(known)
    chosen = [bool(ids), bool(all_devices), pattern is not None]
    if sum(chosen) != 1:
        raise AgentError("bad_argument", "name the target devices with exactly one of "
                         "--devices ID..., --all or --match PATTERN")
    if ids:
        out: List[str] = []
        for dev in ids:
            if not protocol.valid_id(dev):
                raise AgentError("bad_argument", "device id must be 1-64 characters of "
                                 "[A-Za-z0-9._-], found {!r}".format(dev))
            if dev not in out:
                out.append(dev)
        unknown = [d for d in out if d not in known_set]
        if unknown:
            raise AgentError("unknown_device", "device(s) {} never reported to this broker "
                             "(no retained status); known devices: {}".format(
                                 ", ".join(unknown), ", ".join(sorted(known_set)) or "none"),
                             {"unknown": unknown, "known": sorted(known_set)})
        return out
    if all_devices:
        if not known_set:
            raise AgentError("unknown_device", "no device has reported to this broker yet "
                             "(no retained status under the topic prefix)")
        return sorted(known_set)
    matched = sorted(d for d in known_set if fnmatch.fnmatchcase(d, pattern or ""))
    if not matched:
        raise AgentError("unknown_device", "no known device matches {!r}; known devices: "
                         "{}".format(pattern, ", ".join(sorted(known_set)) or "none"))
    return matched


def plan_stages(devices: Sequence[str], batch: Optional[int] = None,
                percent: Optional[float] = None) -> List[List[str]]:
    """Split ``devices`` into consecutive stages of ``batch`` devices, or of ``percent`` % of
    them (rounded up, at least one); neither: one stage with every device."""
    if batch is not None and percent is not None:
        raise AgentError("bad_argument", "give --batch or --percent, not both")
    if not devices:
        raise AgentError("bad_argument", "a rollout needs at least one device")
    size = len(devices)
    if batch is not None:
        if int(batch) < 1:
            raise AgentError("bad_argument", "--batch must be >= 1, found {}".format(batch))
        size = int(batch)
    elif percent is not None:
        if not 0 < float(percent) <= 100:
            raise AgentError("bad_argument", "--percent must be in (0, 100], found {}".format(
                percent))
        size = max(1, int(math.ceil(len(devices) * float(percent) / 100.0 - 1e-9)))
    return [list(devices[i:i + size]) for i in range(0, len(devices), size)]


class Policy(NamedTuple):
    success_threshold: float = 1.0  # fraction of a stage that must succeed before the next
    abort_failure_rate: Optional[float] = None  # None: never abort on failures
    min_executed: int = 1  # finished devices needed before the abort rate is judged


def check_policy(policy: Policy) -> Policy:
    if not 0 < policy.success_threshold <= 1:
        raise AgentError("bad_argument", "--success-threshold must be in (0, 1], found {}"
                         .format(policy.success_threshold))
    if policy.abort_failure_rate is not None and not 0 <= policy.abort_failure_rate < 1:
        raise AgentError("bad_argument", "--abort-failure-rate must be in [0, 1), found {}"
                         .format(policy.abort_failure_rate))
    if policy.min_executed < 1:
        raise AgentError("bad_argument", "--min-executed must be >= 1, found {}".format(
            policy.min_executed))
    return policy


def abort_reason(states: Iterable[str], policy: Policy) -> Optional[str]:
    """Why the rollout must stop now, or None. Only devices that ran to an end count."""
    if policy.abort_failure_rate is None:
        return None
    executed = [s for s in states if s in EXECUTED_STATES]
    failed = [s for s in executed if s in FAILURE_STATES]
    if len(executed) < policy.min_executed or not failed:
        return None
    rate = len(failed) / float(len(executed))
    if rate <= policy.abort_failure_rate:
        return None
    return ("failure rate {}/{} = {:.0%} exceeds the abort threshold {:.0%} (after {} "
            "finished, minimum {})".format(len(failed), len(executed), rate,
                                           policy.abort_failure_rate, len(executed),
                                           policy.min_executed))


def stage_verdict(states: Sequence[str], policy: Policy) -> str:
    """"passed" once enough of the stage SUCCEEDED, "failed" once it can no longer get there,
    else "running"."""
    need = int(math.ceil(policy.success_threshold * len(states) - 1e-9))
    succeeded = sum(1 for s in states if s == "SUCCEEDED")
    open_ = sum(1 for s in states if not protocol.is_terminal(s))
    if succeeded >= need:
        return "passed"
    if succeeded + open_ < need:
        return "failed"
    return "running"


# ============================================================================ job documents

def new_rollout_id(model_path: str, clock: Callable[[], float] = time.time) -> str:
    """``<name>-<time><random>``: the model's file stem (its directory when the file is
    called model.onnx), made fit for a job id."""
    base = os.path.splitext(os.path.basename(model_path))[0]
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
                 timeout_s: Optional[float] = None, created: Optional[float] = None
                 ) -> Dict[str, Any]:
    """A job document, checked against the schema and the 32 KiB limit (bad_argument)."""
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

    from agent import golden
    from agent.backends import graph

    if precision not in ("fp32", "fp16", "int8", "best"):
        raise AgentError("bad_argument", "--precision must be fp32, fp16, int8 or best, found "
                         "{!r}".format(precision))
    if not os.path.isfile(model):
        raise AgentError("file_not_found", "model {} does not exist (expected an .onnx file)"
                         .format(model))
    onnx_model = graph.load_model(model)
    in_specs, out_specs = graph.input_specs(onnx_model), graph.output_specs(onnx_model)
    graph.resolve_precisions(onnx_model, precision, dict(layer_precisions or {}))
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


# ============================================================================ the rollout

class Action(NamedTuple):
    kind: str  # "publish" (retained job document) | "clear" (empty retained) | "cancel"
    device: str
    job_id: str
    doc: Optional[Dict[str, Any]] = None


DocFactory = Callable[[str, str, str, Optional[Dict[str, str]]], Dict[str, Any]]
# doc_factory(device, job_id, kind, layer_precisions or None) -> job document


class DeviceRun(object):
    """One targeted device as the controller sees it."""

    def __init__(self, device: str, stage: int) -> None:
        self.device = device
        self.stage = stage
        self.state = PENDING
        self.phase = ""  # the kind of the job now running: "search" or "deploy"
        self.job_id = ""
        self.job_stage = ""  # the device's stage (downloading, building, ...)
        self.progress: Optional[Dict[str, int]] = None
        self.result: Optional[Dict[str, Any]] = None
        self.error: Optional[Dict[str, Any]] = None
        self.search: Optional[Dict[str, Any]] = None  # the search job's result
        self.sent_layers: Dict[str, str] = {}  # layers the deploy job keeps above its precision
        self.versions: Dict[str, int] = {}
        self.published: List[str] = []  # retained job documents not cleared yet
        self.note = ""  # what the controller did to this device, and why
        self.local = False  # the state was set by the controller, not reported
        self.started: Optional[float] = None
        self.finished: Optional[float] = None

    @property
    def terminal(self) -> bool:
        return protocol.is_terminal(self.state)


def check_rollout_id(rollout_id: str) -> str:
    if len(rollout_id) > MAX_ROLLOUT_ID or not protocol.valid_id(rollout_id):
        raise AgentError("bad_argument", "rollout id must be 1-{} characters of "
                         "[A-Za-z0-9._-] starting with a letter or digit, found {!r}"
                         .format(MAX_ROLLOUT_ID, rollout_id))
    return rollout_id


class Rollout(object):
    """The staged rollout of one model. Feed it job statuses (``on_job_status``); it returns
    the actions to carry out. Pure: no clock reads beyond the injected one, no I/O."""

    def __init__(self, rollout_id: str, stages: Sequence[Sequence[str]], docs: DocFactory,
                 policy: Optional[Policy] = None, search: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rollout_id = check_rollout_id(rollout_id)
        self.deploy_id = rollout_id
        self.search_id = rollout_id + SEARCH_SUFFIX if search else None
        self.stages = [list(s) for s in stages]
        self.docs = docs
        self.policy = check_policy(policy or Policy())
        self.clock = clock
        self.runs: Dict[str, DeviceRun] = {}
        for i, stage in enumerate(self.stages):
            for dev in stage:
                if dev in self.runs:
                    raise AgentError("bad_argument", "device {} is in two stages".format(dev))
                self.runs[dev] = DeviceRun(dev, i)
        self.current = -1  # index of the last stage started
        self.halted = False
        self.outcome = ""  # "" while running; then succeeded | aborted | halted | ...
        self.reason = ""
        self.started = clock()

    # -- queries ------------------------------------------------------------------------------

    @property
    def job_ids(self) -> List[str]:
        return [j for j in (self.search_id, self.deploy_id) if j]

    @property
    def done(self) -> bool:
        return all(r.terminal for r in self.runs.values())

    @property
    def succeeded(self) -> bool:
        return self.done and all(r.state == "SUCCEEDED" for r in self.runs.values())

    def ordered(self) -> List[DeviceRun]:
        return [self.runs[d] for stage in self.stages for d in stage]

    def counts(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for r in self.runs.values():
            out[r.state] = out.get(r.state, 0) + 1
        return out

    def final_outcome(self) -> str:
        if self.outcome:
            return self.outcome
        if not self.done:
            return "running"
        return "succeeded" if self.succeeded else "failed"

    # -- events -------------------------------------------------------------------------------

    def start(self) -> List[Action]:
        return self._start_stage(0)

    def on_job_status(self, device: str, msg: Mapping[str, Any]) -> List[Action]:
        """A decoded job status message from ``device``. Stale versions are dropped."""
        run = self.runs.get(device)
        job_id = msg.get("job_id")
        if run is None or job_id not in self.job_ids:
            return []
        version = int(msg.get("version") or 0)
        if version <= run.versions.get(job_id, 0):
            return []  # a resend after a reconnect, or an older retained copy
        run.versions[job_id] = version
        if run.state == PENDING:
            return []  # a status for a job we never sent (an earlier run of this id)
        state = str(msg.get("state"))
        actions: List[Action] = []
        is_search = job_id == self.search_id
        if is_search and run.phase == "deploy":
            return []  # the search is over for this device
        if run.local and not protocol.is_terminal(state):
            # The device had picked the job up before the controller cancelled it.
            run.local = False
        run.job_stage = str(msg.get("stage") or "")
        progress = msg.get("progress")
        run.progress = dict(progress) if isinstance(progress, dict) else None
        if run.started is None and state != "QUEUED":
            run.started = self.clock()
        if is_search and state == "SUCCEEDED":
            run.search = dict(msg.get("result") or {})
            actions.append(Action("clear", device, job_id))
            if self.halted:
                run.state, run.local = "CANCELED", True
                run.note = "search done; deploy not sent: " + self.reason
                run.finished = self.clock()
                return actions
            keep = run.search.get("keep") or []
            keep_precision = str(run.search.get("keep_precision") or "float32")
            actions += self._send(run, "deploy", {str(name): keep_precision for name in keep})
            run.state = "IN_PROGRESS"
            return actions
        run.state = state
        if protocol.is_terminal(state):
            run.finished = self.clock()
            run.local = False
            if state == "SUCCEEDED":
                run.result = dict(msg.get("result") or {})
            else:
                run.error = dict(msg.get("error") or {"code": "internal_error",
                                                      "message": "no error in the status"})
                if msg.get("result"):
                    run.result = dict(msg["result"])
            if job_id in run.published:
                actions.append(Action("clear", device, job_id))
            actions += self._evaluate()
        return actions

    def halt(self, reason: str, outcome: str = "halted") -> List[Action]:
        """Stop the rollout: devices not started are cancelled; running ones finish."""
        if self.halted:
            return []
        self.halted, self.outcome, self.reason = True, outcome, reason
        actions: List[Action] = []
        for run in self.ordered():
            if run.state == PENDING:
                run.state, run.local = "CANCELED", True
                run.note = "not started: " + reason
                run.finished = self.clock()
            elif run.state == "QUEUED":
                actions += self._cancel(run, "CANCELED", "cancelled while queued: " + reason)
        return actions

    def expire(self, reason: str, state: str = "TIMED_OUT", outcome: str = "timed_out"
               ) -> List[Action]:
        """Give up on every unfinished device (controller timeout, interrupt): cancel what
        was sent, and mark it ``state``."""
        self.halted, self.outcome, self.reason = True, outcome, reason
        actions: List[Action] = []
        for run in self.ordered():
            if run.state == PENDING:
                run.state, run.local = "CANCELED", True
                run.note = "not started: " + reason
                run.finished = self.clock()
            elif not run.terminal:
                actions += self._cancel(run, state, reason)
        return actions

    # -- internals ----------------------------------------------------------------------------

    def _start_stage(self, index: int) -> List[Action]:
        self.current = index
        actions: List[Action] = []
        for dev in self.stages[index]:
            run = self.runs[dev]
            if self.search_id:
                actions += self._send(run, "search", None)
            else:
                actions += self._send(run, "deploy", None)
            run.state = "QUEUED"
        return actions

    def _send(self, run: DeviceRun, kind: str, layers: Optional[Dict[str, str]]
              ) -> List[Action]:
        job_id = self.search_id if kind == "search" else self.deploy_id
        assert job_id is not None
        doc = self.docs(run.device, job_id, kind, layers)
        if kind == "deploy":
            plan = doc.get("plan") or {}
            run.sent_layers = layers_above(plan.get("layer_precisions") or {},
                                           str(plan.get("precision")))
        run.phase, run.job_id = kind, job_id
        run.job_stage, run.progress = "", None
        run.published.append(job_id)
        return [Action("publish", run.device, job_id, doc)]

    def _cancel(self, run: DeviceRun, state: str, note: str) -> List[Action]:
        actions = [Action("cancel", run.device, run.job_id)]
        actions += [Action("clear", run.device, j) for j in run.published]
        run.state, run.local, run.note = state, True, note
        run.finished = self.clock()
        return actions

    def _evaluate(self) -> List[Action]:
        if self.halted:
            return []
        reason = abort_reason((r.state for r in self.runs.values() if not r.local),
                              self.policy)
        if reason:
            return self.halt(reason, "aborted")
        stage = [self.runs[d] for d in self.stages[self.current]]
        verdict = stage_verdict([r.state for r in stage], self.policy)
        if verdict == "failed":
            ok = sum(1 for r in stage if r.state == "SUCCEEDED")
            return self.halt("stage {}: {} of {} device(s) succeeded, below the success "
                             "threshold {:.0%}".format(self.current + 1, ok, len(stage),
                                                       self.policy.success_threshold))
        if verdict == "passed" and self.current + 1 < len(self.stages):
            return self._start_stage(self.current + 1)
        return []

    def mark_cleared(self, device: str, job_id: str) -> None:
        run = self.runs.get(device)
        if run is not None and job_id in run.published:
            run.published.remove(job_id)


# ============================================================================ results

def _pct(value: Any) -> str:
    return "{:.1%}".format(value) if isinstance(value, (int, float)) else "-"


def _num(value: Any, fmt: str = "{:.3g}") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return fmt.format(value)


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def accuracy_summary(accuracy: Optional[Mapping[str, Any]]) -> str:
    """One cell: for classifiers with labels, the label accuracy next to the fp32 reference's
    and the top-1 agreement with the goldens; else the worst absolute error (and top-1 when
    the gate asked for it); "pass"/"FAIL" from the gate."""
    if not accuracy:
        return "-"
    parts = []
    if accuracy.get("label_accuracy") is not None:
        parts.append("acc {} (fp32 {})".format(_pct(accuracy["label_accuracy"]),
                                               _pct(accuracy.get("golden_label_accuracy"))))
    elif accuracy.get("max_abs_error") is not None:
        parts.append("max|err| {}".format(_num(accuracy["max_abs_error"])))
    if accuracy.get("top1_agreement") is not None and (
            accuracy.get("label_accuracy") is not None or accuracy.get("min_top1") is not None):
        parts.append("top-1 {}".format(_pct(accuracy["top1_agreement"])))
    verdict = accuracy.get("passed")
    if verdict is not None:
        parts.append("pass" if verdict else "FAIL")
    return ", ".join(parts) or "-"


def result_row(run: DeviceRun, status: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Everything the table and ``--json`` show for one device."""
    result = run.result or {}
    error = run.error or {}
    accuracy = result.get("accuracy")
    if accuracy is None and isinstance(error.get("details"), dict):
        accuracy = error["details"].get("accuracy")
    platform = dict((status or {}).get("platform") or {})
    kept: Dict[str, str] = {}
    if isinstance(result.get("layers_kept"), dict):
        kept = {str(k): str(v) for k, v in result["layers_kept"].items()}
    elif run.sent_layers:
        kept = dict(run.sent_layers)
    latency = result.get("latency_ms") or {}
    row: Dict[str, Any] = {
        "device": run.device,
        "stage": run.stage + 1,
        "board": platform.get("board"),
        "online": (status or {}).get("online"),
        "state": run.state,
        "precision": result.get("precision") or (run.search or {}).get("precision"),
        "fallback_reason": result.get("fallback_reason"),
        "emulated": result.get("emulated"),
        "layers_kept": kept,
        "accuracy": accuracy,
        "throughput_qps": result.get("throughput_qps"),
        "latency_p50_ms": latency.get("median", latency.get("p50")),
        "latency_p99_ms": latency.get("p99"),
        "error_code": error.get("code"),
        "error_message": error.get("message"),
        "note": run.note,
        "job_id": run.job_id,
        "cache_hit": result.get("cache_hit"),
        "search": ({k: run.search.get(k) for k in ("mode", "keep", "evaluations", "builds",
                                                   "seconds", "passed")}
                   if run.search else None),
        "seconds": (round(run.finished - run.started, 2)
                    if run.finished is not None and run.started is not None else None),
    }
    return row


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def _kept_text(kept: Mapping[str, str]) -> str:
    if not kept:
        return "-"
    by_prec: Dict[str, List[str]] = {}
    for name, prec in sorted(kept.items()):
        by_prec.setdefault(prec, []).append(name)
    return "; ".join("{}:{}".format(",".join(names), {"float32": "fp32", "float16": "fp16"}.get(
        prec, prec)) for prec, names in sorted(by_prec.items()))


def results_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The results table plus numbered notes (fallback reasons, errors, cancellations)."""
    header = ["DEVICE", "BOARD", "STATE", "PRECISION", "KEPT IN HIGHER PRECISION", "ACCURACY",
              "QPS", "P50 ms", "P99 ms", "ERROR"]
    body, notes = [], []
    emulated = False
    for row in rows:
        precision = row.get("precision") or "-"
        if row.get("emulated"):
            precision += "*"
            emulated = True
        if row.get("fallback_reason"):
            notes.append("{}: fell back: {}".format(row["device"], row["fallback_reason"]))
            precision += " (fallback [{}])".format(len(notes))
        error = row.get("error_code") or ("see" if row.get("note") else "-")
        if row.get("error_message"):
            notes.append("{}: {} {}: {}".format(row["device"], row["state"], row["error_code"],
                                                row["error_message"]))
            error += " [{}]".format(len(notes))
        elif row.get("note"):
            notes.append("{}: {}".format(row["device"], row["note"]))
            error += " [{}]".format(len(notes))
        body.append([row["device"], _short(str(row.get("board") or "-"), 34), row["state"],
                     precision, _kept_text(row.get("layers_kept") or {}),
                     accuracy_summary(row.get("accuracy")), _num(row.get("throughput_qps"),
                                                                 "{:.0f}"),
                     _num(row.get("latency_p50_ms")), _num(row.get("latency_p99_ms")), error])
    text = format_table(header, body)
    if emulated:
        text += "\n* emulated by the onnxruntime backend: numerics are faithful, speed is not"
    for i, note in enumerate(notes, 1):
        text += "\n[{}] {}".format(i, _short(note, 400))
    return text


def summary_line(rollout: Rollout) -> str:
    counts = rollout.counts()
    parts = ["{} {}".format(n, s) for s, n in sorted(counts.items())]
    text = "rollout {}: {} ({})".format(rollout.rollout_id, rollout.final_outcome(),
                                        ", ".join(parts))
    if rollout.reason:
        text += ": " + rollout.reason
    return text


def rollout_report(rollout: Rollout, statuses: Mapping[str, Mapping[str, Any]],
                   extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    report: Dict[str, Any] = {
        "rollout_id": rollout.rollout_id,
        "job_ids": rollout.job_ids,
        "outcome": rollout.final_outcome(),
        "reason": rollout.reason or None,
        "stages": rollout.stages,
        "policy": rollout.policy._asdict(),
        "counts": rollout.counts(),
        "devices": [result_row(r, statuses.get(r.device)) for r in rollout.ordered()],
    }
    report.update(extra or {})
    return report


# ============================================================================ live progress

class ProgressView(object):
    """Per-device progress on stderr: bars redrawn in place on a terminal, a line per change
    otherwise (so logs stay readable)."""

    def __init__(self, stream: Optional[IO[str]] = None, enabled: bool = True,
                 tty: Optional[bool] = None, min_interval: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = (hasattr(self.stream, "isatty") and self.stream.isatty()) if tty is None \
            else tty
        self.min_interval = min_interval
        self.clock = clock
        self.t0 = clock()
        self._drawn = 0
        self._last_draw = 0.0
        self._seen: Dict[str, Any] = {}

    @staticmethod
    def describe(run: DeviceRun, status: Optional[Mapping[str, Any]]) -> str:
        what = run.state
        if run.phase and not run.terminal and run.state != PENDING:
            what += " " + run.phase
        if run.job_stage and not run.terminal:
            what += ": " + run.job_stage
        if status is not None and status.get("online") is False and not run.terminal:
            what += " (device offline)"
        return what

    def _bar(self, run: DeviceRun) -> str:
        p = run.progress or {}
        done, of = int(p.get("done") or 0), int(p.get("of") or 0)
        if run.terminal or of <= 0:
            return ""
        width = 20
        fill = int(width * min(done, of) / of)
        return " [{}{}] {}/{}".format("#" * fill, "." * (width - fill), done, of)

    def update(self, rollout: Rollout, statuses: Mapping[str, Mapping[str, Any]],
               force: bool = False) -> None:
        if not self.enabled:
            return
        runs = rollout.ordered()
        if self.tty:
            now = self.clock()
            if not force and now - self._last_draw < self.min_interval:
                return
            self._last_draw = now
            width = max(len(r.device) for r in runs)
            lines = ["{} stage {}/{}  {:.0f} s".format(
                rollout.rollout_id, max(rollout.current + 1, 1), len(rollout.stages),
                now - self.t0)]
            for r in runs:
                lines.append("  {}  {}{}".format(r.device.ljust(width),
                                                 self.describe(r, statuses.get(r.device)),
                                                 self._bar(r)))
            out = "\x1b[{}F".format(self._drawn) if self._drawn else ""
            out += "".join("\x1b[2K" + line + "\n" for line in lines)
            self.stream.write(out)
            self._drawn = len(lines)
        else:
            for r in runs:
                p = r.progress or {}
                finished = bool(p.get("of")) and p.get("done") == p.get("of")
                key = (r.state, r.phase, r.job_stage, finished,
                       (statuses.get(r.device) or {}).get("online"))
                if self._seen.get(r.device) == key:
                    continue
                self._seen[r.device] = key
                self.stream.write("[{:6.1f}s] {}: {}{}\n".format(
                    self.clock() - self.t0, r.device, self.describe(r, statuses.get(r.device)),
                    self._bar(r) if finished else ""))
        self.stream.flush()


# ============================================================================ MQTT edge

class DeviceDirectory(object):
    """Devices as their retained status shows them (a late Will of an older boot is dropped),
    plus the last telemetry seen."""

    def __init__(self) -> None:
        self.status: Dict[str, Dict[str, Any]] = {}
        self.telemetry: Dict[str, Dict[str, Any]] = {}

    def on_status(self, device: str, msg: Dict[str, Any]) -> bool:
        last = self.status.get(device)
        if last is not None and protocol.status_is_stale(last.get("boot"), msg):
            return False
        self.status[device] = msg
        return True

    def on_telemetry(self, device: str, msg: Dict[str, Any]) -> None:
        self.telemetry[device] = msg

    def known(self) -> List[str]:
        return sorted(self.status)


class FleetConnection(object):
    """One MQTT connection for a controller command: connect (failing fast with
    ``broker_unreachable``), subscribe, publish, and hand messages to ``on_message``."""

    def __init__(self, broker: str = "mqtt://localhost:1883", prefix: str = protocol.DEFAULT_PREFIX,
                 username: Optional[str] = None, password: Optional[str] = None,
                 ca_file: Optional[str] = None, protocol_version: str = "v5",
                 connect_timeout: float = 5.0, cert_file: Optional[str] = None,
                 key_file: Optional[str] = None) -> None:
        from agent.config import parse_broker_url

        parsed = parse_broker_url(broker)
        self.host = parsed[("broker", "host")]
        self.port = int(parsed[("broker", "port")])
        self.tls = bool(parsed.get(("broker", "tls", "enabled"))) or ca_file is not None \
            or cert_file is not None
        self.url = broker
        self.topics = protocol.Topics(prefix)
        self.username, self.password, self.ca_file = username, password, ca_file
        self.cert_file, self.key_file = cert_file, key_file  # mutual TLS
        self.protocol_version = protocol_version
        self.connect_timeout = connect_timeout
        self.directory = DeviceDirectory()
        self.client: Any = None
        self._unacked: List[Any] = []

    def connect(self) -> "FleetConnection":
        from agent import mqtt

        tls = mqtt.TlsOptions(ca_file=self.ca_file, cert_file=self.cert_file,
                              key_file=self.key_file) if self.tls else None
        self.client = mqtt.MqttClient(
            "fleet-" + uuid.uuid4().hex[:12], self.host, self.port,
            protocol=self.protocol_version, username=self.username, password=self.password,
            tls=tls, session_expiry=0, clean_start=True, reconnect_min=0.5, reconnect_max=5.0,
            max_packet_bytes=None, events=queue.Queue(10000))
        self.client.start()
        deadline = time.monotonic() + self.connect_timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                raise AgentError("broker_unreachable", "cannot connect to the MQTT broker at "
                                 "{}:{}: no answer within {:.0f} s (is it running? check "
                                 "--broker)".format(self.host, self.port, self.connect_timeout),
                                 {"host": self.host, "port": self.port})
            try:
                ev = self.client.events.get(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if ev.kind == mqtt.CONNECTED:
                return self
            if ev.kind == mqtt.CONNECT_FAILED:
                self.close()
                raise AgentError("broker_unreachable", "cannot connect to the MQTT broker at "
                                 "{}:{}: {} (is it running? check --broker)".format(
                                     self.host, self.port, ev.reason),
                                 {"host": self.host, "port": self.port})

    def close(self) -> None:
        if self.client is not None:
            self.client.stop()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the broker acknowledged every QoS 1 message published so far."""
        deadline = time.monotonic() + timeout
        for handle in self._unacked:
            if not handle.wait(max(0.0, deadline - time.monotonic())):
                return False
        self._unacked = []
        return True

    def subscribe(self, filters: Iterable[str], qos: int = 1) -> None:
        for f in filters:
            self.client.subscribe(f, qos)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                wait: Optional[float] = None) -> Any:
        handle = self.client.publish(topic, payload, qos=qos, retain=retain)
        if qos:
            self._unacked = [h for h in self._unacked if not h.acked] + [handle]
        if wait is not None and not handle.wait(wait):
            raise AgentError("broker_unreachable", "the broker at {}:{} did not acknowledge a "
                             "message on {} within {:.0f} s".format(self.host, self.port, topic,
                                                                    wait))
        return handle

    def pump(self, on_message: Callable[[protocol.TopicInfo, Any], None], timeout: float
             ) -> bool:
        """Handle events for up to ``timeout`` s; True if a SUBSCRIBED event was among them.
        Status and telemetry messages update ``directory`` before ``on_message`` sees them."""
        from agent import mqtt

        subscribed = False
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                ev = self.client.events.get(timeout=max(0.0, min(left, 0.1)))
            except queue.Empty:
                if left <= 0:
                    return subscribed
                continue
            if ev.kind == mqtt.SUBSCRIBED:
                subscribed = True
            elif ev.kind == mqtt.DISCONNECTED:
                log.warning("lost the broker connection (%s); reconnecting", ev.reason)
            elif ev.kind == mqtt.MESSAGE:
                self._dispatch(ev, on_message)
            if time.monotonic() >= deadline:
                return subscribed

    def _dispatch(self, ev: Any, on_message: Callable[[protocol.TopicInfo, Any], None]) -> None:
        try:
            info = self.topics.parse(ev.topic)
        except AgentError:
            return
        if info.kind in ("artifact_request", "block", "job"):
            on_message(info, ev)
            return
        if not ev.payload:
            return
        try:
            msg = protocol.decode(info.kind, ev.payload)
        except AgentError as exc:
            log.warning("dropping a message on %s: %s", ev.topic, exc)
            return
        if info.kind == "status":
            if not self.directory.on_status(info.device, msg):
                return
        elif info.kind == "telemetry":
            self.directory.on_telemetry(info.device, msg)
        on_message(info, msg)

    def settle(self, on_message: Callable[[protocol.TopicInfo, Any], None],
               quiet: float = 0.3, limit: float = 5.0) -> None:
        """Wait for the subscriptions to be acknowledged and the retained messages that follow
        them to arrive (until ``quiet`` s pass without one, at most ``limit`` s)."""
        deadline = time.monotonic() + limit
        got_suback = False
        while time.monotonic() < deadline and not got_suback:
            got_suback = self.pump(on_message, 0.1)
        seen = [0]

        def counting(info: protocol.TopicInfo, msg: Any) -> None:
            seen[0] += 1
            on_message(info, msg)

        while time.monotonic() < deadline:
            seen[0] = 0
            self.pump(counting, quiet)
            if not seen[0]:
                return


def _ignore(info: protocol.TopicInfo, msg: Any) -> None:
    return None


def discover(conn: FleetConnection, telemetry_wait: float = 0.0) -> DeviceDirectory:
    """Retained device statuses (and telemetry heard within ``telemetry_wait`` s)."""
    conn.subscribe([conn.topics.prefix + "/devices/+/status"])
    if telemetry_wait > 0:
        conn.subscribe([conn.topics.prefix + "/devices/+/telemetry"], 0)
    conn.settle(_ignore)
    if telemetry_wait > 0:
        conn.pump(_ignore, telemetry_wait)
    return conn.directory


def run_rollout(conn: FleetConnection, rollout: Rollout, files: Mapping[str, str],
                view: Optional[ProgressView] = None, timeout: float = 3600.0,
                server: Any = None, share_group: Optional[str] = None) -> Rollout:
    """Carry ``rollout`` out over ``conn`` (connected, directory filled): serve the artifact
    blocks, publish the job documents stage by stage, follow the job statuses until every
    device has finished, the timeout passes or the user interrupts (KeyboardInterrupt is
    re-raised after the queued devices were cancelled). ``share_group``: take block requests
    through an MQTT v5 shared subscription, so that controllers serving the same files split
    them."""
    from agent.transfer import BlockServer

    topics = conn.topics
    if server is None:
        server = BlockServer(lambda t, p, q=1, r=False: conn.publish(t, p, q, r), topics)
        for path in files.values():
            server.add_file(path)
    view = view or ProgressView(enabled=False)
    base = topics.prefix + "/devices/+"
    conn.subscribe([base + "/jobs/{}/status".format(j) for j in rollout.job_ids])
    requests = base + "/artifacts/+/request"
    if share_group is not None:
        requests = "$share/{}/{}".format(protocol.check_id("share group", share_group),
                                         requests)
    conn.subscribe([requests])
    statuses = conn.directory.status

    def on_message(info: protocol.TopicInfo, msg: Any) -> None:
        if info.kind == "artifact_request":
            try:
                server.handle_request(msg.topic, msg.payload)
            except AgentError as exc:
                log.info("block request from %s not answered: %s", info.device, exc)
        elif info.kind == "job_status" and info.device in rollout.runs:
            execute(rollout.on_job_status(info.device, msg))

    def execute(actions: List[Action]) -> None:
        for action in actions:
            if action.kind == "publish":
                conn.publish(topics.job(action.device, action.job_id),
                             protocol.encode(action.doc or {}), qos=1, retain=True, wait=10.0)
            elif action.kind == "clear":
                conn.publish(topics.job(action.device, action.job_id), b"", qos=1, retain=True)
                rollout.mark_cleared(action.device, action.job_id)
            elif action.kind == "cancel":
                command = {"protocol": protocol.PROTOCOL_VERSION, "command": "cancel",
                           "request_id": "c" + uuid.uuid4().hex[:10], "job_id": action.job_id}
                conn.publish(topics.commands(action.device), protocol.encode(command), qos=1)

    deadline = time.monotonic() + timeout
    try:
        conn.settle(on_message)  # subscriptions in place before the first job goes out
        execute(rollout.start())
        view.update(rollout, statuses, force=True)
        while not rollout.done:
            if time.monotonic() >= deadline:
                execute(rollout.expire("the rollout did not finish within {:.0f} s (--timeout)"
                                       .format(timeout)))
                break
            conn.pump(on_message, 0.2)
            view.update(rollout, statuses)
    except KeyboardInterrupt:
        execute(rollout.expire("interrupted by the user", state="CANCELED",
                               outcome="interrupted"))
        view.update(rollout, statuses, force=True)
        _flush(conn)
        raise
    view.update(rollout, statuses, force=True)
    _flush(conn)
    return rollout


def _flush(conn: FleetConnection, timeout: float = 5.0) -> None:
    """Let queued publishes (cleared documents, cancels) reach the broker before we leave."""
    conn.flush(timeout)
