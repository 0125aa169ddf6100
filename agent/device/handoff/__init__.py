"""Hand-off adapters: the daemon config's ``handoff:`` list, each entry ``{type, models, ...}``
(``models``: ``["*"]`` or a list of model names), its type's keys handed to
``agent.device.handoff.<type>.from_config``. Types are found by module name, imported when the
config names them, so an adapter module plugs in without a change here.
"""

import importlib
import re
from typing import Any, List, Mapping, NamedTuple, Sequence

from agent.device.handoff.base import Adapter, ModelVersion
from agent.errors import AgentError
from agent.wire.model_names import name_list

TYPE_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
MAX_ENTRIES = 32

__all__ = ["Adapter", "Entry", "ModelVersion", "adapters_for", "parse"]


class Entry(NamedTuple):
    """One ``handoff:`` entry: the adapter and the names it serves (``("*",)``: all)."""

    adapter: Adapter
    models: Sequence[str]

    def serves(self, name: str) -> bool:
        return "*" in self.models or name in self.models


def parse(entries: Any, where: str = "handoff") -> List[Entry]:
    """The ``handoff:`` list -> entries; AgentError bad_config naming the entry and key."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        raise AgentError("bad_config", "{} expects a list of entries, found {!r}".format(
            where, entries))
    if len(entries) > MAX_ENTRIES:
        raise AgentError("bad_config", "{} expects at most {} entries, found {}".format(
            where, MAX_ENTRIES, len(entries)))
    out = []
    for i, entry in enumerate(entries):
        at = "{}[{}]".format(where, i)
        if not isinstance(entry, Mapping):
            raise AgentError("bad_config", "{} expects a mapping with type and models, found "
                             "{!r}".format(at, entry))
        kind = entry.get("type")
        if not isinstance(kind, str) or not TYPE_RE.match(kind) or kind == "base":
            raise AgentError("bad_config", "{}.type expects triton, deepstream or command, "
                             "found {!r}".format(at, kind))
        models = name_list(entry.get("models", ["*"]), at + ".models")
        try:
            module = importlib.import_module("agent.device.handoff." + kind)
        except ImportError as exc:
            if getattr(exc, "name", None) != "agent.device.handoff." + kind:
                raise
            raise AgentError("bad_config", "{}.type expects triton, deepstream or command, "
                             "found {!r} (no such hand-off)".format(at, kind))
        rest = {k: v for k, v in entry.items() if k not in ("type", "models")}
        adapter = module.from_config(rest, at)  # type: ignore[attr-defined]
        if hasattr(adapter, "bind_models"):
            adapter.bind_models(list(models))  # an adapter whose files are per name
        out.append(Entry(adapter, tuple(models)))
    return out


def adapters_for(entries: Sequence[Entry], name: str) -> List[Adapter]:
    return [e.adapter for e in entries if e.serves(name)]
