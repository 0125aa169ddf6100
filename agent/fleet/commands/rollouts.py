"""``fleet rollouts ls|show|pause|resume|cancel``: the rollouts in the fleet database, as
data (``attach`` is agent.fleet.commands.rollout_run's)."""

from typing import Any, Dict, List, Tuple

from agent import fleet
from agent.errors import AgentError
from agent.fleet.database.store import Store
from agent.fleet.rollouts import durable

CONTROLS = ("pause", "resume", "cancel")


def rows(store: Store) -> List[Dict[str, Any]]:
    """Every rollout, newest first (the dashboard's rows: agent.fleet.web.views)."""
    from agent.fleet.web import views

    return list(views.rollout_rows(store, limit=None, failures=False))


def control(store: Store, rollout_id: str, action: str) -> Dict[str, Any]:
    """Ask the service to pause, resume or cancel; the rollout's row before the request."""
    return dict(store.request_control(rollout_id, action))


def show(store: Store, rollout_id: str, history: bool = False
         ) -> Tuple[Dict[str, Any], fleet.Rollout, Dict[str, Any]]:
    """(report, rollout, summary): the report as ``fleet rollout`` prints it, with the state,
    stage progress, model, rollbacks (and with ``history`` every job status received); the
    summary is the dashboard's view of the rollout's row."""
    # The row before the jobs: a state read after them could be newer than they are (a
    # "cancelled" rollout whose device still showed QUEUED).
    row = store.rollout(rollout_id) or {}
    ro = durable.load(store, rollout_id)
    if ro is None:
        raise AgentError("unknown_job", "no rollout {!r} in the fleet database".format(
            rollout_id))
    from agent.fleet.web import views

    summary = views.rollout_detail(store, row, jobs=[]) if row else {}
    report = fleet.rollout_report(ro, store.statuses(), {
        "state": row.get("state"), "stage_progress": row.get("stage_progress"),
        "model": summary.get("model_name"), "rollbacks": summary.get("rollbacks"),
        "rolled_back": summary.get("rolled_back"),
        "history": store.job_history(rollout_id) if history else None})
    return report, ro, dict(summary, state_text=summary.get("state_text") or row.get("state"))
