"""An operator's action on a live deployment: ``pause``, ``resume``, ``retry``, ``rm`` and
``undo``, as ``fleet deployments ACTION`` and the dashboard's buttons record them (one place,
so the two agree). Writes the deployment's row; ``fleet serve`` applies it within a second.
"""

from typing import Any, Dict, Sequence

from agent.errors import AgentError
from agent.fleet.deployments import deployments, revisions

ACTIONS = ("pause", "resume", "retry", "rm", "undo")


def apply(store: Any, deployment: str, action: str, devices: Sequence[str] = (),
          actor: Any = None) -> Dict[str, Any]:
    """Record ``action`` on the live deployment ``deployment`` (``devices``: a retry of these
    only); returns its row afterwards. ``bad_state_transition`` for one that no longer governs
    (superseded, removed), ``no_previous_revision`` for an undo without one."""
    dep = deployments.get(store, deployment)
    did = dep["deployment_id"]
    if action not in ACTIONS:
        raise AgentError("bad_argument", "expected a deployment action ({}), found {!r}".format(
            ", ".join(ACTIONS), str(action)[:40]))
    if dep["state"] not in deployments.LIVE:
        raise AgentError("bad_state_transition", "deployment {} is {}; expected a live one "
                         "(pending, rolling, active, paused or halted)".format(did, dep["state"]))
    if action == "undo":
        return revisions.undo(store, dep, actor=actor)
    if action == "pause":
        deployments.set_state(store, did, "paused", "paused by the operator")
        deployments.cancel_rollouts(store, did, "pause")
    elif action == "resume":
        wave = [r for r in deployments.rollouts_of(store, did) if r.endswith("-w")]
        running = wave and (store.rollout(wave[0]) or {}).get("state") in ("running", "paused")
        deployments.set_state(store, did, "rolling" if running else (
            "pending" if not wave else "active"), None)
        deployments.cancel_rollouts(store, did, "resume")
    elif action == "rm":
        deployments.set_state(store, did, "removed", "removed by the operator")
        deployments.cancel_rollouts(store, did)
    else:  # retry: failures and spent attempts no longer hold the devices back
        deployments.retry(store, did, devices)
        if dep["state"] == "halted":
            deployments.set_state(store, did, "active", None)
    return deployments.get(store, did)
