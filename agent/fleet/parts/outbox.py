"""``Publisher``: what the rollouts decide, saved with its messages in one transaction
(``durable.save``) under this process's lease and epoch, then published with the lease's fence
key; outbox rows deleted once the broker acknowledged them (PUBACKs pipelined, never awaited
one by one). Past a lease's deadline nothing is published and the rollout is let go: its
messages stay in the outbox for whichever instance holds it next.
"""

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from agent.fleet.database import leases
from agent.fleet.rollouts import durable
from agent.fleet.rollouts.rollout import Action, Rollout

log = logging.getLogger("agent.fleet")


class Publisher(object):
    def __init__(self, store: Any, conn: Any, lease_book: leases.LeaseBook,
                 stats: Dict[str, int], instance: str, holds: Callable[[str], bool],
                 let_go: Callable[[str], None],
                 sent_actions: Callable[[Sequence[Action]], None]) -> None:
        self.store = store
        self.conn = conn
        self.topics = conn.topics
        self.leases = lease_book
        self.stats = stats
        self.instance = instance
        self.holds = holds  # is this rollout driven here
        self.let_go = let_go  # drop a rollout (its lease went)
        self.sent_actions = sent_actions  # published actions (large artifacts wait for them)
        # (publish handle, outbox id, fence key: agent.fleet.database.leases.Key)
        self.unacked: List[Tuple[Any, int, leases.Key]] = []
        self.resend_finished = False  # finished rollouts' messages the gate dropped
        self.on_change: Optional[Callable[[Rollout], None]] = None  # progress views

    def send(self, ids: Sequence[int], msgs: Sequence[durable.Message],
             key: Optional[leases.Key] = None) -> None:
        key = key or self.leases.key()
        for oid, (topic, payload, retain) in zip(ids, msgs):
            handle = self.conn.client.publish(topic, payload, qos=1, retain=retain, fence=key)
            self.unacked.append((handle, oid, key))
            if payload and "/jobs/" in topic and not topic.endswith("/status"):
                self.stats["job_docs"] += 1

    def collect_acks(self, full: bool = True) -> None:
        """Outbox rows of what the broker acknowledged. ``full`` False: only the acknowledged
        head of the list (PUBACKs come in order; called each step while a stage streams),
        True: every handle (each tick, and at the end)."""
        if not self.leases.may_act():
            return  # held up past its deadline, or sitting a lease out: deleted later, fenced
        if not full:
            n = 0
            while n < len(self.unacked) and self.unacked[n][0].acked:
                n += 1
            if n < 256:
                return  # a few: the next call, or the tick's full pass, takes them
            head, self.unacked = self.unacked[:n], self.unacked[n:]
        else:
            head, self.unacked = self.unacked, []
        done = [(oid, key) for h, oid, key in head if h.acked and h.ok]
        failed = [(h, oid) for h, oid, _k in head if h.acked and not h.ok]
        self.unacked = [e for e in head if not e[0].acked] + self.unacked
        if done:  # each only where its rollout is still ours at that epoch (or finished)
            self.store.outbox_done(done, self.leases.holder)
        if failed:  # refused, or not sent: stays in the outbox for the next start
            log.warning("%d message(s) not taken by the broker (first: %s, %s); kept in the "
                        "outbox", len(failed), failed[0][0].topic, failed[0][0].reason)

    def commit(self, ro: Rollout, actions: Sequence[Action] = (),
               extra: Optional[Dict[str, Any]] = None,
               more: Sequence[durable.Message] = ()) -> None:
        msgs = durable.messages(self.topics, ro, actions) + list(more)
        rid = ro.rollout_id
        began = time.monotonic()
        try:  # written only under this process's lease and epoch (agent.fleet.database.leases)
            ids = durable.save(self.store, ro, msgs, extra, fence=self.leases.fence(rid))
        except leases.LeaseLost as exc:
            self.lost(rid, "{}: nothing written, {} message(s) not published".format(
                exc, len(msgs)), fenced=True)
            return
        self.leases.renewed(rid, began)
        if ro.done:
            self.leases.finish(rid)
        if not self.may_publish(rid, len(msgs)):
            return
        self.send(ids, msgs, self.leases.key(rid))
        self.sent_actions(actions)
        if self.on_change is not None:
            self.on_change(ro)

    def may_publish(self, rollout_id: str, count: int) -> bool:
        """False (and the rollout let go) past the lease's publishing deadline: this process
        was stopped long enough that another instance may hold the rollout now."""
        if self.leases.may_publish(rollout_id):
            return True
        self.stats["suppressed"] += count
        self.lost(rollout_id, "past its lease's deadline (this process was held up): {} "
                  "message(s) not published; it stays in the outbox".format(count))
        return False

    def lost(self, rollout_id: str, why: str, fenced: bool = False) -> None:
        if fenced:
            self.stats["fenced"] += 1
        log.warning("rollout %s: let go by %s: %s", rollout_id, self.instance, why)
        self.let_go(rollout_id)
        self.leases.forget(rollout_id)
        # Its messages not yet acknowledged stay in the outbox: the holder sends them again.
        self.unacked = [e for e in self.unacked if e[2][0] != rollout_id]

    def gate_dropped(self) -> None:
        """Messages the MQTT client's gate dropped (their lease's deadline passed before
        they were written): their rollouts are let go, taken again from the database if the
        lease is still this process's."""
        for key, n in self.conn.client.take_fenced().items():
            self.stats["dropped"] += n
            rid = key[0]
            if self.holds(rid):
                self.lost(rid, "past its lease's deadline (this process was held up): {} "
                          "message(s) queued in the MQTT client dropped; they stay in the "
                          "outbox".format(n))
            else:  # a finished rollout's last messages, or the instance's own (blocks)
                self.resend_finished = True
                log.warning("%s: past its deadline (this process was held up): %d message(s) "
                            "queued in the MQTT client dropped", self.instance, n)

    def send_finished(self) -> None:
        """What the outbox still owes for finished rollouts (not already on its way)."""
        self.resend_finished = False
        sent = {oid for _h, oid, _k in self.unacked}
        for oid, topic, payload, retain in self.store.outbox_of_finished():
            if oid not in sent:
                self.send([oid], [(topic, payload, retain)])
