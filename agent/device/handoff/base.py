"""The hand-off interface: how a model version reaches the application that serves it (the
contract between the daemon's model switch and the adapters ``command``, ``triton`` and
``deepstream``). An adapter module defines a subclass of ``Adapter`` and ``from_config(section,
where)``; ``agent.device.handoff`` finds the module by the entry's ``type``.

Methods may block (up to the adapter's own timeout): the daemon runs them off its main thread
and posts the outcome back. Failures raise AgentError("handoff_failed", ...).
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional


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
