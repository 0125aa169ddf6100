"""``AdmissionPart``: who is heard, and that every device is heard. The admission gate
(``agent.fleet.admission.admission``) every device message passes, refreshed each tick; a
device admitted elsewhere is asked for its retained messages again. The roll call
(``agent.fleet.admission.rollcall``): at start, every ``ROLL_CALL_EVERY_S``, and after a burst of
new devices or births the event queue left at the broker. Births of devices that wait for it
acknowledged once the registry holds them, under this start's call.
"""

import logging
import os
import time
from typing import Any, Callable, Dict, Optional, Tuple

from agent.wire import rollcall
from agent.wire.topics import TopicInfo

log = logging.getLogger("agent.fleet")

# The roll call: at start, every ROLL_CALL_EVERY_S, and BURST_QUIET_S after a burst of at least
# BURST_BIRTHS new devices (births the broker's queue may have cut).
ROLL_CALL_EVERY_S = 600.0
BURST_BIRTHS = 100
BURST_QUIET_S = 2.0
REREAD_EVERY_S = 30.0


class AdmissionPart(object):
    def __init__(self, store: Any, conn: Any, stats: Dict[str, int], instance: str,
                 admission: Any = None) -> None:
        self.store = store
        self.conn = conn
        self.topics = conn.topics
        self.stats = stats
        self.instance = instance
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
        self.resubscribed: Dict[str, float] = {}  # device -> when its retained topics were asked
        self.last_counters = 0.0
        if admission is not None:
            conn.gate = admission.check
            conn.admitted = lambda device: (admission.rows.get(device) or {}).get(
                "state") in ("admitted", "legacy")  # the event queue's per-source budgets
            admission.on_admitted = self.admitted

    # -- births -------------------------------------------------------------------------------

    def heard_status(self, info: TopicInfo, msg: Any) -> None:
        """Devices the directory did not hold (a restarted service holds its registry's:
        their answers to its call are no burst of new devices)."""
        heard = self.conn.directory.first_heard
        if heard != self.heard:
            self.new_births += heard - self.heard
            self.heard = heard
            self.last_birth = time.monotonic()

    def owe_ack(self, device: str, msg: Dict[str, Any], features: frozenset) -> None:
        if msg.get("online") is True and rollcall.ACK_FEATURE in features:
            self.acks_owed[device] = msg["boot"]

    def ack_births(self) -> None:
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

    # -- the roll call ------------------------------------------------------------------------

    def prepare(self) -> Dict[str, int]:
        """Before the subscriptions: the registry's devices known to the directory, this
        start's call drawn. Returns the registry's boots."""
        boots: Dict[str, int] = self.store.device_boots()
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
        return boots

    def roll_call(self, boots: Dict[str, int], on_message: Callable[[TopicInfo, Any], None]
                  ) -> None:
        """At start, once subscribed: the retained statuses, those the broker's queue left
        out, then the call."""
        self.conn.settle(on_message)  # retained statuses before the first decision
        last = self.conn.last_roll_call  # discover() may have taken one just now
        dropped = self.conn.rereads_dropped()
        if last is None or time.monotonic() - last.started > 60.0 or dropped:
            self.conn.roll_call(on_message)  # those the broker's queue left out
        self.rereads_dropped = dropped  # (any dropped during that roll call: the next one)
        # The call goes out once the roll call is over (it would compete with the answers for
        # the broker's queue), its window sized to the fleet it found.
        rc = self.conn.last_roll_call
        self._call(max(len(boots), len(self.conn.directory.status),
                       rc.stats["entries"] if rc is not None else 0))
        self.new_births = 0
        self.last_roll_call = time.monotonic()

    def roll_call_due(self) -> None:
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

    # -- admission ----------------------------------------------------------------------------

    def admitted(self, device: str) -> None:
        """A device admitted in another process (fleet devices accept): its retained status
        and models messages again, now that they pass the gate."""
        for topic in (self.topics.status(device), self.topics.models(device)):
            self.conn.client.subscribe(topic, 1)
        self.resubscribed[device] = time.monotonic()

    def tick(self) -> None:
        self.roll_call_due()
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
