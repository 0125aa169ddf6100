"""``DeviceRun``: one targeted device of a rollout as the controller sees it (its state, the
job it runs, what was sent and cleared); the ``Rollout`` state machine keeps one per device and
``agent.fleet.rollouts.durable`` saves its ``RUN_FIELDS``.
"""

from typing import Any, Dict, List, Mapping, Optional

from agent.wire import protocol

PENDING = "PENDING"  # controller side: the device's stage has not started yet
# DeviceRun fields that persist (agent.fleet.rollouts.durable stores them as JSON per device).
RUN_FIELDS = ("phase", "job_id", "job_stage", "progress", "result", "error", "search",
              "sent_layers", "versions", "published", "note", "local", "started", "finished",
              "seen", "docs", "kinds", "share")


class DeviceRun(object):
    """One targeted device as the controller sees it (slots: a service holds one per device
    of its rollouts, 50,000 in a large stage)."""

    __slots__ = ("device", "stage", "state") + RUN_FIELDS

    def __init__(self, device: str, stage: int) -> None:
        self.device = device
        self.stage = stage
        self.state = PENDING
        self.phase = ""  # the kind of the job now running: "search" or "deploy"
        self.job_id = ""
        self.job_stage = ""  # the device's stage (downloading, building, ...)
        self.progress: Optional[Dict[str, int]] = None
        self.result: Optional[Dict[str, Any]] = None
        self.error: Optional[Dict[str, Any]] = None
        self.search: Optional[Dict[str, Any]] = None  # the search job's result
        self.sent_layers: Dict[str, str] = {}  # layers the deploy job keeps above its precision
        self.versions: Dict[str, int] = {}
        self.published: List[str] = []  # retained job documents not cleared yet
        self.note = ""  # what the controller did to this device, and why
        self.local = False  # the state was set by the controller, not reported
        self.started: Optional[float] = None
        self.finished: Optional[float] = None
        # Statuses of our job ids retained from an earlier run of the same id, seen before
        # the job was sent: the device will treat the job as a duplicate and keep that state.
        self.seen: Dict[str, Dict[str, Any]] = {}
        self.docs: Dict[str, Dict[str, Any]] = {}  # job id -> the document sent (republish)
        self.kinds: Dict[str, str] = {}  # job id -> kind sent
        self.share: Dict[str, Any] = {}  # engine sharing: role, class (transfer.sharing)

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
