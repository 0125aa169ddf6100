"""The precision decision: ``decide(request, info)`` picks a precision from the platform's matrix
row or rejects, following the fallback chains; pure. ``for_row()`` builds a ``PlatformInfo`` for
a matrix row without detection, to plan for another board."""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from agent.errors import AgentError
from agent.platform.info import PlatformInfo
from agent.platform.matrix import (
    BEST_ORDER,
    FALLBACK_CHAINS,
    FALLBACK_POLICIES,
    PRECISIONS,
    Matrix,
    load_matrix,
)
from agent.platform.parsers import _VERSION_RE


def for_row(row_id: str, matrix: Optional[Matrix] = None) -> PlatformInfo:
    """A PlatformInfo for a matrix row without detection: ``"nano"``, ``"host"``, ``"cc-8.6"``.
    For planning on a controller (will this job run on that board?) and for tests."""
    matrix = matrix or load_matrix()
    info = PlatformInfo(matrix, root="")
    if row_id == "host":
        info.board = matrix.host["name"]
        return info
    if row_id.startswith("cc-"):
        cc = row_id[3:]
        if not _VERSION_RE.match(cc):
            raise AgentError("bad_argument",
                             "matrix row {!r}: expected cc-<major.minor>".format(row_id))
        info.kind = "dgpu"
        info.backend = "tensorrt"
        info.compute_capability = cc
        info.matrix_row = matrix.cc_row(cc, "compute capability " + cc)
        info.board = info.matrix_row["name"]
        return info
    if row_id not in matrix.families:
        raise AgentError("bad_argument", "unknown matrix row {!r}: expected one of {}".format(
            row_id, ", ".join(list(matrix.families) + ["host", "cc-<major.minor>"])))
    fam = matrix.families[row_id]
    info.kind = "jetson"
    info.backend = "tensorrt"
    info.family = row_id
    info.matrix_row = matrix.family_row(row_id)
    info.board = fam["name"]
    info.soc = fam["soc"]
    info.gpu_arch = matrix.socs[fam["soc"]]["gpu_arch"]
    info.compute_capability = matrix.socs[fam["soc"]]["compute_capability"]
    info.dla_cores = fam["dla_cores"]
    return info


class Decision(object):
    """The outcome of ``decide()``. ``precision`` is the chosen concrete precision (None when
    rejected); ``plan_precision`` is what to put in BuildPlan.precision ("best" when the request
    was best and the board runs both int8 and fp16, as TensorRT's --best would)."""

    def __init__(self, status: str, precision: Optional[str], requested: Union[str, List[str]],
                 reason: str, emulated: bool, info: PlatformInfo, fallback: str,
                 plan_precision: Optional[str], supported: List[str]) -> None:
        self.status = status  # "accepted" | "fell_back" | "rejected"
        self.precision = precision
        self.requested = requested
        self.reason = reason
        self.emulated = emulated
        self.fallback = fallback
        self.plan_precision = plan_precision
        self.board = info.board
        self.row_id = info.matrix_row["id"]
        self.supported = supported

    @property
    def ok(self) -> bool:
        return self.status != "rejected"

    def to_dict(self) -> Dict[str, Any]:
        return {
            "status": self.status,
            "precision": self.precision,
            "plan_precision": self.plan_precision,
            "requested": self.requested,
            "reason": self.reason,
            "emulated": self.emulated,
            "fallback": self.fallback,
            "board": self.board,
            "matrix_row": self.row_id,
            "supported": list(self.supported),
        }

    def raise_if_rejected(self) -> "Decision":
        if self.status == "rejected":
            raise AgentError("unsupported_precision", self.reason, self.to_dict())
        return self


def _levels_for(info: PlatformInfo, backend: Optional[str], buildable: Optional[Sequence[str]]
                ) -> Tuple[Dict[str, str], str, Dict[str, str]]:
    """(precision -> level, where, precision -> why it is none here)."""
    notes = dict(info.matrix_row.get("precision_notes") or {})
    if backend and backend != info.backend:
        if backend == "onnxruntime":
            levels, where = dict(info.matrix.host["precisions"]), "the onnxruntime backend"
        else:
            raise AgentError("bad_argument", "backend {!r} does not run on {} (its backend is "
                             "{!r})".format(backend, info.describe(), info.backend))
    else:
        levels, where = dict(info.matrix_row["precisions"]), info.describe()
        if info.backend == "tensorrt":
            for precision in PRECISIONS:  # the board runs it, its TensorRT may not have it
                why = info.matrix.tensorrt_lacks(precision, info.tensorrt)
                if why and levels.get(precision, "none") != "none":
                    levels[precision], notes[precision] = "none", why
    if buildable is not None:
        for precision in PRECISIONS:
            if precision not in buildable and levels.get(precision, "none") != "none":
                levels[precision] = "none"
                notes[precision] = "the agent builds {} engines only".format(
                    ", ".join(buildable))
    return levels, where, notes


def decide(request: Union[str, Sequence[str]], info: PlatformInfo, fallback: str = "allow",
           backend: Optional[str] = None, buildable: Optional[Sequence[str]] = None
           ) -> Decision:
    """Pick a precision for ``request`` ("fp32", "fp16", "int8", "best", "tf32", "bf16", "fp8",
    "fp4", or a list in preference order) on ``info``'s matrix row. ``fallback="allow"`` walks
    down FALLBACK_CHAINS from the last preference; ``"reject"`` stops at the list. ``backend``
    ("onnxruntime") decides for another backend than the platform's own. ``buildable`` (the
    precisions the caller can build, e.g. a job's) leaves the others out, so a fallback list
    never lands on one the build then refuses. A precision the installed TensorRT has no type
    for (bf16 before 9.0) is none on the tensorrt backend. Pure; never raises for an
    unsupported precision (see ``Decision.raise_if_rejected``)."""
    if fallback not in FALLBACK_POLICIES:
        raise AgentError("bad_argument", "fallback policy must be one of {}, found {!r}".format(
            ", ".join(FALLBACK_POLICIES), fallback))
    prefs = [request] if isinstance(request, str) else list(request)
    if not prefs:
        raise AgentError("bad_argument", "precision request is empty: expected one of {}".format(
            ", ".join(PRECISIONS + ("best",))))
    for p in prefs:
        if p not in PRECISIONS and p != "best":
            raise AgentError("bad_argument", "unknown precision {!r}: expected one of {}".format(
                p, ", ".join(PRECISIONS + ("best",))))
    levels, where, notes = _levels_for(info, backend, buildable)

    def _why_not(_info: PlatformInfo, precision: str) -> str:
        return " ({})".format(notes[precision]) if notes.get(precision) else ""

    supported = [p for p in PRECISIONS if levels.get(p, "none") != "none"]
    requested = request if isinstance(request, str) else list(prefs)

    def make(status: str, chosen: Optional[str], reason: str, plan: Optional[str] = None
             ) -> Decision:
        emulated = bool(chosen and levels.get(chosen) == "emulated")
        if chosen and emulated:
            reason += " (emulated by the onnxruntime backend: numerics, not speed)"
        return Decision(status, chosen, requested, reason, emulated, info, fallback,
                        plan or chosen, supported)

    tried: List[str] = []
    for i, pref in enumerate(prefs):
        status = "accepted" if i == 0 else "fell_back"
        missing = "; ".join("{} is not supported{}".format(t, _why_not(info, t)) for t in tried)
        if pref == "best":
            usable = [p for p in BEST_ORDER if levels.get(p, "none") != "none"]
            chosen = usable[0]
            plan = "best" if chosen == "int8" and "fp16" in usable else chosen
            reason = "best on {} is {} (the fastest of {} it runs)".format(
                where, chosen, ", ".join(usable))
            return make(status, chosen, (missing + "; " if missing else "") + reason, plan)
        if levels.get(pref, "none") != "none":
            reason = "{} runs on {}".format(pref, where)
            return make(status, pref, (missing + "; fell back to " + pref + ": " + reason)
                        if missing else reason)
        tried.append(pref)
    missing = "; ".join("{} is not supported{}".format(t, _why_not(info, t)) for t in tried)
    head = "{} on {}; it supports {}".format(missing, where, ", ".join(
        p + (" (emulated)" if levels[p] == "emulated" else "") for p in supported))
    if fallback == "reject":
        return make("rejected", None, head + "; fallback policy is 'reject'")
    for alt in FALLBACK_CHAINS[prefs[-1]]:
        if alt not in tried and levels.get(alt, "none") != "none":
            return make("fell_back", alt, "{}; fell back to {}".format(head, alt))
    return make("rejected", None, head + "; nothing to fall back to")
