"""The hand-off interface: how a model version reaches the application that serves it (the
contract between the daemon's model switch and the adapters ``command``, ``triton`` and
``deepstream``). An adapter module defines a subclass of ``Adapter`` and ``from_config(section,
where)``; ``agent.device.handoff`` finds the module by the entry's ``type``.

Methods may block (up to the adapter's own timeout): the daemon runs them off its main thread
and posts the outcome back. Failures raise AgentError("handoff_failed", ...).
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

from agent.errors import AgentError


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: str
    path: str             # <models_dir>/<name>/<version>
    engine: str           # <path>/model.engine
    meta: Dict[str, Any]  # meta.json's content


class Adapter(object):
    """One configured hand-off entry."""

    kind = "..."  # "triton" | "deepstream" | "command"

    def prepare(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        """Write repository/config files; never touches what the app is serving now."""

    def switch(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        """The step that makes the app take ``new`` (Triton: load API; command: run it)."""

    def confirm(self, new: ModelVersion) -> Optional[bool]:
        """True = ready/healthy (commit), False = failed, None = no opinion (wait for the app
        or the probe)."""
        return None

    def commit(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        """``new`` is committed (the app confirmed it): drop what it displaced (Triton: version
        folders beyond keep_versions; a pending version never counts against them)."""

    def revert(self, previous: Optional[ModelVersion], failed: ModelVersion) -> None:
        """Hand the previous version back (or unload when there is none)."""

    def heal(self, committed: List[ModelVersion]) -> Dict[str, str]:
        """Called every few seconds while no switch runs, with the committed versions this
        adapter serves: hand back what the app lost (Triton restarted in explicit mode).
        {name: what was done}; bounded and quick when there is nothing to do."""
        return {}


def from_config(section: Mapping[str, Any], where: str) -> Adapter:  # pragma: no cover
    """Per adapter module: build the adapter of one ``handoff:`` entry; validates its own keys
    (AgentError bad_config naming ``where``.key)."""
    raise NotImplementedError


# -- what an engine's meta.json tells every adapter (pure) -----------------------------------

def engine_batch_max(meta: Mapping[str, Any]) -> Optional[int]:
    """The largest batch the engine's optimisation profile takes: the smallest profile max of
    the inputs' first dimension (None when meta.json has no profile)."""
    found: List[int] = []
    for profile in meta.get("profiles") or []:
        inputs = profile.get("inputs") if isinstance(profile, Mapping) else None
        for triple in (inputs or {}).values() if isinstance(inputs, Mapping) else []:
            hi = triple.get("max") if isinstance(triple, Mapping) else None
            if isinstance(hi, list) and hi and isinstance(hi[0], int):
                found.append(hi[0])
    return min(found) if found else None


def check_batch_size(new: ModelVersion, batch: int, key: str) -> None:
    """``batch_size_exceeds_profile`` when the app would send batches the engine's profile
    does not take (Triton refuses such a model at load; nvinfer fails at its first batch)."""
    most = engine_batch_max(new.meta)
    if most is not None and batch > most:
        raise AgentError(
            "batch_size_exceeds_profile",
            "{} {} for {}@{}: expected at most {}, the engine's profile maximum (first input "
            "dimension); rebuild with --shapes NAME:...,...,{}x... or lower {}".format(
                key, batch, new.name, new.version, most, batch, key),
            {"batch_size": batch, "profile_max": most})


def dla_core(meta: Mapping[str, Any]) -> Optional[int]:
    """The DLA core the engine was built for (meta.json's portability), None: the GPU."""
    core = (meta.get("portability") or {}).get("dla_core")
    return core if isinstance(core, int) and not isinstance(core, bool) and core >= 0 else None


def plugin_libraries(meta: Mapping[str, Any]) -> List[str]:
    """The TensorRT plugin libraries the engine needs (meta.json's ``plugins``)."""
    return [str(p["path"]) for p in meta.get("plugins") or []
            if isinstance(p, Mapping) and isinstance(p.get("path"), str) and p["path"]]
