"""``DeviceRun``: one targeted device of a rollout as the controller sees it (its state, the
job it runs, what was sent and cleared); the ``Rollout`` state machine keeps one per device and
``agent.fleet.rollouts.durable`` saves its ``RUN_FIELDS``.
"""

import json
from typing import Any, Dict, List, Mapping, Optional

from agent.wire import protocol

PENDING = "PENDING"  # controller side: the device's stage has not started yet
# DeviceRun fields that persist (agent.fleet.rollouts.durable stores them as JSON per device).
RUN_FIELDS = ("phase", "job_id", "job_stage", "progress", "result", "error", "search",
              "sent_layers", "versions", "published", "note", "local", "started", "finished",
              "seen", "docs", "kinds", "share")
# The fields a finished run seldom needs again, held as one compact JSON text once it is saved
# (``freeze``): a service keeps every device of its rollouts, and 50,000 finished devices held
# these as dicts at about 1.5 KiB each (0.5 KiB frozen). Read again (a late status, a report),
# they come back.
FROZEN_FIELDS = ("progress", "result", "error", "search", "sent_layers", "versions",
                 "published", "seen", "docs", "kinds", "share")
_EMPTY = {"sent_layers": dict, "versions": dict, "published": list, "seen": dict, "docs": dict,
          "kinds": dict, "share": dict}  # the other frozen fields are None when empty


class DeviceRun(object):
    """One targeted device as the controller sees it (slots: a service holds one per device
    of its rollouts, 50,000 in a large stage)."""

    __slots__ = ("device", "stage", "state", "_frozen") + RUN_FIELDS

    # The frozen fields (documented here; a new run starts frozen and empty: a stage's devices
    # not sent yet cost no containers).
    progress: Optional[Dict[str, int]]
    result: Optional[Dict[str, Any]]
    error: Optional[Dict[str, Any]]
    search: Optional[Dict[str, Any]]  # the search job's result
    sent_layers: Dict[str, str]  # layers the deploy job keeps above its precision
    versions: Dict[str, int]
    published: List[str]  # retained job documents not cleared yet
    # Statuses of our job ids retained from an earlier run of the same id, seen before the
    # job was sent: the device will treat the job as a duplicate and keep that state.
    seen: Dict[str, Dict[str, Any]]
    docs: Dict[str, Dict[str, Any]]  # job id -> the document sent (republish)
    kinds: Dict[str, str]  # job id -> kind sent
    share: Dict[str, Any]  # engine sharing: role, class (transfer.sharing)

    def __init__(self, device: str, stage: int) -> None:
        self._frozen: Optional[bytes] = b"{}"
        self.device = device
        self.stage = stage
        self.state = PENDING
        self.phase = ""  # the kind of the job now running: "search" or "deploy"
        self.job_id = ""
        self.job_stage = ""  # the device's stage (downloading, building, ...)
        self.note = ""  # what the controller did to this device, and why
        self.local = False  # the state was set by the controller, not reported
        self.started: Optional[float] = None
        self.finished: Optional[float] = None

    def to_dict(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in RUN_FIELDS}

    def load(self, state: str, data: Mapping[str, Any]) -> None:
        self.state = state
        for k in RUN_FIELDS:
            if k in data:
                setattr(self, k, data[k])

    @property
    def terminal(self) -> bool:
        return protocol.is_terminal(self.state)

    def freeze(self) -> None:
        """Hold ``FROZEN_FIELDS`` as one JSON text (what a saved, finished run keeps); the
        first read of any of them restores them all (``__getattr__``)."""
        if self._frozen is not None:
            if not any(_is_set(self, k) for k in FROZEN_FIELDS):
                return  # frozen already
            self._thaw()  # some were set since (``load``): the text and they, as one
        kept = {k: getattr(self, k) for k in FROZEN_FIELDS}
        self._frozen = json.dumps(
            {k: v for k, v in kept.items() if v is not None and not (k in _EMPTY and not v)},
            separators=(",", ":"), default=str).encode()  # as the database would keep them
        for k in FROZEN_FIELDS:
            delattr(self, k)

    def _thaw(self) -> None:
        data = json.loads(self._frozen or b"{}")
        self._frozen = None
        for k in FROZEN_FIELDS:
            if not _is_set(self, k):  # a field set since the freeze is newer than the text
                setattr(self, k, data[k] if k in data else
                        _EMPTY[k]() if k in _EMPTY else None)

    def __getattr__(self, name: str) -> Any:
        # Called only for an unset slot: a frozen field.
        if name not in FROZEN_FIELDS or self._frozen is None:
            raise AttributeError(name)
        self._thaw()
        return getattr(self, name)


def _is_set(run: DeviceRun, name: str) -> bool:
    try:
        object.__getattribute__(run, name)
        return True
    except AttributeError:
        return False
