"""Deployment revisions: every (version, selector, spec) a deployment has had, oldest first,
and ``undo`` (``fleet deployments undo NAME``), Kubernetes' ``rollout undo``: the previous
revision becomes the desired spec again (as a new revision, so a second undo goes back), and
the deployment's runner converges the devices to it. Nothing fights the spec.

A deployment that supersedes another of the same model and selector (``fleet deploy`` of a
new version to the same group) carries on its history: undo of ``det@4`` goes back to the
``det@3`` it replaced.
"""

import json
import time
from typing import Any, Dict, List, Mapping, Optional, Union

from agent.errors import AgentError

MAX_REVISIONS = 50  # kept per deployment (Kubernetes' revisionHistoryLimit: 10)


def history(store: Any, deployment_id: str) -> List[Dict[str, Any]]:
    return [{"revision": int(r[0]), "version": r[1], "selector": r[2], "spec": json.loads(r[3]),
             "actor": r[4], "created": r[5]}
            for r in store.db.query(
                "SELECT revision, version, selector, spec, actor, created FROM "
                "deployment_revisions WHERE deployment_id = ? ORDER BY revision",
                (deployment_id,))]


def record(store: Any, deployment_id: str, version: str, selector: str,
           spec: Mapping[str, Any], actor: Optional[str] = None,
           inherit: Optional[str] = None) -> int:
    """Append a revision (``inherit``: first copy the history of the deployment this one
    supersedes); returns its number. Call inside the transaction that writes the row."""
    if inherit is not None and not store.db.query(
            "SELECT 1 FROM deployment_revisions WHERE deployment_id = ?", (deployment_id,)):
        store.db.execute(
            "INSERT INTO deployment_revisions (deployment_id, revision, version, selector, "
            "spec, actor, created) SELECT ?, revision, version, selector, spec, actor, created "
            "FROM deployment_revisions WHERE deployment_id = ?", (deployment_id, inherit))
    top = store.db.query("SELECT MAX(revision) FROM deployment_revisions WHERE "
                         "deployment_id = ?", (deployment_id,))
    n = int(top[0][0] or 0) + 1 if top else 1
    store.db.execute(
        "INSERT INTO deployment_revisions (deployment_id, revision, version, selector, spec, "
        "actor, created) VALUES (?, ?, ?, ?, ?, ?, ?)",
        (deployment_id, n, version, selector, json.dumps(dict(spec), sort_keys=True), actor,
         time.time()))
    store.db.execute("DELETE FROM deployment_revisions WHERE deployment_id = ? AND revision "
                     "<= ?", (deployment_id, n - MAX_REVISIONS))
    return n


def undo(store: Any, deployment: Union[str, Mapping[str, Any]], actor: Optional[str] = None
         ) -> Dict[str, Any]:
    """Return ``deployment`` (an id or its row) to its previous revision; returns the row
    after the change. AgentError ``no_previous_revision`` without one, ``bad_state_transition``
    for a deployment that no longer governs (superseded, removed)."""
    from agent.fleet.deployments import deployments, pins

    dep_id = deployment if isinstance(deployment, str) else str(deployment["deployment_id"])
    with store.transaction():
        dep = deployments.get(store, dep_id)
        if dep["state"] not in deployments.LIVE:
            raise AgentError("bad_state_transition", "deployment {} is {}; expected a live one "
                             "to undo (undo the deployment that superseded it)".format(
                                 dep_id, dep["state"]))
        revs = history(store, dep_id)
        if len(revs) < 2:
            raise AgentError("no_previous_revision", "deployment {}: expected an earlier "
                             "revision to return to, found {} revision(s)".format(
                                 dep_id, len(revs)))
        prev = revs[-2]
        record(store, dep_id, prev["version"], prev["selector"], prev["spec"],
               actor or pins.actor())
        # A deployment whose first wave ran keeps catching up (active); paused stays paused.
        state = dep["state"] if dep["state"] in ("paused", "pending") else "active"
        store.db.execute(
            "UPDATE deployments SET version = ?, selector = ?, spec = ?, state = ?, reason = ?, "
            "updated = ? WHERE deployment_id = ?",
            (prev["version"], prev["selector"], json.dumps(prev["spec"], sort_keys=True), state,
             "undone to revision {} ({}@{})".format(prev["revision"], dep["name"],
                                                   prev["version"]), time.time(), dep_id))
        # The devices' failures and timeouts were of the other version: they start afresh.
        deployments.retry(store, dep_id)
    deployments.cancel_rollouts(store, dep_id)  # they send the spec that is no more
    return deployments.get(store, dep_id)
