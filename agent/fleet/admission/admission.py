"""Device admission and pinned keys (docs/security.md, "Admission"), like Mender's device
authorisation: which devices the controller hears at all.

Every message from a device passes ``Admission.check`` (``FleetConnection.gate``) before
anything reads it. A device is, in the ``device_keys`` table:

- *admitted*: its key is pinned; only messages signed by it (``device_identity``), in order
  per topic and boot, pass. A signed birth with another key (a re-flashed device) puts it back
  to *pending*.
- *legacy*: known before admission existed (a daemon of the previous release, unsigned):
  served as before. Its first signed birth after its upgrade waits as a pending key until an
  operator accepts it, or is pinned at once while the operator's trust-on-first-key window is
  open (``fleet devices trust-legacy --for S``).
- *pending* (``fleet devices pending``; ``accept`` / ``reject``): only signed births reach
  the list, which holds at most ``max_pending`` devices (the oldest evicted, counted).
- *rejected*: dropped.

A device in no row is admitted by the policy: ``manual`` (default: pending), ``keys`` (its
key is in the pre-provisioned list, else pending) or ``open`` (labs: any first key pinned,
unsigned devices as legacy). Everything not admitted is dropped and counted (``counters``),
so it never reaches the device table, the dashboard, ``/metrics`` or a rollout's targets.
"""

import base64
import logging
import sys
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from agent.errors import AgentError
from agent.wire import device_identity, protocol
from agent.wire.signing import key_id, parse_public_key

log = logging.getLogger("agent.fleet")

POLICIES = ("manual", "keys", "open")
MAX_PENDING = 1000
MAX_SEEN = 200000  # (device, topic) entries of the replay guard
REFRESH_S = 2.0
FULL_REFRESH_S = 60.0  # rows deleted elsewhere dropped this often; else what changed
CLOCK_MARGIN_S = 5.0  # rows written this long before the last refresh are read again
DEVICE_KINDS = ("status", "models", "telemetry", "job_status", "command_reply",
                "artifact_request")


def load_keys_file(path: str) -> Dict[str, bytes]:
    """A pre-provisioned list of device public keys: one per line (base64, ed25519:BASE64 or
    ssh-ed25519), or PEM blocks; '#' comments. key id -> raw key."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(16 << 20)
    except OSError as exc:
        raise AgentError("file_not_found", "--admission-keys {} cannot be read: {}".format(
            path, exc.strerror or exc))
    keys: Dict[str, bytes] = {}
    block: list = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if block or line.startswith("-----BEGIN"):
            block.append(line)
            if not line.startswith("-----END"):
                continue
            line, block = "\n".join(block), []
        if not line or line.startswith("#"):
            continue
        try:
            raw = parse_public_key(line)
        except ValueError as exc:
            raise AgentError("bad_argument", "--admission-keys {} line {}: expected an Ed25519 "
                             "public key, found {}".format(path, n, exc))
        keys[key_id(raw)] = raw
    return keys


def _held(row: Mapping[str, Any]) -> Dict[str, Any]:
    """An admission row as the gate holds it (one per device, 50,000 in a large fleet): its
    empty columns left out (``get`` reads them as None) and its device and state strings
    shared."""
    out = {k: v for k, v in row.items() if v is not None or k == "state"}
    # A pending device's birth (up to 64 KiB, 1,000 of them): the store keeps it, the gate
    # never reads it (a flood of signed births once held ~60 MB of them here).
    out.pop("pending_status", None)
    for k in ("device", "state"):
        if isinstance(out.get(k), str):
            out[k] = sys.intern(out[k])
    return out


class Admission(object):
    """The gate. ``check(info, ev)`` -> whether the message may be read; state in ``store``
    (``device_keys``), refreshed every ``REFRESH_S`` so ``fleet devices accept`` run from
    another process takes effect; ``on_admitted(device)`` is called when a device becomes
    admitted here (the service then asks the broker for its retained messages again)."""

    def __init__(self, store: Any, policy: str = "manual",
                 keys: Optional[Mapping[str, bytes]] = None, max_pending: int = MAX_PENDING,
                 clock: Callable[[], float] = time.time, keys_path: Optional[str] = None
                 ) -> None:
        """``keys_path``: the --admission-keys file, read again when it changes (a key added
        to the list takes effect without a restart)."""
        if policy not in POLICIES:
            raise AgentError("bad_argument", "--admission must be one of {}, found {!r}".format(
                ", ".join(POLICIES), policy))
        self.store = store
        self.policy = policy
        self.keys = dict(keys or {})
        self.keys_path = keys_path
        self.keys_mtime = self._mtime()
        self.max_pending = int(max_pending)
        self.clock = clock
        self.rows: Dict[str, Dict[str, Any]] = {}
        self.seen: "OrderedDict[Tuple[str, str], Tuple[int, int]]" = OrderedDict()
        # device -> the newest signed birth's ts (a re-imaged device starts its boots again)
        self.birth_ts: "OrderedDict[str, float]" = OrderedDict()
        self.counters = {"dropped": 0, "bad_signature": 0, "replayed": 0,
                         "pending_evicted": 0}
        self.on_admitted: Callable[[str], None] = lambda device: None
        self.last_refresh = 0.0
        self.last_full = 0.0
        self.refreshed_at = 0.0  # wall clock of the last refresh (rows carry written times)
        store.seed_legacy_devices()
        if policy == "open":
            log.warning("ADMISSION IS OPEN: any device that connects to the broker is admitted "
                        "and its first key pinned; anyone who can publish can add devices. Use "
                        "--admission manual or keys outside a lab (docs/security.md)")
        self.refresh(force=True)

    # -- state --------------------------------------------------------------------------------

    def _mtime(self) -> Optional[float]:
        import os

        try:
            return os.stat(self.keys_path).st_mtime_ns if self.keys_path else None
        except OSError:
            return None

    def refresh(self, force: bool = False) -> None:
        """The rows again: those written since the last refresh (a few seconds' margin for
        the writers' clocks) every ``REFRESH_S``, and the rows deleted elsewhere dropped every
        ``FULL_REFRESH_S`` (their ids only): not 50,000 rows read every 2 s."""
        now = time.monotonic()
        if not force and now - self.last_refresh < REFRESH_S:
            return
        self.last_refresh = now
        self._reload_keys()
        before = self.rows
        wall = time.time()
        if force or not before:
            self.rows = {d: _held(r) for d, r in self.store.device_keys().items()}
            changed = self.rows
        else:  # in place: only the changed rows' previous states are kept for the comparison
            changed = {d: _held(r) for d, r in self.store.device_keys(
                since=self.refreshed_at - CLOCK_MARGIN_S).items()}
            before = {dev: self.rows.get(dev) or {} for dev in changed}
            self.rows.update(changed)
            if now - self.last_full >= FULL_REFRESH_S:  # rows deleted elsewhere go too
                self.last_full = now
                ids = self.store.device_key_ids()
                for dev in [d for d in self.rows if d not in ids]:
                    del self.rows[dev]
        self.refreshed_at = wall
        for dev, row in changed.items():
            if row["state"] in ("admitted", "legacy") and \
                    (before.get(dev) or {}).get("state") not in ("admitted", "legacy") and before:
                self.on_admitted(dev)

    def _reload_keys(self) -> None:
        """The --admission-keys file again when it changed; pending devices now listed are
        admitted (their retained messages asked for again)."""
        mtime = self._mtime()
        if mtime == self.keys_mtime or not self.keys_path:
            return
        self.keys_mtime = mtime
        try:
            self.keys = load_keys_file(self.keys_path)
        except AgentError as exc:
            log.error("admission keys not reloaded: %s", exc.message)
            return
        for dev, row in self.store.device_keys("pending").items():
            if row.get("pending_key_id") in self.keys:
                self._pin(dev, self.keys[row["pending_key_id"]], "--admission-keys")
                if row.get("pending_status"):
                    self.store.upsert_devices({dev: row["pending_status"]})
                self.on_admitted(dev)

    def _set(self, device: str, **fields: Any) -> None:
        row = dict(self.rows.get(device) or {"device": device, "state": None})
        row.update(fields)
        self.rows[device] = _held(row)
        self.store.put_device_key(device, row)

    def _pending(self, device: str, raw: bytes, status: Mapping[str, Any], state: str) -> None:
        if (self.rows.get(device) or {}).get("pending_key_id") == key_id(raw) and \
                self.rows[device]["state"] == state:
            return
        if state == "pending" and device not in self.rows:
            waiting = self.store.pending_count()
            if waiting >= self.max_pending:
                evicted = self.store.evict_oldest_pending()
                if evicted:
                    self.rows.pop(evicted, None)
                self.counters["pending_evicted"] += 1
        self._set(device, state=state, pending_key_id=key_id(raw),
                  pending_public_key=base64.b64encode(raw).decode("ascii"),
                  pending_since=self.clock(), pending_status=dict(status))
        log.warning("device %s: key %s waits for an operator (fleet devices accept %s)",
                    device, key_id(raw), device)

    def _pin(self, device: str, raw: bytes, why: str) -> None:
        self._set(device, state="admitted", key_id=key_id(raw),
                  public_key=base64.b64encode(raw).decode("ascii"), pending_key_id=None,
                  pending_public_key=None, pending_status=None, pending_since=None)
        log.info("device %s admitted with key %s (%s)", device, key_id(raw), why)

    # -- the gate -----------------------------------------------------------------------------

    def check(self, info: Any, ev: Any) -> bool:
        if info.kind not in DEVICE_KINDS or not info.device:
            return True
        self.refresh()
        device = info.device
        row = self.rows.get(device)
        state = (row or {}).get("state")
        if state == "legacy":
            self._maybe_upgrade(device, info, ev)
            return True
        if state == "admitted" and row is not None:
            if self._verified(device, row, info, ev):
                return True
            if info.kind == "status":
                self._new_key(device, info, ev)
            return False
        if state == "rejected":
            return self._drop()
        # pending or unknown: a signed birth may (re)enter the list or be admitted by policy
        if info.kind == "status":
            birth = self._signed_birth(device, info, ev)
            if birth is not None:
                raw, status = birth
                if self.policy == "open" or (self.policy == "keys" and key_id(raw) in self.keys):
                    self._pin(device, raw, "--admission " + self.policy)
                    self._remember(device, ev.topic, ev)
                    return True
                self._pending(device, raw, status, "pending")
            elif state is None and self.policy == "open" and \
                    device_identity.signature_of(ev.user_properties) is None:
                self._set(device, state="legacy")
                log.warning("device %s admitted unsigned, as legacy (--admission open)", device)
                return True
        return self._drop()

    def _drop(self) -> bool:
        self.counters["dropped"] += 1
        return False

    def _signed_birth(self, device: str, info: Any, ev: Any
                      ) -> Optional[Tuple[bytes, Dict[str, Any]]]:
        """(announced key, status) of a birth signed by the key it announces."""
        if not ev.payload:
            return None
        try:
            msg = protocol.decode("status", ev.payload)
        except AgentError:
            return None
        raw = device_identity.public_key_of((msg.get("platform") or {}).get("identity"))
        if raw is None:
            return None
        try:
            device_identity.verify_report(raw, device, ev.topic, ev.payload,
                                          ev.user_properties)
        except AgentError:
            self.counters["bad_signature"] += 1
            return None
        return raw, msg

    def _verified(self, device: str, row: Mapping[str, Any], info: Any, ev: Any) -> bool:
        try:
            raw = base64.b64decode(str(row.get("public_key")))
            sig = device_identity.verify_report(raw, device, ev.topic, ev.payload,
                                                ev.user_properties)
        except (AgentError, ValueError) as exc:
            self.counters["bad_signature"] += 1
            log.debug("dropped: %s", getattr(exc, "message", exc))
            return False
        if sig.will:
            return True  # the Will of a boot: status ordering drops a late one
        key = (device, ev.topic)
        last = self.seen.get(key)
        if last is not None and (sig.boot, sig.seq) < last and self._reimaged(device, info, ev):
            last = None  # a re-imaged device: its boot counter started again
        if last is not None and (sig.boot, sig.seq) < last:
            self.counters["replayed"] += 1
            log.warning("device %s: a replayed message on %s (boot %d seq %d, last %s) dropped",
                        device, ev.topic, sig.boot, sig.seq, last)
            return False
        self._note(key, (sig.boot, sig.seq))
        if info.kind == "status":
            self._note_birth(device, ev)
        return True

    def _note_birth(self, device: str, ev: Any) -> None:
        try:
            ts = float(protocol.decode("status", ev.payload).get("ts") or 0.0)
        except (AgentError, TypeError, ValueError):
            return
        self.birth_ts[device] = max(ts, self.birth_ts.get(device, 0.0))
        self.birth_ts.move_to_end(device)
        while len(self.birth_ts) > MAX_SEEN:
            self.birth_ts.popitem(last=False)

    def _reimaged(self, device: str, info: Any, ev: Any) -> bool:
        """A signed birth with a lower boot than the last seen, but a newer ``ts`` than every
        birth accepted from the device: its state directory was wiped (the journal holds the
        boot counter; the key outside it survives). A replayed old birth carries an old ``ts``
        (the signature covers the payload), so only the device itself can start a new boot
        sequence. The device's replay window starts again from this birth."""
        if info.kind != "status":
            return False
        try:
            ts = float(protocol.decode("status", ev.payload).get("ts") or 0.0)
        except (AgentError, TypeError, ValueError):
            return False
        if ts <= self.birth_ts.get(device, float("inf")):
            return False
        for key in [k for k in self.seen if k[0] == device]:
            del self.seen[key]
        log.info("device %s: a new boot sequence (re-imaged state), birth of %.0f", device, ts)
        return True

    def _note(self, key: Tuple[str, str], value: Tuple[int, int]) -> None:
        self.seen[key] = value
        self.seen.move_to_end(key)
        while len(self.seen) > MAX_SEEN:
            self.seen.popitem(last=False)

    def _remember(self, device: str, topic: str, ev: Any) -> None:
        sig = device_identity.signature_of(ev.user_properties)
        if sig is not None and not sig.get("will"):
            self._note((device, topic), (int(sig["boot"]), int(sig["seq"])))

    def _new_key(self, device: str, info: Any, ev: Any) -> None:
        """An admitted device whose birth is signed by another key: re-flashed (or an
        impostor): back to pending, served no more until an operator accepts the new key."""
        birth = self._signed_birth(device, info, ev)
        if birth is None:
            return
        raw, status = birth
        if self.policy == "keys" and key_id(raw) in self.keys:
            self._pin(device, raw, "a new key in --admission-keys")
            return
        log.warning("device %s announces a new key %s (pinned: %s): back to pending",
                    device, key_id(raw), (self.rows.get(device) or {}).get("key_id"))
        self._pending(device, raw, status, "pending")

    def _maybe_upgrade(self, device: str, info: Any, ev: Any) -> None:
        if info.kind != "status":
            return
        birth = self._signed_birth(device, info, ev)
        if birth is None:
            return
        raw, status = birth
        until = self.store.legacy_window()
        if (until is not None and self.clock() <= until) or \
                (self.policy == "keys" and key_id(raw) in self.keys):
            self._pin(device, raw, "a legacy device's first key (trust window)")
            self._remember(device, ev.topic, ev)
            return
        self._pending(device, raw, status, "legacy")  # served as before until accepted

    # -- operator -----------------------------------------------------------------------------

    def stats(self) -> Dict[str, int]:
        out = dict(self.counters)
        states: Dict[str, int] = {}
        for row in self.rows.values():
            states[str(row["state"])] = states.get(str(row["state"]), 0) + 1
        out.update({"devices_" + k: v for k, v in states.items()})
        return out


def accept(store: Any, device: str, key: Optional[str] = None) -> Dict[str, Any]:
    """An operator admits ``device`` with its pending key (or the public key ``key`` given,
    checked against the pending one when there is one)."""
    row = store.device_keys().get(device)
    if row is None or (not row.get("pending_public_key") and key is None):
        raise AgentError("device_not_admitted", "device {} has no key waiting (fleet devices "
                         "pending lists them; a device appears there once its signed birth "
                         "reached the controller)".format(device))
    raw = base64.b64decode(str(row.get("pending_public_key"))) if row.get(
        "pending_public_key") else parse_public_key(str(key))
    if key is not None and parse_public_key(key) != raw:
        raise AgentError("bad_argument", "device {}: expected the pending key {}, found {}"
                         .format(device, key_id(raw), key_id(parse_public_key(key))))
    row.update(state="admitted", key_id=key_id(raw),
               public_key=base64.b64encode(raw).decode("ascii"), pending_key_id=None,
               pending_public_key=None, pending_since=None)
    store.put_device_key(device, row)
    if row.get("pending_status"):
        store.upsert_devices({device: row["pending_status"]})
    return row


def reject(store: Any, device: str) -> Dict[str, Any]:
    row = store.device_keys().get(device) or {"device": device}
    row.update(state="rejected")
    store.put_device_key(device, row)
    return row


def membership(device: str, ev: Any, rows: Mapping[str, Mapping[str, Any]],
               keys: Mapping[str, bytes], policy: str = "manual") -> str:
    """What a retained birth says of a device's place in the fleet, for ``fleet devices``
    read from the broker (no registry): ``admitted`` (signed by the key pinned for it, or by
    a key of the --admission-keys list), ``legacy`` (unsigned, known to the registry as
    legacy), ``unsigned`` (a daemon of the previous release, or anyone publishing), ``bad
    signature``, ``pending`` (signed, waiting for an operator), ``rejected``, ``not
    admitted`` (signed by a key nobody admitted) or ``signed`` (nothing to check it
    against: no registry, no keys list). Under ``policy`` open an unsigned device is
    ``legacy`` and any signed one ``admitted``, as the service would take them."""
    row = rows.get(device) or {}
    try:
        msg = protocol.decode("status", ev.payload)
    except AgentError:
        return "bad message"
    raw = device_identity.public_key_of((msg.get("platform") or {}).get("identity"))
    if raw is None or device_identity.signature_of(ev.user_properties) is None:
        return "legacy" if row.get("state") == "legacy" or (
            policy == "open" and not row) else "unsigned"
    try:
        device_identity.verify_report(raw, device, ev.topic, ev.payload, ev.user_properties)
    except AgentError:
        return "bad signature"
    state = row.get("state")
    if state in ("admitted", "legacy") and row.get("key_id") == key_id(raw):
        return "admitted"
    if key_id(raw) in keys:
        return "admitted"
    if state in ("pending", "rejected"):
        return str(state)
    if state == "legacy":
        return "legacy"  # served unsigned until its first key is accepted
    if policy == "open" and not row:
        return "admitted"
    return "not admitted" if rows or keys else "signed"
