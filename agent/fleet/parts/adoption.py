"""``Adoption``: which rollouts this process drives. Each tick its leases are renewed and free
or expired ones taken (``agent.fleet.database.leases``; an instance found held up past its
deadline sits a lease out); a rollout taken is loaded from the database (``durable.load``), its
artifacts served, what a killed predecessor still owed the broker sent, the devices' retained
statuses of its jobs read, and it goes on where it was (or starts). A rollout another instance
holds now is let go.
"""

import logging
import time
from typing import Any, Callable, Dict, Optional, Sequence

from agent.errors import AgentError
from agent.fleet.database import leases
from agent.fleet.rollouts import durable
from agent.fleet.rollouts.rollout import Rollout
from agent.wire.topics import TopicInfo

log = logging.getLogger("agent.fleet")


class Adoption(object):
    def __init__(self, store: Any, conn: Any, lease_book: leases.LeaseBook,
                 stats: Dict[str, int], instance: str, lease_s: float,
                 only: Optional[Sequence[str]], signer: Any, driver: Any, publisher: Any,
                 artifacts: Any, sharing: Any, features_of: Callable[[str], frozenset],
                 on_message: Callable[[TopicInfo, Any], None]) -> None:
        self.store = store
        self.conn = conn
        self.topics = conn.topics
        self.leases = lease_book
        self.stats = stats
        self.instance = instance
        self.lease_s = lease_s
        self.only = set(only) if only is not None else None
        self.signer = signer
        self.driver = driver  # parts.rollout_driver.RolloutDriver: the rollouts held
        self.publisher = publisher  # parts.outbox.Publisher
        self.artifacts = artifacts  # parts.artifacts.ArtifactServing
        self.sharing = sharing  # parts.engine_sharing.EngineSharing
        self.features_of = features_of
        self.on_message = on_message
        self.quiet = False  # sitting out a lease after being held up (leases.LeaseBook)
        self.last_claim = 0.0
        self.last_new_check = 0.0
        self.newest_seen: Optional[float] = None  # the newest rollout's "created" seen

    def new_rollout(self, poll_s: float) -> bool:
        """True when a rollout was created since the last look (at most every ``poll_s``):
        the tick that claims it comes now."""
        now = time.monotonic()
        if now - self.last_new_check < poll_s:
            return False
        self.last_new_check = now
        newest = self.store.newest_rollout_created()
        if newest is None or (self.newest_seen is not None and newest <= self.newest_seen):
            return False
        self.newest_seen = newest
        return True

    def tick(self) -> None:
        """Leases renewed and taken; rollouts held elsewhere now let go, those taken adopted."""
        rollouts = self.driver.rollouts
        adopted = dict(self.leases.epochs)
        mine = self.claim()
        if self.publisher.resend_finished and self.leases.may_act():
            self.publisher.send_finished()
        for rid in list(rollouts):
            if mine.get(rid) != adopted.get(rid):  # taken over (and maybe back) since
                if not rollouts[rid].done:
                    log.warning("rollout %s: let go by %s: another instance holds its lease now",
                                rid, self.instance)
                self.driver.drop(rid)
        for rid in mine:
            if rid not in rollouts:
                if time.monotonic() - self.last_claim > self.lease_s / 3.0:
                    mine = self.claim()  # adopting takes a while: the others' leases go on
                    if rid not in mine:
                        continue
                try:
                    self.adopt(rid)
                except AgentError as exc:
                    log.error("rollout %s cannot be driven: %s", rid, exc)

    def claim(self) -> Dict[str, int]:
        """Renew this process's leases, take free and expired ones (agent.fleet.database.leases)."""
        began = time.monotonic()
        mine = leases.claim(self.store.db, self.instance, self.leases.holder, self.lease_s,
                            self.only)
        generation = self.leases.generation
        self.leases.claimed(mine, began)
        if self.leases.generation != generation:
            self.quiet = True
            log.warning("%s: held up %.1f s past its deadline (stopped, paused or starved): "
                        "what it queued before is not sent, and it answers no block requests "
                        "for %.0f s (generation %d)", self.instance, self.leases.held_up_s,
                        self.lease_s, self.leases.generation)
        elif self.quiet and self.leases.may_act():
            self.quiet = False
            log.info("%s: acting on its own account again (generation %d; %d block request(s) "
                     "and %d message(s) queued in the MQTT client dropped so far)",
                     self.instance, self.leases.generation, self.stats["blocks_fenced"],
                     self.stats["dropped"])
        self.last_claim = began
        return mine

    def adopt(self, rollout_id: str) -> None:
        ro = durable.load(self.store, rollout_id, durable.factory_for(
            self.store, rollout_id, self.signer, self.artifacts.url_for,
            self.sharing.offer_url(rollout_id), self.features_of))
        if ro is None:
            return
        self.sharing.give_policy(ro)
        row = self.store.rollout(rollout_id) or {}
        self.artifacts.serve_rollout(rollout_id, row.get("spec") or {})
        self.driver.hold(ro)
        # What a killed predecessor still owed the broker, then every unfinished document.
        owed = self.store.outbox([rollout_id])
        if owed and not self.publisher.may_publish(rollout_id, len(owed)):
            return
        key = self.leases.key(rollout_id)
        for oid, topic, payload, retain in owed:
            self.publisher.send([oid], [(topic, payload, retain)], key)
        self._read_statuses(ro, bool(owed))
        actions = ro.start() if ro.current < 0 else []
        more = durable.republish(self.topics, ro) if not actions else []
        for run in ro.ordered():  # adopted answers of an earlier run: cleared as any other
            if run.terminal and run.note.startswith("the device had already run job"):
                more.append((self.topics.job_status(run.device, run.job_id), b"", True))
        self.publisher.commit(ro, actions, more=more)
        if not self.driver.holds(rollout_id):
            return  # its lease went while it was being taken (the commit said so)
        log.info("rollout %s: taken over by %s (stage %d/%d)", rollout_id, self.instance,
                 ro.current + 1, len(ro.stages))

    def _read_statuses(self, ro: Rollout, owed: bool) -> None:
        """The devices' retained statuses of this rollout's jobs, now that it is known here:
        answers that came while no service was running. Before anything was sent, statuses
        retained from an earlier run of this id (the devices would ignore the documents as
        duplicates), which are adopted."""
        filters = [self.topics.prefix + "/devices/+/jobs/{}/status".format(j)
                   for j in ro.job_ids]
        self.conn.subscribe(filters)
        ids = set(ro.job_ids)  # other traffic does not hold the wait up
        # Retained statuses follow the SUBACK at once; a rollout never started only has some
        # if its id was used before the database was (an earlier run): a short quiet suffices.
        self.conn.settle(self.on_message, quiet=0.3 if ro.current >= 0 or owed else 0.1,
                         limit=5.0, counted=lambda info: info.kind == "job_status" and
                         info.job_id in ids)
        for f in filters:
            self.conn.client.unsubscribe(f)
        if ro.current < 0:
            self.driver.forget_pending(ro.rollout_id)  # nothing was sent: seen statuses only
        else:
            self.driver.commit_pending()
