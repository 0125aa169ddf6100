"""How a switch ends its job: SUCCEEDED with the version's facts, or FAILED with the refusal's
code (``handoff_rolled_back`` unless a check refused it: ``live_check_failed`` ...)."""

from typing import Any, Callable, Dict, List, Optional

from agent.device.jobs.run import Run
from agent.device.models import sets as model_sets
from agent.device.status_publisher import fit_result
from agent.errors import AgentError


def committing_stage(run: Run) -> str:
    """The stage of a job whose version is pending: ``committing``; for a job without a model
    name (a controller of the release before named models, whose schema knows no such stage)
    ``activating``, with ``commit: pending`` in its details either way."""
    return "committing" if run.doc.get("model_name") is not None else "activating"


class JobEnds(object):
    """``end(run, state, error=, result=)`` ends a job (job_end); ``set_state(set_id)`` says
    where the job's model set stands now (open | committed | reverted)."""

    def __init__(self, journal: Any, end: Callable[..., None], changed: Callable[[], None],
                 set_state: Callable[[str], str]) -> None:
        self.journal, self.end, self.changed, self.set_state = journal, end, changed, set_state

    def succeed(self, run: Run, name: str, version: str, previous: Optional[str],
                result: Optional[Dict[str, Any]] = None) -> None:
        out = dict(result or {})
        for key in ("io", "activate", "engine", "calibration_cache"):
            out.pop(key, None)
        prev_row = self.journal.model_version(name, previous) if previous else None
        out["activated"] = True
        out["previous_engine"] = prev_row["engine_key"] if prev_row else None
        out["model"] = {"name": name, "version": version, "previous": previous,
                        "state": "committed"}
        spec = model_sets.parse(run.doc) if run.doc.get("model_set") is not None else None
        if spec is not None:  # the rollout's view shows it
            out["model"]["set"] = {"id": spec.id, "state": self.set_state(spec.id)}
        run.details.pop("commit", None)
        self.end_if_running(run, "SUCCEEDED", result=fit_result(out))
        self.changed()

    def fail_rolled_back(self, run: Run, name: str, version: str, previous: Optional[str],
                         reason: str, errors: Optional[List[str]] = None,
                         refusal: Optional[AgentError] = None) -> None:
        """``refusal``: the check that refused the version (its code and details), else the
        rollback is ``handoff_rolled_back``."""
        run.details.pop("commit", None)
        details: Dict[str, Any] = {"name": name, "version": version, "previous": previous,
                                   "reason": reason}
        if errors:
            details["revert_errors"] = errors[:5]
        if refusal is not None:
            details.update(refusal.details)
        self.end_if_running(run, "FAILED", error=AgentError(
            refusal.code if refusal is not None else "handoff_rolled_back",
            "{}@{} was rolled back to {}: {}".format(
                name, version, previous or "no version", reason), details).to_dict())
        self.changed()

    def end_if_running(self, run: Run, state: str, **kwargs: Any) -> None:
        row = self.journal.job(run.job_id)
        if row is None or row["state"] != "IN_PROGRESS":
            return  # cancelled meanwhile: the version went its own way
        self.end(run, state, **kwargs)
