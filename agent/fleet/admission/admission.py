"""Device admission and pinned keys (docs/security.md, "Admission"), like Mender's device
authorisation: which devices the controller hears at all.

Every message from a device passes ``Admission.check`` (``FleetConnection.gate``) before
anything reads it. A device is, in the ``device_keys`` table:

- *admitted*: its key is pinned; only messages signed by it (``device_identity``), in order
  per topic and boot, pass. The pinned key is sticky: it changes only by an operator's
  ``fleet devices rekey ID --key NEW`` or by a birth signed with the pinned key that announces
  a new one (rotation). A birth signed by any other key is an *impostor event* (counted, a
  rate-limited log line, shown by ``fleet devices show`` and the dashboard), never a state
  change: whoever can publish cannot take an admitted device out of the fleet.
- *legacy*: known before admission existed (a daemon of the previous release, unsigned):
  served as before. Its first signed birth after its upgrade waits as a pending key until an
  operator accepts it, or is pinned at once while the operator's trust-on-first-key window is
  open (``fleet devices trust-legacy --for S``).
- *pending* (``fleet devices pending``; ``accept`` / ``reject``): only signed births reach
  the list, which holds at most ``max_pending`` devices. When full, the oldest is evicted
  (counted), never one whose key is in --admission-keys nor one an operator looked at in the
  last ``VIEWED_S``; a key id adds at most ``PENDING_PER_KEY`` ids per minute. ``accept``
  pins a key the operator saw: every key seen for the id is remembered.
- *rejected*: dropped; a signed birth with another key than the one rejected (a re-flashed
  device asking again, as Mender's new authentication set) puts it back to *pending*.
- *decommissioned* (``fleet devices rm``): its key unpinned, its rows kept as history, counted
  nowhere; a later signed birth is a new device's (pending, or admitted by the policy).

A device in no row is admitted by the policy: ``manual`` (default: pending), ``keys`` (its
key is in the pre-provisioned list, bound to its id by an ``ID KEY`` line, or an unbound key's
first claim, else pending) or ``open`` (labs: the first key pinned for good, unsigned devices
as legacy).

The Will of a device that states a session (``platform.identity.session``, a random value
per connection in its birth and its Will) passes only while that session is the device's
current one: a captured Will replayed later is dropped.

Everything not admitted is dropped and counted (``counters``), so it never reaches the
device table, the dashboard, ``/metrics`` or a rollout's targets.
"""

import base64
import logging
import sys
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, Mapping, Optional, Set, Tuple

from agent.errors import AgentError
from agent.fleet.admission import identity_events
from agent.wire import device_identity, protocol
from agent.wire.signing import key_id, parse_public_key

log = logging.getLogger("agent.fleet")

POLICIES = ("manual", "keys", "open")
MAX_PENDING = 1000
MAX_SEEN = 200000  # (device, topic) entries of the replay guard
REFRESH_S = 2.0
FULL_REFRESH_S = 60.0  # rows deleted elsewhere dropped this often; else what changed
CLOCK_MARGIN_S = 5.0  # rows written this long before the last refresh are read again
VIEWED_S = 30 * 60.0  # a device an operator looked at this recently is never evicted
PENDING_PER_KEY = 10  # new pending ids a key id may add a minute (a burst of as many)
PENDING_RATE = 50  # births for ids not admitted read a second, all keys together
PENDING_BURST = 500
DEVICE_KINDS = ("status", "models", "telemetry", "job_status", "command_reply",
                "artifact_request")


def load_keys_file(path: str) -> Dict[str, bytes]:
    """A pre-provisioned list of device public keys: one per line (base64, ed25519:BASE64 or
    ssh-ed25519, each optionally after the device id it is bound to: ``ID KEY``), or PEM
    blocks; '#' comments. key id -> raw key."""
    return load_keys_bindings(path)[0]


def load_keys_bindings(path: str) -> Tuple[Dict[str, bytes], Dict[str, str]]:
    """(key id -> raw key, key id -> the device id its line binds it to) of an
    --admission-keys file; a key without an id is unbound (accepted for its first id only)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(16 << 20)
    except OSError as exc:
        raise AgentError("file_not_found", "--admission-keys {} cannot be read: {}".format(
            path, exc.strerror or exc))
    keys: Dict[str, bytes] = {}
    bound: Dict[str, str] = {}
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
        device = None
        try:
            raw = parse_public_key(line)
        except ValueError as exc:
            device, _, rest = line.partition(" ")
            try:
                raw = parse_public_key(rest.strip())
            except ValueError:
                raise AgentError("bad_argument", "--admission-keys {} line {}: expected an "
                                 "Ed25519 public key, or a device id and one, found {}".format(
                                     path, n, exc))
            if not device or len(device) > identity_events.MAX_ID_CHARS:
                raise AgentError("bad_argument", "--admission-keys {} line {}: expected a "
                                 "device id of 1 to {} characters before the key, found {!r}"
                                 .format(path, n, identity_events.MAX_ID_CHARS, device[:80]))
        kid = key_id(raw)
        if device is not None:
            if bound.get(kid, device) != device:
                raise AgentError("bad_argument", "--admission-keys {} line {}: key {} is "
                                 "already bound to device {}, found it again for {}".format(
                                     path, n, kid, bound[kid], device))
            bound[kid] = device
        keys[kid] = raw
    return keys, bound


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
                 clock: Callable[[], float] = time.time, keys_path: Optional[str] = None,
                 bound: Optional[Mapping[str, str]] = None) -> None:
        """``keys_path``: the --admission-keys file, read again when it changes (a key added
        to the list takes effect without a restart); ``bound``: key id -> the device id its
        line binds it to."""
        if policy not in POLICIES:
            raise AgentError("bad_argument", "--admission must be one of {}, found {!r}".format(
                ", ".join(POLICIES), policy))
        self.store = store
        self.policy = policy
        self.keys = dict(keys or {})
        self.bound = dict(bound or {})
        self.claims: Dict[str, str] = {}  # an unbound listed key -> the id it claimed first
        self.keys_path = keys_path
        self.keys_mtime = self._mtime()
        self.max_pending = int(max_pending)
        self.clock = clock
        self.rows: Dict[str, Dict[str, Any]] = {}
        self.seen: "OrderedDict[Tuple[str, str], Tuple[int, int]]" = OrderedDict()
        # device -> the newest signed birth's ts (a re-imaged device starts its boots again)
        self.birth_ts: "OrderedDict[str, float]" = OrderedDict()
        self.counters = {"dropped": 0, "bad_signature": 0, "replayed": 0,
                         "pending_evicted": 0, "impostor": 0, "key_bound_elsewhere": 0,
                         "pending_rate_limited": 0, "will_replayed": 0, "rotated": 0}
        self.records = identity_events.Records(store)
        self.buckets = identity_events.KeyBuckets(PENDING_PER_KEY, PENDING_PER_KEY)
        self.flood = identity_events.KeyBuckets(PENDING_RATE * 60, PENDING_BURST)
        self.ratelog = identity_events.RateLog(log)
        self.pending_q: "OrderedDict[str, None]" = OrderedDict()  # oldest first
        self.viewed: Set[str] = set()
        self.sessions: Dict[str, str] = {}  # device -> its current connection's session
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
        if force or changed is self.rows:
            self.pending_q = OrderedDict((d, None) for d, _ in sorted(
                ((d, r.get("pending_since") or 0.0) for d, r in self.rows.items()
                 if r["state"] == "pending"), key=lambda x: x[1]))
        else:
            for dev, row in changed.items():
                if row["state"] == "pending":
                    self.pending_q.setdefault(dev, None)
                else:
                    self.pending_q.pop(dev, None)
        viewed = self.store.meta_prefix(identity_events.VIEWED)
        self.viewed = {d for d, ts in viewed.items()
                       if isinstance(ts, (int, float)) and ts >= wall - VIEWED_S}
        for dev in set(viewed) - self.viewed:  # expired looks: the prefix stays small
            self.store.meta_delete(identity_events.VIEWED + dev)
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
            self.keys, self.bound = load_keys_bindings(self.keys_path)
        except AgentError as exc:
            log.error("admission keys not reloaded: %s", exc.message)
            return
        for dev, row in self.store.device_keys("pending").items():
            if row.get("pending_key_id") in self.keys and \
                    self._listed_for(dev, str(row["pending_key_id"])):
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
        kid = key_id(raw)
        row = self.rows.get(device) or {}
        if row.get("pending_key_id") == kid and row.get("state") == state:
            return
        if state == "pending" and device not in self.rows:
            if kid not in self.keys and not self.buckets.take(kid):
                self.counters["pending_rate_limited"] += 1
                self.ratelog.warning("rate", "key %s: more than %d new pending device ids a "
                                     "minute; device %s dropped", kid, PENDING_PER_KEY, device)
                return
            if len(self.pending_q) >= self.max_pending and not self._evict_one():
                self.ratelog.warning("full", "the pending list is full of devices an operator "
                                     "looked at or listed in --admission-keys; device %s "
                                     "dropped", device)
                return
        if row.get("pending_key_id") and row.get("pending_key_id") != kid:
            # a second key for the id: an operator's accept without --key then names both
            self.records.saw_key(device, str(row["pending_key_id"]),
                                 str(row.get("pending_public_key")))
            self.records.saw_key(device, kid, base64.b64encode(raw).decode("ascii"))
        self._set(device, state=state, pending_key_id=kid,
                  pending_public_key=base64.b64encode(raw).decode("ascii"),
                  pending_since=self.clock(), pending_status=dict(status))
        if state == "pending":
            self.pending_q[device] = None
            self.pending_q.move_to_end(device)
        self.ratelog.warning("pending", "device %s: key %s waits for an operator (fleet "
                             "devices accept %s)", device, kid, device)

    def _protected(self, device: str) -> bool:
        """Never evicted: an operator looked at it lately (read again before an eviction: a
        look since the last refresh counts), or its key is listed."""
        if device in self.viewed or \
                (self.rows.get(device) or {}).get("pending_key_id") in self.keys:
            return True
        ts = self.store.meta_get(identity_events.VIEWED + device)
        if isinstance(ts, (int, float)) and ts >= time.time() - VIEWED_S:
            self.viewed.add(device)
            return True
        return False

    def _evict_one(self) -> bool:
        """Room for one more pending device: the oldest one not protected leaves (the
        protected ones met on the way go to the back: each is passed over once)."""
        for _ in range(len(self.pending_q)):
            dev = next(iter(self.pending_q))
            if self._protected(dev):
                self.pending_q.move_to_end(dev)
                continue
            del self.pending_q[dev]
            self.rows.pop(dev, None)
            self.store.delete_device_key(dev)
            self.records.forget(dev)
            self.counters["pending_evicted"] += 1
            self.ratelog.warning("evicted", "the pending list is full (%d): device %s evicted",
                                 self.max_pending, dev)
            return True
        return False

    def _listed_for(self, device: str, kid: str) -> bool:
        """Whether the listed key ``kid`` may admit ``device``: bound to it, or unbound and
        not yet claimed by another id (the first claim is recorded and logged)."""
        if kid in self.bound:
            if self.bound[kid] == device:
                return True
            self.counters["key_bound_elsewhere"] += 1
            self.ratelog.warning("bound", "device %s: key %s is bound to device %s in "
                                 "--admission-keys; dropped", device, kid, self.bound[kid])
            return False
        claimed = self.claims.get(kid)  # written here or by another instance: read once
        if claimed is None:
            claimed = self.store.meta_get(identity_events.CLAIM + kid)
            if claimed is not None:
                self.claims[kid] = str(claimed)
        if claimed is None:
            self.store.meta_put(identity_events.CLAIM + kid, device)
            self.claims[kid] = device
            self.ratelog.warning("claim", "device %s claims the unbound key %s of "
                                 "--admission-keys: it is now this id's only (bind it with a "
                                 "line '%s KEY')", device, kid, device)
            return True
        if claimed == device:
            return True
        self.counters["key_bound_elsewhere"] += 1
        self.ratelog.warning("bound", "device %s: the unbound key %s of --admission-keys "
                             "already admitted device %s; dropped", device, kid, claimed)
        return False

    def _pin(self, device: str, raw: bytes, why: str) -> None:
        self.pending_q.pop(device, None)
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
            if info.kind == "status":  # checked at the flood's rate: a signature check each
                if self.flood.take("*"):
                    # An operator may have rejected, re-keyed or decommissioned it since the
                    # last refresh (another process): judged on the row as it is now.
                    if self._changed_elsewhere(device, state):
                        return self.check(info, ev)
                    self._new_key(device, info, ev)
                else:
                    self.counters["pending_rate_limited"] += 1
            return False
        if state == "rejected":
            if info.kind == "status" and row is not None:
                birth = self._signed_birth(device, info, ev)
                if birth is not None and key_id(birth[0]) not in (row.get("pending_key_id"),
                                                                   row.get("key_id")):
                    log.warning("device %s (rejected) asks again with a new key %s",
                                device, key_id(birth[0]))
                    self._pending(device, birth[0], birth[1], "pending")
            return self._drop()
        # pending or unknown: a signed birth may (re)enter the list or be admitted by policy
        if info.kind == "status" and not self._may_read(state, ev):
            return self._drop()
        if info.kind == "status":
            birth = self._signed_birth(device, info, ev)
            if birth is not None and self._changed_elsewhere(device, state):
                return self.check(info, ev)  # accepted (or rejected) meanwhile: judge again
            if birth is not None:
                raw, status = birth
                listed = self.policy == "keys" and key_id(raw) in self.keys
                if listed and not self._listed_for(device, key_id(raw)):
                    return self._drop()
                if self.policy == "open" or listed:
                    self._pin(device, raw, "--admission " + self.policy)
                    self._note_session(device, status)
                    self._remember(device, ev.topic, ev)
                    return True
                self._pending(device, raw, status, "pending")
            elif state is None and self.policy == "open" and \
                    device_identity.signature_of(ev.user_properties) is None:
                self._set(device, state="legacy")
                log.warning("device %s admitted unsigned, as legacy (--admission open)", device)
                return True
        return self._drop()

    def _may_read(self, state: Optional[str], ev: Any) -> bool:
        """Whether a birth for a pending or unknown id is read at all (decoded, verified,
        written): a flood of made-up ids costs the service a few microseconds each, not a
        signature check and database writes, so admitted devices' messages behind it in the
        queue are not held up. Under ``open`` (a new id is admitted, not pending) and for a
        key listed in --admission-keys, always; an unsigned birth, never (only signed births
        reach the list); the rest share ``PENDING_RATE`` a second. A genuine new device
        dropped here is read at the next roll call (its birth is retained)."""
        if self.policy == "open" and state is None:
            return True
        sig = device_identity.signature_of(ev.user_properties)
        if sig is None:
            return False
        if sig.get("key_id") in self.keys or self.flood.take("*"):
            return True
        self.counters["pending_rate_limited"] += 1
        self.ratelog.warning("flood", "more than %d births a second for devices not admitted; "
                             "the rest dropped unread (a genuine one is read at the next roll "
                             "call)", PENDING_RATE)
        return False

    def _changed_elsewhere(self, device: str, state: Optional[str]) -> bool:
        """Whether an operator (``fleet devices accept|reject|rekey|rm``, another process)
        changed the device's row since the last refresh: read before a birth writes the row or
        counts as an impostor, so that a birth arriving in between never overrides an
        operator's decision."""
        fresh = self.store.device_keys(device=device).get(device)
        held = self.rows.get(device) or {}
        if fresh is None or (fresh.get("state"), fresh.get("key_id")) == (
                state, held.get("key_id")):
            return False
        self.rows[device] = _held(fresh)
        if fresh.get("state") != "pending":
            self.pending_q.pop(device, None)
        return True

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
        if sig.will:  # status ordering drops a late one of an older boot; the session any
            return self._will_current(device, ev)  # other Will of this boot
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
            self._rotation(device, row, ev)
        return True

    def _will_current(self, device: str, ev: Any) -> bool:
        """A Will passes only while its session is the device's current one (a device of
        the previous release states none: its Wills pass as before)."""
        current = self.sessions.get(device)
        if current is None:  # a service just started: the session of the last status it kept
            known = self.store.device(device)
            ident = ((known or {}).get("status") or {}).get("platform") or {}
            ident = ident.get("identity") if isinstance(ident, Mapping) else None
            if isinstance(ident, Mapping) and isinstance(ident.get("session"), str):
                current = self.sessions[device] = str(ident["session"])[:64]
        session = _session_of(ev.payload)
        if current is None or session == current:
            return True
        self.counters["will_replayed"] += 1
        self.ratelog.warning("will", "device %s: a Will of session %s, the current one is %s "
                             "(replayed, or late): dropped", device, session, current)
        return False

    def _note_session(self, device: str, status: Mapping[str, Any]) -> None:
        ident = (status.get("platform") or {}).get("identity")
        session = ident.get("session") if isinstance(ident, Mapping) else None
        if status.get("online") and isinstance(session, str) and session:
            self.sessions[device] = session[:64]

    def _rotation(self, device: str, row: Mapping[str, Any], ev: Any) -> None:
        """A birth signed by the pinned key: its session is current; when it announces
        another key, that is the device's rotation (only the holder of the old key can)."""
        try:
            msg = protocol.decode("status", ev.payload)
        except AgentError:
            return
        self._note_session(device, msg)
        raw = device_identity.public_key_of((msg.get("platform") or {}).get("identity"))
        if raw is None or key_id(raw) == row.get("key_id"):
            return
        old = row.get("key_id")
        self._pin(device, raw, "rotation announced by a birth signed with the old key {}"
                  .format(old))
        self.records.reset(device, key_id(raw), base64.b64encode(raw).decode("ascii"))
        self.counters["rotated"] += 1

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
        """An admitted device's birth signed by another key: an impostor (or a re-flashed
        device, which an operator re-keys: ``fleet devices rekey``). Counted and shown, never
        a state change: the device stays admitted and served with its pinned key."""
        birth = self._signed_birth(device, info, ev)
        if birth is None:
            return
        raw, _ = birth
        kid = key_id(raw)
        self.counters["impostor"] += 1
        n = self.records.impostor(device, kid, base64.b64encode(raw).decode("ascii"),
                                  time.time())
        self.ratelog.warning("impostor", "device %s: a birth signed by key %s, not its pinned "
                             "key %s: an impostor event (%d for this device), ignored (a "
                             "re-flashed device: fleet devices rekey %s --key NEW)", device, kid,
                             (self.rows.get(device) or {}).get("key_id"), n, device)

    def _maybe_upgrade(self, device: str, info: Any, ev: Any) -> None:
        if info.kind != "status":
            return
        birth = self._signed_birth(device, info, ev)
        if birth is None:
            return
        raw, status = birth
        until = self.store.legacy_window()
        if (until is not None and self.clock() <= until) or \
                (self.policy == "keys" and key_id(raw) in self.keys and
                 self._listed_for(device, key_id(raw))):
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


def _session_of(payload: bytes) -> Optional[str]:
    """The session a status states (``platform.identity.session``), or None."""
    try:
        msg = protocol.decode("status", payload)
    except AgentError:
        return None
    ident = (msg.get("platform") or {}).get("identity")
    session = ident.get("session") if isinstance(ident, Mapping) else None
    return session[:64] if isinstance(session, str) and session else None


def accept(store: Any, device: str, key: Optional[str] = None,
           seen_key_id: Optional[str] = None) -> Dict[str, Any]:
    """An operator admits ``device`` with a key they saw: ``seen_key_id`` (the key id the
    dashboard showed), the public key ``key`` (one of the keys seen, or any key for a device
    that has none waiting: pre-authorised), or else the only key ever seen for the id; with
    several seen, AgentError admission_key_ambiguous naming them."""
    row = store.device_keys(device=device).get(device)
    seen = identity_events.keys_seen(store, device, row)
    if row is not None and row.get("state") == "admitted":
        raise AgentError("device_already_admitted", "device {} is already admitted with key "
                         "{}: expected a device waiting for admission (a new key for it: fleet "
                         "devices rekey {} --key NEW)".format(device, row.get("key_id"), device))
    if row is None or (not row.get("pending_public_key") and key is None):
        raise AgentError("device_not_admitted", "device {} has no key waiting (fleet devices "
                         "pending lists them; a device appears there once its signed birth "
                         "reached the controller)".format(device))
    if key is not None:
        raw = key_arg(key)
        if seen and key_id(raw) not in seen:
            raise AgentError("bad_argument", "device {}: expected one of the keys seen for it "
                             "({}), found {}".format(device, ", ".join(seen), key_id(raw)))
    elif seen_key_id is not None:
        if seen_key_id not in seen:
            raise AgentError("admission_key_changed", "device {}: expected key {} (the one "
                             "shown), the keys seen are {}; look again".format(
                                 device, seen_key_id, ", ".join(seen) or "none"))
        raw = base64.b64decode(seen[seen_key_id])
    elif len(seen) > 1:
        raise AgentError("admission_key_ambiguous", "device {}: expected one key seen to "
                         "accept, found {} ({}); name the device's own with --key".format(
                             device, len(seen), ", ".join(seen)), {"key_ids": list(seen)})
    else:
        raw = base64.b64decode(str(row.get("pending_public_key")))
    status = row.get("pending_status") if row.get("pending_key_id") == key_id(raw) else None
    row.update(state="admitted", key_id=key_id(raw),
               public_key=base64.b64encode(raw).decode("ascii"), pending_key_id=None,
               pending_public_key=None, pending_since=None, pending_status=None)
    store.put_device_key(device, row)
    if status:
        store.upsert_devices({device: status})
    identity_events.Records(store).reset(device, key_id(raw),
                                         base64.b64encode(raw).decode("ascii"))
    return row


def rekey(store: Any, device: str, key: str) -> Dict[str, Any]:
    """An operator's explicit new key for a known device (re-flashed, or its key replaced):
    the only way besides a rotation signed by the old key that a pinned key changes."""
    row = store.device_keys(device=device).get(device)
    if row is None or row.get("state") not in ("admitted", "legacy", "pending"):
        raise AgentError("device_not_admitted", "device {}: expected an admitted, legacy or "
                         "pending device to re-key, found {}".format(
                             device, (row or {}).get("state") or "no such device"))
    raw = parse_public_key(key)
    old = row.get("key_id")
    row.update(state="admitted", key_id=key_id(raw),
               public_key=base64.b64encode(raw).decode("ascii"), pending_key_id=None,
               pending_public_key=None, pending_since=None, pending_status=None)
    store.put_device_key(device, row)
    identity_events.Records(store).reset(device, key_id(raw),
                                         base64.b64encode(raw).decode("ascii"))
    log.warning("device %s re-keyed by an operator: %s -> %s", device, old, key_id(raw))
    return row


MAX_KEY_FILE = 64 * 1024


def key_arg(text: str) -> bytes:
    """``accept --key``: a public key file's path (``device.pub``), or the key itself as
    PEM text, an ``ssh-ed25519`` line, base64 of the raw 32 bytes or a bare base64 line of a
    PEM body (its SubjectPublicKeyInfo). AgentError bad_argument otherwise."""
    import os

    from agent.wire.signing import public_key_from_spki

    source = "--key"
    if os.path.isfile(text):
        source = "--key {}".format(text)
        try:
            with open(text, "rb") as f:
                text = f.read(MAX_KEY_FILE + 1).decode("utf-8", "replace")
        except OSError as exc:
            raise AgentError("file_not_found", "{}: cannot be read: {}".format(
                source, exc.strerror or exc))
        if len(text) > MAX_KEY_FILE:
            raise AgentError("bad_argument", "{}: expected a public key file, found more than "
                             "{} bytes".format(source, MAX_KEY_FILE))
    try:
        return parse_public_key(text)
    except ValueError as exc:
        try:
            return public_key_from_spki(base64.b64decode(text.strip(), validate=True))
        except ValueError:
            pass
        raise AgentError("bad_argument", "{}: expected an Ed25519 public key (a .pub file, PEM, "
                         "ssh-ed25519 or base64), found {}".format(source, exc))


def _known(store: Any, device: str) -> Dict[str, Any]:
    """The device's admission row; AgentError unknown_device when neither admission nor the
    registry has heard of it (a typo must not create a row)."""
    row = store.device_keys(device=device).get(device)
    if row is None and store.device(device) is None:
        raise AgentError("unknown_device", "expected a device that reported to this fleet "
                         "(fleet devices; fleet devices pending), found {!r}".format(device))
    return row or {"device": device}


def reject(store: Any, device: str) -> Dict[str, Any]:
    """Its messages dropped; a signed birth with a new key puts it back to pending."""
    row = _known(store, device)
    row.update(state="rejected")
    store.put_device_key(device, row)
    return row


def check_members(store: Any, ids: Any, known: Any) -> None:
    """Named targets (``--devices``) the registry leaves out because admission keeps them out:
    AgentError device_not_admitted saying so, with the fix (not "never reported")."""
    wanted = [d for d in ids if d not in known]
    if not wanted:
        return
    rows = store.device_keys()
    for dev in wanted:
        state = (rows.get(dev) or {}).get("state")
        if state == "pending":
            raise AgentError("device_not_admitted", "{} is pending admission: fleet devices "
                             "accept {}".format(dev, dev))
        if state in ("rejected", "decommissioned"):
            raise AgentError("device_not_admitted", "{} is {}: it returns to fleet devices "
                             "pending when it presents a new key (rejected) or is born again "
                             "(decommissioned)".format(dev, state))


def decommission(store: Any, device: str) -> Dict[str, Any]:
    """``fleet devices rm``: the key unpinned and the device out of every count (the
    registry's rows stay, as history); a later birth is a new device's."""
    row = _known(store, device)
    row.update(state="decommissioned", key_id=None, public_key=None, pending_key_id=None,
               pending_public_key=None, pending_since=None, pending_status=None)
    store.put_device_key(device, row)
    return row
def identity_view(store: Any, device: str) -> Dict[str, Any]:
    """What ``fleet devices show`` and the dashboard say of a device's identity: its
    state, pinned key, keys seen and impostor events."""
    row = store.device_keys(device=device).get(device) or {}
    rec = identity_events.record(store, device)
    seen = identity_events.keys_seen(store, device, row)
    return {"state": row.get("state"), "key_id": row.get("key_id"),
            "pending_key_id": row.get("pending_key_id"),
            "keys_seen": ([row["key_id"]] if row.get("key_id") else []) +
            [k for k in seen if k != row.get("key_id")],
            "impostor_events": int(rec.get("impostors") or 0),
            "last_impostor": rec.get("last")}


def membership(device: str, ev: Any, rows: Mapping[str, Mapping[str, Any]],
               keys: Mapping[str, bytes], policy: str = "manual",
               bound: Optional[Mapping[str, str]] = None) -> str:
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
    if state in ("admitted", "legacy") and row.get("key_id"):
        return "impostor"  # signed by a key other than the pinned one
    if key_id(raw) in keys and (bound or {}).get(key_id(raw), device) == device:
        return "admitted"
    if state in ("pending", "rejected"):
        return str(state)
    if state == "legacy":
        return "legacy"  # served unsigned until its first key is accepted
    if policy == "open" and not row:
        return "admitted"
    return "not admitted" if rows or keys else "signed"
