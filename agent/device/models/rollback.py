"""The ``rollback`` device command: a model name back to a kept version. Two forms:
``{"name": NAME}`` (optionally ``"version": V``: a specific kept version) and today's
``{"model": SHA256}`` (the name holding those bytes, back to its previous version). The switch
itself is ``model_switch.rollback`` (the journal, ``current``, the hand-off of the restored
version). Refused, with nothing changed, when nothing is kept to go back to:
``no_previous_version`` for the name form, today's ``no_previous_engine`` for the sha form."""

import logging
from typing import Any, Dict, List, Mapping

from agent.errors import AgentError

log = logging.getLogger("agent.device.daemon")


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


def revoke(journal: Any, switch: Any, cmd: Mapping[str, Any], cache_root: str
           ) -> Dict[str, Any]:
    """The ``revoke_engine`` command (``fleet engines revoke SHA``): every model name whose
    active version runs the shared engine ``cmd["engine"]`` (its journal row's ``built_by``,
    recorded when it was adopted) goes back to its previous version, and the engine leaves the
    engine cache (a later build of the same key must not find it there: it builds). A name
    with no previous version is reported, not left silently on the engine (the operator
    redeploys: the engine is no longer offered, so the device builds its own)."""
    sha = str(cmd["engine"])
    out: List[Dict[str, Any]] = []
    for row in journal.active_versions():
        built_by = (row.get("info") or {}).get("built_by") or {}
        if not isinstance(built_by, dict) or built_by.get("shared_sha256") != sha:
            continue
        item: Dict[str, Any] = {"name": row["name"], "version": row["version"],
                                "engine_key": row.get("engine_key")}
        try:
            item.update(rolled_back=dict(switch.rollback(row["name"])))
        except AgentError as exc:
            item.update(error=exc.to_dict())
        out.append(item)
        dropped = _drop_cached(cache_root, str(row.get("engine_key") or ""))
        item["cache_dropped"] = dropped
        log.warning("revoked shared engine %s (built by %s, key id %s): %s %s", sha[:16],
                    built_by.get("device"), built_by.get("key_id"), row["name"],
                    "rolled back" if "rolled_back" in item else "has no previous version")
    return {"engine": sha, "versions": out}


def _drop_cached(cache_root: str, key: str) -> bool:
    """Remove the engine cache entry of ``key`` when it came from the fleet."""
    if not key:
        return False
    from agent.engines.cache import EngineCache

    cache = EngineCache(cache_root)
    entry = cache.get(key, touch=False)
    if entry is None or not (entry.meta or {}).get("shared_from"):
        return False
    return cache.drop_if_unlocked(key)
