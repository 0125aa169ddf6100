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

The service is a few parts (``agent.fleet.parts``), each handed what it uses when it is made,
wired in one place (``assemble``). A rollout passes through them in this order:

    created, leased, taken on   ``adoption.Adoption``  (leases claimed; the rollout loaded,
                                its artifacts served, the devices' retained statuses read)
    documents out               ``rollout_driver.RolloutDriver``  (streamed a batch at a time)
                                -> ``outbox.Publisher``  (saved, fenced, PUBACK-acked)
    artifacts                   ``artifacts.ArtifactServing``  (blocks over MQTT, HTTP offers;
                                ``engine_sharing.EngineSharing``: builders' engines)
    MQTT message in             ``intake.Intake``  routes it by its topic's kind
    statuses                    ``RolloutDriver``  (batched, decided, committed);
                                ``rereading.Rereader``  (those that never came, read again)

beside them ``registry.DeviceRegistry`` (births, models messages, telemetry into the database),
``admission.AdmissionPart`` (the admission gate, the roll call, births acknowledged) and
``deployments.DeploymentsHook`` (desired state, told what changed). A part reaches another
through a callable it was given, never through the service. ``FleetService`` is the main loop:
``step`` (documents out, events in, commits, acknowledgements) and the periodic ``tick``.
"""

import logging
import os
import socket
import time
from typing import Any, Callable, NamedTuple, Optional, Sequence, Set

from agent.errors import AgentError
from agent.fleet.database import instance_name, leases
from agent.fleet.database.store import Store
from agent.fleet.mqtt_edge import FleetConnection
from agent.fleet.parts.admission import AdmissionPart
from agent.fleet.parts.adoption import Adoption
from agent.fleet.parts.artifacts import ArtifactServing
from agent.fleet.parts.deployments import DeploymentsHook
from agent.fleet.parts.engine_sharing import EngineSharing
from agent.fleet.parts.intake import Intake
from agent.fleet.parts.outbox import Publisher
from agent.fleet.parts.registry import DeviceRegistry
from agent.fleet.parts.rereading import Rereader
from agent.fleet.parts.rollout_driver import RolloutDriver
from agent.fleet.rollouts import durable, streaming
from agent.fleet.rollouts.rollout import Rollout

log = logging.getLogger("agent.fleet")

# Another instance takes a rollout over this long after its owner went silent (the database's
# clock; agent.fleet.database.leases); a restart under the same name takes its own back at once.
LEASE_S = 6.0
TICK_S = 0.5  # how often leases, controls, deadlines and the registry are looked at
# How often the newest rollout's creation time is read (one indexed row): a new rollout is
# taken at once (the next tick early), not up to TICK_S later.
NEW_ROLLOUT_POLL_S = 0.1


class Parts(NamedTuple):
    """What ``assemble`` wired: the main loop routes events and ticks to these."""

    intake: Intake
    registry: DeviceRegistry
    admission: AdmissionPart
    publisher: Publisher
    artifacts: ArtifactServing
    sharing: EngineSharing
    driver: RolloutDriver
    adoption: Adoption
    rereader: Rereader
    deployments: DeploymentsHook


def assemble(store: Store, conn: FleetConnection, signer: Any, instance: str,
             lease_book: leases.LeaseBook, stats: Any, only: Optional[Sequence[str]],
             share_group: Optional[str], lease_s: float, http_base: Optional[str],
             http_min_bytes: int, admission: Any) -> Parts:
    """Wire the parts: first where every decision goes out (the outbox, the artifacts), then
    what the devices say (registry, admission), then the rollouts. Where a part is built
    further down, a lambda looks it up when it is called."""
    deployments = DeploymentsHook(store)
    artifacts = ArtifactServing(store, conn, lease_book, stats, http_base, http_min_bytes)
    publisher = Publisher(store, conn, lease_book, stats, instance,
                          holds=lambda rid: driver.holds(rid),
                          let_go=lambda rid: driver.drop(rid), sent_actions=artifacts.expect)
    admitting = AdmissionPart(store, conn, stats, instance, admission)

    def devices_saved(saved: Any) -> None:
        deployments.touch(saved)
        admitting.ack_births()  # the registry holds them now

    registry = DeviceRegistry(store, conn, stats, admitting.owe_ack, devices_saved,
                              deployments.touch)
    sharing = EngineSharing(store, admission, registry.engine_class_of,
                            lambda: artifacts.http_base)
    rereader = Rereader(conn, stats)
    driver = RolloutDriver(store, conn.topics, stats, publisher.commit,
                           backlog=lambda: len(publisher.unacked),
                           take_offers=sharing.take_offers, job_ended=deployments.job_ended,
                           dropped=(sharing.revoke, rereader.forget), heard=rereader.heard)
    intake = Intake(conn, share_group, {
        "artifact_request": [artifacts.on_request],
        "status": [admitting.heard_status, registry.on_status],
        "models": [registry.on_models],
        "command_reply": [deployments.on_command_reply],
        "telemetry": [registry.on_telemetry_message],
        "job_status": [driver.on_job_status],
    })
    adoption = Adoption(store, conn, lease_book, stats, instance, lease_s, only, signer,
                        driver, publisher, artifacts, sharing, registry.features_of,
                        intake.on_message)
    return Parts(intake, registry, admitting, publisher, artifacts, sharing, driver, adoption,
                 rereader, deployments)


def _part(part: str, attr: str) -> Any:
    """An attribute of a part, read and set through the service (``fleet serve`` sets some
    after the service is made: sharing, the HTTP base, the deployment runner...)."""
    return property(lambda self: getattr(getattr(self.parts, part), attr),
                    lambda self, value: setattr(getattr(self.parts, part), attr, value))


class FleetService(object):
    """The main loop over the parts ``assemble`` wired (its attributes below reach them)."""

    rollouts = _part("driver", "rollouts")
    server = _part("artifacts", "server")
    http_base = _part("artifacts", "http_base")
    blob_root = _part("artifacts", "blob_root")
    sharing = _part("sharing", "board")
    share_wait_s = _part("sharing", "wait_s")
    share_quorum = _part("sharing", "quorum")
    share_builders = _part("sharing", "builders")
    designated_builders = _part("sharing", "designated")
    deployments = _part("deployments", "runner")
    on_change = _part("publisher", "on_change")
    on_telemetry = _part("registry", "on_telemetry")
    roll_call_every_s = _part("admission", "roll_call_every_s")

    def __init__(self, store: Store, conn: FleetConnection, signer: Any = None,
                 instance: Optional[str] = None, only: Optional[Sequence[str]] = None,
                 share_group: Optional[str] = None, lease_s: float = LEASE_S,
                 http_base: Optional[str] = None, http_min_bytes: int = 0,
                 admission: Any = None) -> None:
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
        self.share_group = share_group
        self.admission = admission  # (agent.fleet.admission.admission; its counters)
        self.stats = {"job_docs": 0, "statuses": 0, "refused": 0, "blocks": 0,
                      "telemetry_capped": 0, "telemetry_keys_dropped": 0, "fenced": 0,
                      "suppressed": 0, "reread": 0, "blocks_fenced": 0, "dropped": 0}
        self.parts = assemble(store, conn, signer, self.instance, self.leases, self.stats,
                              only, share_group, lease_s, http_base, http_min_bytes, admission)
        self.last_tick = 0.0

    # -- what callers use ---------------------------------------------------------------------

    def subscribe(self) -> None:
        self.parts.intake.subscribe()

    def on_message(self, info: Any, msg: Any) -> None:
        self.parts.intake.on_message(info, msg)

    def commit(self, ro: Rollout, actions: Sequence[Any] = (), extra: Any = None,
               more: Sequence[durable.Message] = ()) -> None:
        self.parts.publisher.commit(ro, actions, extra, more)

    def features_of(self, device: str) -> frozenset:
        return self.parts.registry.features_of(device)

    def builder_key(self, device: str) -> Any:
        """(pinned key, engine class) of a builder, for its engine upload (HTTP thread)."""
        return self.parts.sharing.builder_key(device)

    def flush_devices(self) -> None:
        """What devices said, into the database now (else at the next tick)."""
        self.parts.registry.flush()

    _flush_devices = flush_devices  # (its name before the parts)

    def finished(self, rollout_id: str) -> bool:
        row = self.store.rollout_states([rollout_id]).get(rollout_id)
        return row is None or row["state"] not in ("running", "paused")

    # -- the loop -----------------------------------------------------------------------------

    def step(self, timeout: float = 0.2) -> None:
        """Send the next documents owed, handle what arrived for up to ``timeout`` s (a short
        while when documents are still owed; a bounded batch of events), commit what it
        changed, then the periodic work."""
        p = self.parts
        unsent = p.driver.stream()
        due = p.artifacts.poll()
        # (A quota spent on unanswered documents comes back with the statuses pump reads.)
        wait = streaming.pump_timeout(unsent, streaming.doc_quota(len(p.publisher.unacked)),
                                      timeout)
        if due is not None:
            wait = max(0.0, min(wait, due - time.monotonic()))
        wait = min(wait, NEW_ROLLOUT_POLL_S)
        # What came is handled (a bounded batch) before more documents are built: statuses
        # that wait hold memory and delay the rollout's end.
        self.conn.pump(self.on_message, wait, max_events=streaming.MAX_EVENTS, drain=True,
                       drain_s=streaming.DRAIN_S)
        p.publisher.gate_dropped()
        p.driver.commit_pending()
        tick = time.monotonic() - self.last_tick >= TICK_S or \
            p.adoption.new_rollout(NEW_ROLLOUT_POLL_S)
        p.publisher.collect_acks(full=tick)
        if tick:
            self.last_tick = time.monotonic()
            self.tick()

    def tick(self) -> None:
        """The periodic work, in order: the roll call and admission, the service's heartbeat,
        the registry written, artifacts (a shared subscription serves them all), deployments,
        leases and rollouts taken, engines that came, each rollout's owed decisions, control
        and deadline, statuses read again."""
        p = self.parts
        now = time.time()
        p.admission.tick()
        self.store.heartbeat(self.instance, os.getpid(), socket.gethostname(), self.started,
                             self.boot_id)
        p.registry.flush()
        if self.share_group is not None:
            p.artifacts.serve_all()
        p.deployments.tick()
        p.adoption.tick()
        p.sharing.take_offers(p.driver.rollouts)
        p.driver.tick(now)
        p.rereader.due(p.driver.rollouts)

    _tick = tick  # (its name before the parts)

    def start(self) -> None:
        p = self.parts
        p.adoption.newest_seen = self.store.newest_rollout_created()
        boots = p.admission.prepare()
        self.subscribe()
        p.admission.roll_call(boots, self.on_message)
        p.driver.commit_pending()
        p.registry.flush()
        p.publisher.send_finished()
        self.last_tick = time.monotonic()
        self.tick()

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until the broker acknowledged everything published (at exit)."""
        p = self.parts
        deadline = time.monotonic() + timeout
        while p.publisher.unacked and time.monotonic() < deadline:
            self.conn.pump(self.on_message, 0.05)
            p.driver.commit_pending()
            p.publisher.collect_acks()
        p.registry.flush()
        return not p.publisher.unacked

    def run(self, should_stop: Callable[[], bool]) -> None:
        self.start()
        while not should_stop():
            self.step()
        self.drain()
        self.store.release(self.instance)


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
