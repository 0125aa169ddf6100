"""The ``rollback`` device command: a model name back to a kept version. Two forms:
``{"name": NAME}`` (optionally ``"version": V``: a specific kept version) and today's
``{"model": SHA256}`` (the name holding those bytes, back to its previous version). The switch
itself is ``model_switch.rollback`` (the journal, ``current``, the hand-off of the restored
version). Refused, with nothing changed, when nothing is kept to go back to:
``no_previous_version`` for the name form, today's ``no_previous_engine`` for the sha form."""

from typing import Any, Dict, Mapping

from agent.errors import AgentError


def rollback(journal: Any, switch: Any, cmd: Mapping[str, Any]) -> Dict[str, Any]:
    """Returns the restored version and the one it replaced."""
    if cmd.get("name") is not None:
        return dict(switch.rollback(cmd["name"], cmd.get("version")))
    model_sha = cmd["model"]
    active = journal.active_engine(model_sha)
    if active is None or journal.previous_engine(model_sha) is None:
        raise AgentError("no_previous_engine", "model {} has no previous engine on this device "
                         "(only one engine was ever activated for it, or it was rolled back "
                         "already)".format(model_sha[:12]))
    try:
        out = dict(switch.rollback(active["name"]))
    except AgentError as exc:
        if exc.code == "no_previous_version":
            raise AgentError("no_previous_engine", exc.message)
        raise
    out["model"] = model_sha
    return out
