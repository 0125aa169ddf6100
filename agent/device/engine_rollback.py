"""The ``rollback`` device command: make a model's previous engine active again (the journal
keeps the active and the previous engine of every model). Refused, with nothing changed, when
there is no previous engine or its file has left the engine cache."""

import os
from typing import Any, Dict

from agent.errors import AgentError


def rollback(journal: Any, model_sha: str) -> Dict[str, Any]:
    """Returns the restored engine and the one it replaced. AgentError no_previous_engine."""
    previous = journal.previous_engine(model_sha)
    if previous is None:
        raise AgentError("no_previous_engine", "model {} has no previous engine on this device "
                         "(only one engine was ever activated for it, or it was rolled back "
                         "already)".format(model_sha[:12]))
    path = (previous.get("info") or {}).get("engine")
    if isinstance(path, str) and path and not os.path.exists(path):
        raise AgentError("no_previous_engine", "the previous engine {} of model {} is no "
                         "longer in the engine cache (expected {})".format(
                             previous["engine_key"], model_sha[:12], path))
    current = journal.active_engine(model_sha)
    restored = journal.rollback(model_sha)
    return {"model": model_sha, "engine_key": restored["engine_key"],
            "precision": restored.get("precision"), "job_id": restored.get("job_id"),
            "replaced": current["engine_key"] if current else None}
