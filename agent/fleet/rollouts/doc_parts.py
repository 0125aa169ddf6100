"""Job documents held in memory share their common parts: the documents of one rollout differ
by device (and signature), while their ``artifacts``, ``plan``, ``gate``, ``bench`` and
``search`` are mostly equal. ``Parts.share`` returns the document with each such part
replaced by one shared copy of equal content (a rollout keeps one document per device until
it is cleared: at 50,000 devices the copies were most of the service's memory). The parts are
never mutated after the document is built (they are encoded, saved and signed copies).
"""

import json
from typing import Any, Dict, Mapping

SHARED = ("artifacts", "plan", "gate", "bench", "search", "fallback")
MAX_PARTS = 256  # distinct parts kept; beyond, documents keep their own copies


class Parts(object):
    def __init__(self) -> None:
        self._parts: Dict[str, Any] = {}

    def share(self, doc: Mapping[str, Any]) -> Dict[str, Any]:
        out = dict(doc)
        for key in SHARED:
            value = out.get(key)
            if not isinstance(value, (dict, list)):
                continue
            text = key + json.dumps(value, sort_keys=True, separators=(",", ":"))
            shared = self._parts.get(text)
            if shared is None:
                if len(self._parts) >= MAX_PARTS:
                    continue
                self._parts[text] = shared = value
            out[key] = shared
        return out
