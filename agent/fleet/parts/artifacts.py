"""``ArtifactServing``: the artifacts of the rollouts held here, served in blocks over MQTT
(``agent.wire.block_server``; fan-out rounds for large ones) and offered over HTTP
(``--http``: artifacts of at least ``http_min_bytes`` at ``http_base/artifacts/SHA``). Blocks
are answered only while this process may act on its own account (not held up, not sitting a
lease out): a device asks again.
"""

import logging
import os
from typing import Any, Dict, Optional, Sequence

from agent.errors import AgentError
from agent.fleet.database import leases
from agent.fleet.rollouts.rollout import Action
from agent.wire import fanout_rounds
from agent.wire.topics import TopicInfo

log = logging.getLogger("agent.fleet")


class ArtifactServing(object):
    def __init__(self, store: Any, conn: Any, lease_book: leases.LeaseBook,
                 stats: Dict[str, int], http_base: Optional[str] = None,
                 http_min_bytes: int = 0) -> None:
        from agent.wire.block_server import BlockServer

        self.store = store
        self.conn = conn
        self.leases = lease_book
        self.stats = stats
        self.server = BlockServer(self.publish_block, conn.topics)
        self.http_base = http_base.rstrip("/") if http_base else None
        self.http_min_bytes = int(http_min_bytes)
        # The registry's blob store (agent.fleet.database.blobs): the directory the database
        # names; None: looked up there when a registry blob is first served.
        self.blob_root: Optional[str] = None

    def publish_block(self, topic: str, payload: bytes, qos: int = 1,
                      retain: bool = False) -> None:
        if not self.leases.may_act():  # held up past its deadline, or sitting a lease out
            self.stats["blocks_fenced"] += 1
            return
        self.stats["blocks"] += 1
        self.conn.client.publish(topic, payload, qos=qos, retain=retain)

    def on_request(self, info: TopicInfo, msg: Any) -> None:
        if not self.leases.may_act():  # held up, or sitting a lease out: the device asks again
            self.stats["blocks_fenced"] += 1
            return
        try:
            self.server.handle_request(msg.topic, msg.payload)
        except AgentError as exc:
            log.debug("block request from %s not answered: %s", info.device, exc)

    def poll(self) -> Optional[float]:
        """Fan-out rounds that came (agent.wire.fanout_rounds); when the next one is due."""
        if self.leases.may_act():
            self.server.poll()
        return self.server.next_due()

    def expect(self, actions: Sequence[Action]) -> None:
        """A large artifact's first fan-out round waits a moment for the devices sent it."""
        for a in actions:
            if a.kind == "publish" and a.doc:
                for ref in (a.doc.get("artifacts") or {}).values():
                    if isinstance(ref, dict) and int(ref.get("size") or 0) >= \
                            fanout_rounds.HOLD_BYTES:
                        self.server.expect(str(ref.get("sha256")), a.device)
                        if isinstance(ref.get("blocks"), dict):
                            self.server.expect(str(ref["blocks"].get("sha256")), a.device)

    def serve_rollout(self, rollout_id: str, spec: Dict[str, Any]) -> None:
        """The artifacts a rollout's spec names (and their block lists), served from now on."""
        stored = self.store.artifacts()
        for ref in spec.get("artifacts", {}).values():
            for sha in [ref["sha256"]] + ([ref["blocks"]["sha256"]] if ref.get("blocks")
                                          else []):
                try:
                    self.server.add_file(self.artifact_path(sha, stored), sha)
                except AgentError as exc:
                    if exc.code == "artifact_unavailable":
                        self.server.remove(sha)  # served earlier, damaged since: no more
                    log.error("rollout %s: artifact %s cannot be served: %s", rollout_id, sha,
                              exc.message)

    def artifact_path(self, sha: str, stored: Dict[str, Dict[str, Any]]) -> str:
        """Where an artifact's bytes are: a registry blob, verified (hashed once per process
        and again when its file changed; AgentError artifact_unavailable, never served, when
        it fails), else the file a rollout recorded."""
        from agent.fleet.database import blobs

        # Hashed in full when first served; afterwards again only when its file changed.
        path = blobs.servable(self.store, self.blob_root, sha,
                              full=sha not in self.server.files())
        if path is not None:
            return path
        if sha not in stored:
            raise AgentError("unknown_artifact", "not in the artifacts table")
        return str(stored[sha]["path"])

    def serve_all(self) -> None:
        """Serve every artifact in the database, not only those of our own rollouts: with a
        shared subscription a request may reach any instance (the store is shared)."""
        from agent.fleet.database import blobs

        served = self.server.files()
        for sha, art in self.store.artifacts().items():
            if sha not in served and os.path.isfile(art["path"]):
                try:
                    self.server.add_file(art["path"], sha)
                except AgentError as exc:
                    log.warning("artifact %s cannot be served: %s", sha, exc.message)
        for sha, row in blobs.rows(self.store).items():  # the registry's, when sound
            if sha not in served and not row["problem"] and self.blob_root is not None:
                try:
                    path = blobs.servable(self.store, self.blob_root, sha, full=True)
                    if path is not None:
                        self.server.add_file(path, sha)
                except AgentError as exc:
                    log.warning("%s", exc.message)

    def url_for(self, ref: Dict[str, Any]) -> Optional[str]:
        if self.http_base is None or int(ref.get("size") or 0) < self.http_min_bytes:
            return None
        return "{}/artifacts/{}".format(self.http_base, ref["sha256"])
