"""``EngineSharing`` (``fleet serve --share-engines``): per device class one designated
builder builds the engine and uploads it over HTTP (``agent.fleet.transfer.sharing.ShareBoard``,
the ``board``); its class's other devices wait for it and adopt it. This part gives each rollout
taken on its ``SharePolicy``, hands the uploads that arrived to their rollouts, and checks a
builder's pinned key for its upload.
"""

import time
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from agent.fleet.rollouts.rollout import Rollout


class EngineSharing(object):
    def __init__(self, store: Any, admission: Any, engine_class_of: Callable[[str], Any],
                 http_base: Callable[[], Optional[str]]) -> None:
        self.store = store
        self.admission = admission  # agent.fleet.admission.admission (None: no admission)
        self.engine_class_of = engine_class_of
        self.http_base = http_base
        self.board: Any = None  # an agent.fleet.transfer.sharing.ShareBoard; None: no sharing
        self.wait_s = 900.0  # fleet serve --share-wait
        self.builders: frozenset = frozenset()  # fleet serve --builders
        self.designated: frozenset = frozenset()
        self.revoked: set = set()  # fleet engines revoke: never handed out again
        self.revocations_read = 0.0
        self.quorum = 1  # fleet serve --share-quorum

    def give_policy(self, ro: Rollout) -> None:
        """A rollout taken on (not a search): who builds for each class, who waits."""
        if self.board is None or ro.search_id is not None:
            return
        from agent.fleet.deployments import labels
        from agent.fleet.transfer.sharing import SharePolicy, designated_builders, device_class

        statuses = self.store.statuses()
        builders = designated_builders(ro.runs, self.builders,
                                       labels.assigned(self.store, list(ro.runs)))
        self.designated |= builders  # whose uploads the board takes
        self.revoked = set(self.store.engine_revocations())
        ro.sharing = SharePolicy({d: device_class(statuses.get(d)) for d in ro.runs},
                                 self.wait_s, builders,
                                 revoked=lambda sha: sha in self.revoked, quorum=self.quorum)

    def offer_url(self, rollout_id: str) -> Optional[Callable[[str], Optional[str]]]:
        """Where a builder of ``rollout_id`` uploads its engine (None without sharing)."""
        if self.board is None:
            return None

        def url(device: str) -> Optional[str]:
            base = self.http_base()
            if base is None or self.board is None:
                return None
            return "{}/shares/{}".format(base, self.board.token(rollout_id, device))
        return url

    def take_offers(self, rollouts: Mapping[str, Rollout]) -> None:
        """Engines builders uploaded (HTTP thread) -> their rollouts."""
        if self.board is None:
            return
        if time.monotonic() - self.revocations_read >= 5.0:  # fleet engines revoke, anywhere
            self.revocations_read = time.monotonic()
            self.revoked = set(self.store.engine_revocations())
        for rid, device, ref in self.board.arrived():
            ro = rollouts.get(rid)
            if ro is not None:
                ro.engine_offered(device, ref)

    def revoke(self, rollout_id: str) -> None:
        if self.board is not None:
            self.board.revoke(rollout_id)  # its upload URLs end with it

    def builder_key(self, device: str) -> Optional[Tuple[bytes, Any]]:
        """(pinned key, engine class) of a builder, for its engine upload (HTTP thread)."""
        import base64

        rows: Dict[str, Any] = self.admission.rows if self.admission is not None else {}
        row = rows.get(device) or {}
        if row.get("state") != "admitted" or not row.get("public_key"):
            return None
        return base64.b64decode(str(row["public_key"])), self.engine_class_of(device)
