"""``FleetService``: the controller as a long-running service (``jetson-agent fleet serve``),
and the same loop run embedded by ``fleet rollout`` for one rollout.

One thread owns everything: it drains the MQTT events (paho's thread only enqueues, into a
byte-bounded queue that never blocks it), keeps the device registry in the database, feeds job
statuses to the rollouts it holds a lease on, serves artifact blocks, and publishes what the
rollouts decide. Every decision is saved with the messages it publishes in one transaction
(``durable.save``); messages leave the outbox when the broker acknowledges them (PUBACKs are
pipelined, never awaited one by one). Killed at any point and started again, the service takes
its rollouts back from the database, publishes what the outbox still holds and the documents of
unfinished jobs again, and reads the devices' retained statuses: every rollout goes on where it
was.
"""

import logging
import os
import socket
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from agent.errors import AgentError
from agent.fleet.admission import bounds
from agent.fleet.database import device_models, instance_name, leases
from agent.fleet.database.store import Store
from agent.fleet.deployments import deployment_runner, pins
from agent.fleet.mqtt_edge import FleetConnection
from agent.fleet.rollouts import durable, rollback_log, streaming
from agent.fleet.rollouts.reread import Reread
from agent.fleet.rollouts.rollout import Rollout
from agent.wire import fanout_rounds, protocol, rollcall
from agent.wire.topics import TopicInfo

log = logging.getLogger("agent.fleet")

# Another instance takes a rollout over this long after its owner went silent (the database's
# clock; agent.fleet.database.leases); a restart under the same name takes its own back at once.
LEASE_S = 6.0
TICK_S = 0.5  # how often leases, controls, deadlines and the registry are looked at
# How often the newest rollout's creation time is read (one indexed row): a new rollout is
# taken at once (the next tick early), not up to TICK_S later.
NEW_ROLLOUT_POLL_S = 0.1
# The roll call (agent.fleet.admission.rollcall): at start, every ROLL_CALL_EVERY_S, and
# BURST_QUIET_S after a burst of at least BURST_BIRTHS new devices (births the broker's queue may
# have cut).
ROLL_CALL_EVERY_S = 600.0
JOB_REREAD_EVERY_S = 1.0  # a round of job statuses read again (agent.fleet.rollouts.reread)
BURST_BIRTHS = 100
BURST_QUIET_S = 2.0
REREAD_EVERY_S = 30.0


class FleetService(object):
    def __init__(self, store: Store, conn: FleetConnection, signer: Any = None,
                 instance: Optional[str] = None, only: Optional[Sequence[str]] = None,
                 share_group: Optional[str] = None, lease_s: float = LEASE_S,
                 http_base: Optional[str] = None, http_min_bytes: int = 0,
                 admission: Any = None) -> None:
        from agent.wire.block_server import BlockServer

        self.store = store
        self.conn = conn
        self.topics = conn.topics
        self.signer = signer
        if signer is not None:  # the file's numbers stay a floor; the database hands them out
            signer.sequence = durable.DbSequence(store, mirror=signer.sequence)
        self.started = time.time()
        self.lease_s = lease_s
        # A stable name (agent.fleet.database.instance_name), taken only from a dead predecessor.
        self.instance = instance_name.register(store, instance,
                                               instance_name.stale_after(lease_s), self.started)
        self.boot_id = instance_name.boot_id()
        self.leases = leases.LeaseBook(leases.holder_token(self.instance), lease_s)
        # Every message is checked against its lease again on the MQTT client's thread, just
        # before it is written (messages queued there when this process was held up).
        if conn.client is not None and not conn.client.set_gate(self.leases.may_send,
                                                                self.leases.key):
            log.warning("this paho-mqtt's queues cannot be reached: messages already handed to "
                        "the MQTT client are not checked against the lease again")
        self.resend_finished = False  # finished rollouts' messages the gate dropped
        self.quiet = False  # sitting out a lease after being held up (leases.LeaseBook)
        self.last_claim = 0.0
        self.only = set(only) if only is not None else None
        self.share_group = share_group
        self.rollouts: Dict[str, Rollout] = {}
        self.by_job: Dict[str, str] = {}  # job id -> rollout id
        self.server = BlockServer(self._publish_block, self.topics)
        # (publish handle, outbox id, fence key: agent.fleet.database.leases.Key)
        self.unacked: List[Tuple[Any, int, leases.Key]] = []
        # Documents streamed whose devices have not answered yet (the statuses waiting to be
        # read are the service's backlog: beyond a bound, no more documents are built).
        self.unanswered = streaming.Unanswered()
        self.evaluated: Dict[str, float] = {}  # rollout -> when its decisions were last made
        self.devices_dirty: Dict[str, Dict[str, Any]] = {}
        self.models_dirty: Dict[str, Dict[str, Any]] = {}  # device -> its models message
        self.features: Dict[str, frozenset] = {}  # device -> its last status's features
        self._interned: Dict[Any, Any] = {}  # feature sets and engine classes, held once
        self.telemetry_dirty: Dict[str, Dict[str, Any]] = {}
        # device -> telemetry message, at each flush (agent.fleet.database.history keeps the series)
        self.on_telemetry: Optional[Callable[[Dict[str, Dict[str, Any]]], None]] = None
        self.last_tick = 0.0
        self.last_new_check = 0.0
        self.newest_seen: Optional[float] = None  # the newest rollout's "created" seen
        # Artifacts of at least http_min_bytes are also offered at http_base/artifacts/SHA.
        self.http_base = http_base.rstrip("/") if http_base else None
        self.http_min_bytes = int(http_min_bytes)
        self.on_change: Optional[Callable[[Rollout], None]] = None  # progress views
        # rollout id -> (actions, messages) from statuses not yet committed
        self.pending: Dict[str, Tuple[List[Any], List[durable.Message]]] = {}
        self.stats = {"job_docs": 0, "statuses": 0, "refused": 0, "blocks": 0,
                      "telemetry_capped": 0, "telemetry_keys_dropped": 0, "fenced": 0,
                      "suppressed": 0, "reread": 0, "blocks_fenced": 0, "dropped": 0}
        # Jobs whose status never came: their retained statuses are read again.
        self.reread = Reread()
        self.reread_filters: List[str] = []
        self.last_reread = 0.0
        # Engine sharing (fleet serve --share-engines): an agent.fleet.transfer.sharing.ShareBoard
        self.sharing: Any = None
        self.share_wait_s = 900.0
        self.share_builders: frozenset = frozenset()  # fleet serve --builders
        self.designated_builders: frozenset = frozenset()
        self.revoked_engines: set = set()  # fleet engines revoke: never handed out again
        self.revocations_read = 0.0
        self.share_quorum = 1  # fleet serve --share-quorum
        self.roll_call_every_s = ROLL_CALL_EVERY_S
        self.last_roll_call = 0.0
        self.new_births = 0  # devices first heard since the last roll call
        self.heard = 0  # (the directory's first_heard when last looked at)
        self.rereads_dropped = 0  # (FleetConnection.rereads_dropped) when the last one began
        self.last_birth = 0.0
        # Births to acknowledge once the registry holds them (devices that said they wait for
        # it: agent.wire.rollcall.ACK_FEATURE): device -> boot. The call (token, window) is
        # published at start: devices answer it at their slot of the window.
        self.acks_owed: Dict[str, int] = {}
        self.call: Optional[Tuple[str, float]] = None
        self.stats["birth_acks"] = 0
        # Device admission (agent.fleet.admission.admission): the gate every device message passes.
        self.admission = admission
        self.engine_classes: Dict[str, Any] = {}  # device -> its platform.engine_class
        self.resubscribed: Dict[str, float] = {}  # device -> when its retained topics were asked
        self.last_counters = 0.0
        if admission is not None:
            conn.gate = admission.check
            conn.admitted = lambda device: (admission.rows.get(device) or {}).get(
                "state") in ("admitted", "legacy")  # the event queue's per-source budgets
            admission.on_admitted = self._admitted
        # Deployments (fleet serve): an agent.fleet.deployments.deployment_runner.DeploymentRunner,
        # told of births, Wills, models messages and its jobs' ends; ticked before leases are taken.
        self.deployments: Any = None
        # The registry's blob store (agent.fleet.database.blobs): the directory the database
        # names; None: looked up there when a registry blob is first served.
        self.blob_root: Optional[str] = None

    # -- publishing ---------------------------------------------------------------------------

    def _publish_block(self, topic: str, payload: bytes, qos: int = 1,
                       retain: bool = False) -> None:
        if not self.leases.may_act():  # held up past its deadline, or sitting a lease out
            self.stats["blocks_fenced"] += 1
            return
        self.stats["blocks"] += 1
        self.conn.client.publish(topic, payload, qos=qos, retain=retain)

    def _send(self, ids: Sequence[int], msgs: Sequence[durable.Message],
              key: Optional[leases.Key] = None) -> None:
        key = key or self.leases.key()
        for oid, (topic, payload, retain) in zip(ids, msgs):
            handle = self.conn.client.publish(topic, payload, qos=1, retain=retain, fence=key)
            self.unacked.append((handle, oid, key))
            if payload and "/jobs/" in topic and not topic.endswith("/status"):
                self.stats["job_docs"] += 1

    def _collect_acks(self, full: bool = True) -> None:
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

    def commit(self, ro: Rollout, actions: Sequence[Any] = (),
               extra: Optional[Dict[str, Any]] = None,
               more: Sequence[durable.Message] = ()) -> None:
        msgs = durable.messages(self.topics, ro, actions) + list(more)
        rid = ro.rollout_id
        began = time.monotonic()
        try:  # written only under this process's lease and epoch (agent.fleet.database.leases)
            ids = durable.save(self.store, ro, msgs, extra, fence=self.leases.fence(rid))
        except leases.LeaseLost as exc:
            self._lost(rid, "{}: nothing written, {} message(s) not published".format(
                exc, len(msgs)), fenced=True)
            return
        self.leases.renewed(rid, began)
        if ro.done:
            self.leases.finish(rid)
        if not self._may_publish(rid, len(msgs)):
            return
        self._send(ids, msgs, self.leases.key(rid))
        for a in actions:  # a large artifact's first fan-out round waits a moment for them
            if a.kind == "publish" and a.doc:
                for ref in (a.doc.get("artifacts") or {}).values():
                    if isinstance(ref, dict) and int(ref.get("size") or 0) >= \
                            fanout_rounds.HOLD_BYTES:
                        self.server.expect(str(ref.get("sha256")), a.device)
                        if isinstance(ref.get("blocks"), dict):
                            self.server.expect(str(ref["blocks"].get("sha256")), a.device)
        if self.on_change is not None:
            self.on_change(ro)

    def _may_publish(self, rollout_id: str, count: int) -> bool:
        """False (and the rollout let go) past the lease's publishing deadline: this process
        was stopped long enough that another instance may hold the rollout now."""
        if self.leases.may_publish(rollout_id):
            return True
        self.stats["suppressed"] += count
        self._lost(rollout_id, "past its lease's deadline (this process was held up): {} "
                   "message(s) not published; it stays in the outbox".format(count))
        return False

    def _lost(self, rollout_id: str, why: str, fenced: bool = False) -> None:
        if fenced:
            self.stats["fenced"] += 1
        log.warning("rollout %s: let go by %s: %s", rollout_id, self.instance, why)
        self._drop(rollout_id)
        self.leases.forget(rollout_id)
        # Its messages not yet acknowledged stay in the outbox: the holder sends them again.
        self.unacked = [e for e in self.unacked if e[2][0] != rollout_id]

    def _gate_dropped(self) -> None:
        """Messages the MQTT client's gate dropped (their lease's deadline passed before
        they were written): their rollouts are let go, taken again from the database if the
        lease is still this process's."""
        for key, n in self.conn.client.take_fenced().items():
            self.stats["dropped"] += n
            rid = key[0]
            if rid in self.rollouts:
                self._lost(rid, "past its lease's deadline (this process was held up): {} "
                           "message(s) queued in the MQTT client dropped; they stay in the "
                           "outbox".format(n))
            else:  # a finished rollout's last messages, or the instance's own (blocks)
                self.resend_finished = True
                log.warning("%s: past its deadline (this process was held up): %d message(s) "
                            "queued in the MQTT client dropped", self.instance, n)

    # -- rollouts -----------------------------------------------------------------------------

    def _adopt(self, rollout_id: str) -> None:
        ro = durable.load(self.store, rollout_id, durable.factory_for(
            self.store, rollout_id, self.signer, self._url_for,
            self._offer_url(rollout_id) if self.sharing is not None else None,
            self.features_of))
        if ro is None:
            return
        if self.sharing is not None and ro.search_id is None:
            from agent.fleet.transfer.sharing import (
                SharePolicy,
                designated_builders,
                device_class,
            )

            statuses = self.store.statuses()
            from agent.fleet.deployments import labels

            builders = designated_builders(ro.runs, self.share_builders,
                                           labels.assigned(self.store, list(ro.runs)))
            self.designated_builders |= builders  # whose uploads the board takes
            self.revoked_engines = set(self.store.engine_revocations())
            ro.sharing = SharePolicy({d: device_class(statuses.get(d)) for d in ro.runs},
                                     self.share_wait_s, builders,
                                     revoked=lambda sha: sha in self.revoked_engines,
                                     quorum=self.share_quorum)
        row = self.store.rollout(rollout_id) or {}
        stored = self.store.artifacts()
        for ref in (row.get("spec") or {}).get("artifacts", {}).values():
            for sha in [ref["sha256"]] + ([ref["blocks"]["sha256"]] if ref.get("blocks")
                                          else []):
                try:
                    self.server.add_file(self._artifact_path(sha, stored), sha)
                except AgentError as exc:
                    if exc.code == "artifact_unavailable":
                        self.server.remove(sha)  # served earlier, damaged since: no more
                    log.error("rollout %s: artifact %s cannot be served: %s", rollout_id, sha,
                              exc.message)
        self.rollouts[rollout_id] = ro
        for job_id in ro.job_ids:
            self.by_job[job_id] = rollout_id
        # What a killed predecessor still owed the broker, then every unfinished document.
        owed = self.store.outbox([rollout_id])
        if owed and not self._may_publish(rollout_id, len(owed)):
            return
        key = self.leases.key(rollout_id)
        for oid, topic, payload, retain in owed:
            self._send([oid], [(topic, payload, retain)], key)
        # The devices' retained statuses of this rollout's jobs, now that it is known here:
        # answers that came while no service was running. Before anything was sent, statuses
        # retained from an earlier run of this id (the devices would ignore the documents as
        # duplicates), which are adopted.
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
            self.pending.pop(rollout_id, None)  # nothing was sent: seen statuses only
        else:
            self._commit_pending()
        actions = ro.start() if ro.current < 0 else []
        more = durable.republish(self.topics, ro) if not actions else []
        for run in ro.ordered():  # adopted answers of an earlier run: cleared as any other
            if run.terminal and run.note.startswith("the device had already run job"):
                more.append((self.topics.job_status(run.device, run.job_id), b"", True))
        self.commit(ro, actions, more=more)
        if rollout_id not in self.rollouts:
            return  # its lease went while it was being taken (the commit said so)
        log.info("rollout %s: taken over by %s (stage %d/%d)", rollout_id, self.instance,
                 ro.current + 1, len(ro.stages))

    def _artifact_path(self, sha: str, stored: Dict[str, Dict[str, Any]]) -> str:
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

    def features_of(self, device: str) -> frozenset:
        """What the device's last status says it understands (named models, ...): the
        statuses heard since the start, over those in the database."""
        if device in self.features:
            return self.features[device]
        # Not heard since the start: the database's row, this device's only (not every
        # device's status at once: 50,000 statuses are hundreds of MiB while they are read).
        row = self.store.device(device) or {}
        fs = device_models.features(row.get("status") or None)
        fs = self._interned.setdefault(fs, fs)
        self.features[device] = fs
        return fs

    def _url_for(self, ref: Dict[str, Any]) -> Optional[str]:
        if self.http_base is None or int(ref.get("size") or 0) < self.http_min_bytes:
            return None
        return "{}/artifacts/{}".format(self.http_base, ref["sha256"])

    def _offer_url(self, rollout_id: str) -> Callable[[str], Optional[str]]:
        def url(device: str) -> Optional[str]:
            if self.http_base is None or self.sharing is None:
                return None
            return "{}/shares/{}".format(self.http_base,
                                         self.sharing.token(rollout_id, device))
        return url

    def _take_offers(self) -> None:
        """Engines builders uploaded (HTTP thread) -> their rollouts."""
        if self.sharing is None:
            return
        if time.monotonic() - self.revocations_read >= 5.0:  # fleet engines revoke, anywhere
            self.revocations_read = time.monotonic()
            self.revoked_engines = set(self.store.engine_revocations())
        for rid, device, ref in self.sharing.arrived():
            ro = self.rollouts.get(rid)
            if ro is not None:
                ro.engine_offered(device, ref)

    def builder_key(self, device: str) -> Optional[Tuple[bytes, Any]]:
        """(pinned key, engine class) of a builder, for its engine upload (HTTP thread)."""
        import base64

        row = (self.admission.rows.get(device) if self.admission is not None else None) or {}
        if row.get("state") != "admitted" or not row.get("public_key"):
            return None
        return base64.b64decode(str(row["public_key"])), self.engine_classes.get(device)

    def _drop(self, rollout_id: str) -> None:
        if self.sharing is not None:
            self.sharing.revoke(rollout_id)  # its upload URLs end with it
        ro = self.rollouts.pop(rollout_id, None)
        self.evaluated.pop(rollout_id, None)
        self.reread.forget(rollout_id)
        if ro is not None:
            for job_id in ro.job_ids:
                self.by_job.pop(job_id, None)

    def _serve_all(self) -> None:
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

    def _roll_call_due(self) -> None:
        """Start a roll call in the background (``pump`` carries it on) when one is due."""
        mono = time.monotonic()
        burst = self.new_births >= BURST_BIRTHS and mono - self.last_birth >= BURST_QUIET_S
        # Retained births left at the broker (agent.fleet.transfer.bytequeue): read again, at
        # most every REREAD_EVERY_S (a roll call's own pages may be cut the same way).
        dropped = self.conn.rereads_dropped() - self.rereads_dropped \
            if mono - self.last_roll_call >= REREAD_EVERY_S else 0
        if self.conn.rollcall is None and (
                burst or dropped or mono - self.last_roll_call >= self.roll_call_every_s):
            if burst:
                log.info("%d devices appeared since the last roll call: taking one",
                         self.new_births)
            if dropped:
                log.info("%d retained births or models messages were left at the broker (the "
                         "event queue was full of them): a roll call reads them", dropped)
            self.new_births = 0
            self.rereads_dropped += dropped
            self.last_roll_call = mono
            self.conn.begin_roll_call()

    def _admitted(self, device: str) -> None:
        """A device admitted in another process (fleet devices accept): its retained status
        and models messages again, now that they pass the gate."""
        for topic in (self.topics.status(device), self.topics.models(device)):
            self.conn.client.subscribe(topic, 1)
        self.resubscribed[device] = time.monotonic()

    def _admission_tick(self) -> None:
        if self.admission is None:
            return
        self.admission.refresh()
        for device, since in list(self.resubscribed.items()):
            if time.monotonic() - since > 5.0:
                for topic in (self.topics.status(device), self.topics.models(device)):
                    self.conn.client.unsubscribe(topic)
                del self.resubscribed[device]
        if time.monotonic() - self.last_counters >= 5.0:
            self.last_counters = time.monotonic()
            self.store.put_admission_counters(self.instance, self.admission.stats())

    def _tick(self) -> None:
        now = time.time()
        self._roll_call_due()
        self._admission_tick()
        self.store.heartbeat(self.instance, os.getpid(), socket.gethostname(), self.started,
                             self.boot_id)
        self._flush_devices()
        if self.share_group is not None:
            self._serve_all()
        if self.deployments is not None:
            try:
                self.deployments.tick()
            except AgentError as exc:
                log.error("deployments: %s", exc)
        adopted = dict(self.leases.epochs)
        mine = self._claim()
        if self.resend_finished and self.leases.may_act():
            self._send_finished()
        for rid in list(self.rollouts):
            if mine.get(rid) != adopted.get(rid):  # taken over (and maybe back) since
                if not self.rollouts[rid].done:
                    log.warning("rollout %s: let go by %s: another instance holds its lease now",
                                rid, self.instance)
                self._drop(rid)
        for rid in mine:
            if rid not in self.rollouts:
                if time.monotonic() - self.last_claim > self.lease_s / 3.0:
                    mine = self._claim()  # adopting takes a while: the others' leases go on
                    if rid not in mine:
                        continue
                try:
                    self._adopt(rid)
                except AgentError as exc:
                    log.error("rollout %s cannot be driven: %s", rid, exc)
        self._take_offers()
        rows = self.store.rollout_states(self.rollouts)  # control and deadline: a few columns
        for rid, ro in list(self.rollouts.items()):
            if ro.pending_eval:  # decisions the last batches left owed
                self.commit(ro, self._evaluate(ro, force=True))
            if rid not in self.rollouts:
                continue  # its lease went (the commit said so)
            if ro.sharing is not None:  # waits that timed out; engines that came
                actions = ro.release_waiting()
                if actions or ro.dirty:
                    self.commit(ro, actions)
            row = rows.get(rid) or {}
            control = row.get("control")
            if control:
                self._control(ro, control)
            elif not ro.done and row.get("deadline") and now >= row["deadline"]:
                self.commit(ro, ro.expire("the rollout did not finish by its deadline ({:.0f} s"
                                          " after it was created)".format(
                                              row["deadline"] - row["created"])))
            if ro.done:
                self._drop(rid)
        self._reread_due()

    def _reread_due(self) -> None:
        """Ask the broker again for the retained statuses of jobs unchanged for a while (their
        status may have been dropped by the broker's queue on its way here), a bounded round
        every JOB_REREAD_EVERY_S s, or at the next tick once the last one was answered (the
        queue has room again); the last round's exact subscriptions end first."""
        mono = time.monotonic()
        if mono - self.last_reread < JOB_REREAD_EVERY_S and not (
                self.reread_filters and self.reread.answered()):
            return  # (the last round answered: the next goes at this tick)
        self.last_reread = mono
        for f in self.reread_filters:
            self.conn.client.unsubscribe(f)
        self.reread_filters = []
        for rid, ro in list(self.rollouts.items()):
            if ro.unsent:
                self.reread.sending(rid, mono)
            room = min(self.reread.room(rid, mono),
                       self.reread.batch - len(self.reread_filters))
            if ro.done or room <= 0:
                continue
            due = self.reread.due(rid, ro.runs.values(), mono, room)
            if not due:
                continue
            quiet = self.reread.quiet(rid, mono)
            log.warning("rollout %s: %d job(s) with no new status for %.0f s or more%s: "
                        "reading the devices' retained statuses again (attempt %d of at most "
                        "%d; the broker's queue may have dropped them)", rid, len(due),
                        self.reread.wait(quiet, 0), ", the rollout quiet for {:.0f} s".format(
                            self.reread.quiet_s) if quiet else "",
                        max(a for _d, _j, a in due), self.reread.attempts)
            self.stats["reread"] += len(due)
            for device, job_id, _attempt in due:
                self.reread_filters.append(self.topics.job_status(device, job_id))
        if self.reread_filters:
            self.conn.subscribe(self.reread_filters)

    def _claim(self) -> Dict[str, int]:
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

    def _control(self, ro: Rollout, control: str) -> None:
        if control == "pause":
            actions = ro.set_paused(True)
        elif control == "resume":
            actions = ro.set_paused(False)
        else:
            actions = ro.expire("cancelled by the operator (fleet rollouts cancel)",
                                state="CANCELED", outcome="cancelled")
        log.info("rollout %s: %s", ro.rollout_id, control)
        self.commit(ro, actions, extra={"control": None})

    def _flush_devices(self) -> None:
        if self.devices_dirty:
            self.store.upsert_devices(self.devices_dirty)
            if self.deployments is not None:
                self.deployments.touch(self.devices_dirty)
            self.devices_dirty = {}
            self._ack_births()
        if self.models_dirty:
            # Devices born again with a lower boot (re-imaged): their new message replaces
            # the old image's whatever its boot.
            directory = getattr(self.conn, "directory", None)
            reset = sorted(set(directory.reimaged) & set(self.models_dirty)) \
                if directory is not None else []
            device_models.save(self.store, self.models_dirty, reset=reset)
            if directory is not None:
                directory.reimaged.difference_update(reset)
            if self.deployments is not None:
                self.deployments.touch(self.models_dirty)
            self.models_dirty = {}
        if self.telemetry_dirty:
            self.store.touch_devices(self.telemetry_dirty)
            if self.on_telemetry is not None:
                self.on_telemetry(self.telemetry_dirty)
            self.telemetry_dirty = {}

    def _ack_births(self) -> None:
        """The births the registry now holds, acknowledged (QoS 1, not retained): their
        devices stop publishing them again (agent.device.birth_pacing)."""
        owed, self.acks_owed = self.acks_owed, {}
        token, window = self.call if self.call is not None else (None, rollcall.MIN_WINDOW_S)
        # (The window a device keeps for its next retries: sized to the fleet known so far,
        # which grows during a first start's roll call.)
        window = max(window, rollcall.window_for(len(self.conn.directory.status)))
        prefix = self.topics.prefix
        for device, boot in owed.items():
            self.conn.client.publish(rollcall.ack_topic(prefix, device),
                                     rollcall.encode_ack(device, boot, token, window), qos=1)
        self.stats["birth_acks"] += len(owed)

    def _call(self, devices: int) -> None:
        """The retained call: devices acknowledged under another call (before this start)
        answer it, each at its slot of a window sized to the fleet, so the broker's queue
        never holds more answers than it takes."""
        assert self.call is not None
        self.call = (self.call[0], rollcall.window_for(devices))
        self.conn.client.publish(rollcall.call_topic(self.topics.prefix),
                                 rollcall.encode_call(*self.call), qos=1, retain=True)

    # -- messages -----------------------------------------------------------------------------

    def subscribe(self) -> None:
        self.conn.subscribe([f for f, q in self.topics.controller_subscriptions(
            self.share_group) if q == 1])
        self.conn.subscribe([self.topics.prefix + "/devices/+/telemetry"], 0)

    def on_message(self, info: TopicInfo, msg: Any) -> None:
        if info.kind == "artifact_request":
            if not self.leases.may_act():  # held up, or sitting a lease out: the device asks again
                self.stats["blocks_fenced"] += 1
                return
            try:
                self.server.handle_request(msg.topic, msg.payload)
            except AgentError as exc:
                log.debug("block request from %s not answered: %s", info.device, exc)
        elif info.kind == "status":
            # Devices the directory did not hold (a restarted service holds its registry's:
            # their answers to its call are no burst of new devices).
            heard = self.conn.directory.first_heard
            if heard != self.heard:
                self.new_births += heard - self.heard
                self.heard = heard
                self.last_birth = time.monotonic()
            self.devices_dirty[info.device] = msg
            if msg.get("platform") is not None:  # a Will has none: the last birth's stand
                # One frozenset (and string) per distinct value, not one per device.
                fs = device_models.features(msg)
                if msg.get("online") is True and rollcall.ACK_FEATURE in fs:
                    self.acks_owed[info.device] = msg["boot"]
                self.features[info.device] = self._interned.setdefault(fs, fs)
                cls = msg["platform"].get("engine_class")
                self.engine_classes[info.device] = self._interned.setdefault(cls, cls) \
                    if isinstance(cls, str) and len(self._interned) < 4096 else cls
            if len(self.devices_dirty) >= streaming.MAX_DIRTY:
                self._flush_devices()  # a burst of births (start-up): bounded batches
        elif info.kind == "models":
            self.models_dirty[info.device] = msg
            if len(self.models_dirty) >= streaming.MAX_DIRTY:
                self._flush_devices()
        elif info.kind == "command_reply":
            if msg.get("command") in (None, "rollback"):  # recorded by rollback_log, if ours
                if rollback_log.on_reply(self.store, info.device, msg):  # its first reply
                    pins.on_rollback_reply(self.store, info.device, msg)  # its pin's version
        elif info.kind == "telemetry":
            msg, dropped = bounds.cap_telemetry(msg)
            if dropped:
                self._telemetry_dropped(info.device, dropped)
            self.telemetry_dirty[info.device] = msg
        elif info.kind == "job_status":
            self._job_status(info.device, msg)

    def _telemetry_dropped(self, device: str, dropped: int) -> None:
        self.stats["telemetry_keys_dropped"] = self.stats.get("telemetry_keys_dropped", 0) + \
            dropped
        self.stats["telemetry_capped"] = self.stats.get("telemetry_capped", 0) + 1
        n = self.stats["telemetry_capped"]
        if n in (1, 10, 100) or n % 1000 == 0:
            log.warning("telemetry of %s: %d metric(s) dropped (at most %d numeric metrics a "
                        "device, keys of at most %d characters; %d telemetry messages capped, "
                        "%d metrics dropped so far)", device, dropped, bounds.MAX_TELEMETRY_KEYS,
                        bounds.MAX_KEY_CHARS, n, self.stats["telemetry_keys_dropped"])

    def _job_status(self, device: str, msg: Dict[str, Any]) -> None:
        self.stats["statuses"] += 1
        self.unanswered.answered(device, str(msg.get("job_id")))
        self._take_offers()  # a builder's upload ends before its SUCCEEDED status is sent
        rid = self.by_job.get(str(msg.get("job_id")))
        ro = self.rollouts.get(rid) if rid else None
        if ro is None or device not in ro.runs:
            return
        run = ro.runs[device]
        self.reread.heard(ro.rollout_id, device, time.monotonic())
        refused = ro.refused
        actions, more = self.pending.setdefault(ro.rollout_id, ([], []))
        actions += ro.on_job_status(device, msg, evaluate=False)
        self.stats["refused"] += ro.refused - refused
        if self.deployments is not None:
            deployment_runner.job_ended(self.deployments, rid, device, msg)
        if protocol.is_terminal(str(msg.get("state"))) and msg.get("job_id") in run.kinds:
            # The database has it now: the broker need not keep the device's last word.
            more.append((self.topics.job_status(device, str(msg["job_id"])), b"", True))

    def _evaluate(self, ro: Rollout, force: bool = False) -> List[Any]:
        """The stage and abort decisions owed, at most every EVALUATE_EVERY_S per rollout (they
        look at every device: once per batch of statuses was 7 % of a 50,000-device stage's
        CPU); the tick takes what is still owed (``force``)."""
        now = time.monotonic()
        if not ro.pending_eval or not force and now - self.evaluated.get(ro.rollout_id, 0.0) < \
                streaming.EVALUATE_EVERY_S:
            return []
        self.evaluated[ro.rollout_id] = now
        return ro.evaluate()

    def _commit_pending(self) -> None:
        """One transaction per rollout for everything a batch of statuses changed."""
        pending, self.pending = self.pending, {}
        for rid, (actions, more) in pending.items():
            ro = self.rollouts.get(rid)
            if ro is None:
                continue
            actions += self._evaluate(ro)
            if actions or more or ro.dirty or ro.history:
                self.commit(ro, actions, more=more)

    # -- the loop -----------------------------------------------------------------------------

    def _stream(self) -> int:
        """The next batch of each streaming stage's documents (agent.fleet.rollouts.streaming):
        built, saved in one transaction, published, as many as the broker's acknowledgements
        and the devices' answers allow. Returns the documents still owed."""
        now = time.monotonic()
        quota = min(streaming.doc_quota(len(self.unacked)), self.unanswered.quota(now))
        owed = [ro for ro in self.rollouts.values() if ro.unsent]
        for i, ro in enumerate(owed):
            n = streaming.split(quota, ro.unsent, len(owed) - i - 1)
            if n <= 0:
                break
            actions = ro.more(n)
            for a in actions:
                if a.kind == "publish":
                    quota -= 1
                    self.unanswered.sent(a.device, a.job_id, now)
            actions += self._evaluate(ro)
            self.commit(ro, actions)
        return sum(ro.unsent for ro in owed)

    def step(self, timeout: float = 0.2) -> None:
        """Send the next documents owed, handle what arrived for up to ``timeout`` s (a short
        while when documents are still owed; a bounded batch of events), commit what it
        changed, then the periodic work."""
        unsent = self._stream()
        if self.leases.may_act():
            self.server.poll()  # fan-out rounds that came (agent.wire.fanout_rounds)
        due = self.server.next_due()
        # (A quota spent on unanswered documents comes back with the statuses pump reads.)
        wait = streaming.pump_timeout(unsent, streaming.doc_quota(len(self.unacked)), timeout)
        if due is not None:
            wait = max(0.0, min(wait, due - time.monotonic()))
        wait = min(wait, NEW_ROLLOUT_POLL_S)
        # What came is handled (a bounded batch) before more documents are built: statuses
        # that wait hold memory and delay the rollout's end.
        self.conn.pump(self.on_message, wait, max_events=streaming.MAX_EVENTS, drain=True,
                       drain_s=streaming.DRAIN_S)
        self._gate_dropped()
        self._commit_pending()
        tick = time.monotonic() - self.last_tick >= TICK_S or self._new_rollout()
        self._collect_acks(full=tick)
        if tick:
            self.last_tick = time.monotonic()
            self._tick()

    def _new_rollout(self) -> bool:
        """True when a rollout was created since the last look (at most every
        NEW_ROLLOUT_POLL_S): the tick that claims it comes now."""
        now = time.monotonic()
        if now - self.last_new_check < NEW_ROLLOUT_POLL_S:
            return False
        self.last_new_check = now
        newest = self.store.newest_rollout_created()
        if newest is None or (self.newest_seen is not None and newest <= self.newest_seen):
            return False
        self.newest_seen = newest
        return True

    def start(self) -> None:
        self.newest_seen = self.store.newest_rollout_created()
        boots = self.store.device_boots()
        directory = self.conn.directory
        if directory.compact:
            # The registry is in the database: the roll call reads the statuses of devices
            # born again (or never heard) since, not of all of them.
            for device, boot in boots.items():
                directory.status.setdefault(device, directory.boot_entry(boot))
        # This start's call: the births acknowledged from now on name it (their devices need
        # not answer it); it is published once the roll call is over.
        self.call = ("c" + os.urandom(8).hex(), rollcall.window_for(len(boots)))
        self.heard = directory.first_heard
        self.subscribe()
        self.conn.settle(self.on_message)  # retained statuses before the first decision
        last = self.conn.last_roll_call  # discover() may have taken one just now
        dropped = self.conn.rereads_dropped()
        if last is None or time.monotonic() - last.started > 60.0 or dropped:
            self.conn.roll_call(self.on_message)  # those the broker's queue left out
        self.rereads_dropped = dropped  # (any dropped during that roll call: the next one)
        # The call goes out once the roll call is over (it would compete with the answers for
        # the broker's queue), its window sized to the fleet it found.
        rc = self.conn.last_roll_call
        self._call(max(len(boots), len(self.conn.directory.status),
                       rc.stats["entries"] if rc is not None else 0))
        self.new_births = 0
        self.last_roll_call = time.monotonic()
        self._commit_pending()
        self._flush_devices()
        self._send_finished()
        self.last_tick = time.monotonic()
        self._tick()

    def _send_finished(self) -> None:
        """What the outbox still owes for finished rollouts (not already on its way)."""
        self.resend_finished = False
        sent = {oid for _h, oid, _k in self.unacked}
        for oid, topic, payload, retain in self.store.outbox_of_finished():
            if oid not in sent:
                self._send([oid], [(topic, payload, retain)])

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until the broker acknowledged everything published (at exit)."""
        deadline = time.monotonic() + timeout
        while self.unacked and time.monotonic() < deadline:
            self.conn.pump(self.on_message, 0.05)
            self._commit_pending()
            self._collect_acks()
        self._flush_devices()
        return not self.unacked

    def run(self, should_stop: Callable[[], bool]) -> None:
        self.start()
        while not should_stop():
            self.step()
        self.drain()
        self.store.release(self.instance)

    def finished(self, rollout_id: str) -> bool:
        row = self.store.rollout_states([rollout_id]).get(rollout_id)
        return row is None or row["state"] not in ("running", "paused")


def busy_check(store: Store, devices: Sequence[str], rollout_id: str) -> None:
    """AgentError device_busy when a target is in another unfinished rollout."""
    busy = store.busy_devices(devices, exclude=rollout_id)
    if busy:
        names = ", ".join("{} ({})".format(d, r) for d, r in sorted(busy.items())[:20])
        raise AgentError("device_busy", "{} device(s) are in another unfinished rollout: {}{}; "
                         "wait for it, or cancel it (fleet rollouts cancel ID)".format(
                             len(busy), names, " ..." if len(busy) > 20 else ""),
                         {"busy": dict(sorted(busy.items())[:100])})


def targets_known(store: Store) -> Set[str]:
    return {d["device"] for d in store.devices()}
