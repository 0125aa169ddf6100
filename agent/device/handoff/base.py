"""The hand-off adapter interface (the seam between the daemon and each adapter type).

``ModelVersion`` names one version folder under models_dir; an ``Adapter`` hands it to the app
in four steps: ``prepare`` (write files, touch nothing being served), ``switch`` (the step that
makes the app take it), ``confirm`` (True ready, False failed, None no opinion) and ``revert``.
Methods may block up to the adapter's own timeout; errors are AgentError("handoff_failed").
"""

from dataclasses import dataclass
from typing import Any, Dict, Optional


@dataclass(frozen=True)
class ModelVersion:
    name: str
    version: str
    path: str             # <models_dir>/<name>/<version>
    engine: str           # <path>/model.engine
    meta: Dict[str, Any]  # meta.json's content


class Adapter:
    kind = "adapter"

    def prepare(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        raise NotImplementedError

    def switch(self, new: ModelVersion, previous: Optional[ModelVersion]) -> None:
        raise NotImplementedError

    def confirm(self, new: ModelVersion) -> Optional[bool]:
        raise NotImplementedError

    def revert(self, previous: Optional[ModelVersion], failed: ModelVersion) -> None:
        raise NotImplementedError
