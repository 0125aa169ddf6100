"""Pins: one device's model held at a version, whatever the deployments say (hawkBit's and
Mender's per-device pin). Two sources, one meaning:

- ``fleet``: a row of ``device_pins``, written by ``fleet pin DEVICE NAME@VERSION`` or by
  ``fleet rollback`` of a device that a deployment governs (the rollback is kept, not undone);
  ``fleet unpin`` removes it. A version of NULL pins the device to what a rollback still in
  flight makes active.
- ``device``: the device's own pin (``jetson-agent models pin`` on the device), which it reports
  in its retained models message as ``"pins": {"<name>": "<version>"}``.

A deployment never sends its version to a pinned device; the device shows as ``waiting``
with the reason ``pinned to NAME@VERSION``. A fleet pin wins over a device pin of the same
model (the operator's word, as with labels).
"""

import getpass
import os
import time
import uuid
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from agent.errors import AgentError
from agent.wire import model_names, protocol

MAX_DEVICE_PINS = 64  # pins read from one device's models message (it is the device's word)
MAX_REASON = 500


def actor() -> str:
    """Who acts from this shell: the OS user (a token's name where a request carries one)."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container): the uid
        return "uid:{}".format(os.getuid()) if hasattr(os, "getuid") else "unknown"


def reported(models_msg: Optional[Mapping[str, Any]]) -> Dict[str, str]:
    """The device's own pins from its models message, bounded and checked (a bad entry is
    skipped: the message is the device's word, not ours)."""
    raw = (models_msg or {}).get("pins") if isinstance(models_msg, Mapping) else None
    out: Dict[str, str] = {}
    if not isinstance(raw, Mapping):
        return out
    for name, version in list(raw.items())[:MAX_DEVICE_PINS]:
        try:
            out[model_names.validate_name(name)] = model_names.validate_version(version)
        except AgentError:
            continue
    return out


def label(pin: Mapping[str, Any]) -> str:
    """``pinned to NAME@VERSION`` (the reason a pinned device waits)."""
    if pin.get("version") is None:
        return "pinned to {} (rollback in flight)".format(pin["name"])
    return "pinned to " + model_names.label(pin["name"], pin["version"])


def effective(fleet_pin: Optional[Mapping[str, Any]], models_msg: Optional[Mapping[str, Any]],
              name: str) -> Optional[Dict[str, Any]]:
    """The pin that holds ``name`` on a device: its fleet pin, else its own. Pure."""
    if fleet_pin is not None:
        return dict(fleet_pin, source="fleet")
    mine = reported(models_msg).get(name)
    if mine is not None:
        return {"name": name, "version": mine, "source": "device", "actor": None,
                "reason": None, "created": None}
    return None


# ---------------------------------------------------------------------------- rows

_COLS = "device_id, name, version, actor, reason, created"


def _row(r: Any) -> Dict[str, Any]:
    return {"device_id": r[0], "name": r[1], "version": r[2], "source": "fleet",
            "actor": r[3], "reason": r[4], "created": r[5]}


CHANGED_KEY = "pins_changed"  # meta row: a new value at every write of device_pins


def _touch(store: Any) -> None:
    """Tell the deployments' runner that the pins changed (it reads one row a tick, and the
    table only then)."""
    store.meta_put(CHANGED_KEY, uuid.uuid4().hex)


def changed_mark(store: Any) -> Any:
    return store.meta_get(CHANGED_KEY)


def fleet_pins(store: Any, devices: Optional[Iterable[str]] = None
               ) -> Dict[Tuple[str, str], Dict[str, Any]]:
    """(device, name) -> its fleet pin (``devices``: of these only)."""
    if devices is None:
        found = store.db.query("SELECT {} FROM device_pins".format(_COLS))
    else:
        ids, found = sorted(set(devices)), []
        for i in range(0, len(ids), 500):
            chunk = ids[i:i + 500]
            found += store.db.query("SELECT {} FROM device_pins WHERE device_id IN ({})".format(
                _COLS, ", ".join("?" for _ in chunk)), chunk)
    return {(r[0], r[1]): _row(r) for r in found}


def list_pins(store: Any, devices: Optional[Iterable[str]] = None) -> List[Dict[str, Any]]:
    """Every pin (``devices``: of these only): the fleet's rows and the devices' own (from
    their retained models messages), sorted by device and name; a device pin that a fleet pin
    overrides is left out. {device_id, name, version, source ('fleet'|'device'), actor,
    reason, created}."""
    import json

    wanted = None if devices is None else sorted(set(devices))
    out = fleet_pins(store, wanted)
    rows: List[Any] = []
    if wanted is None:
        rows = store.db.query("SELECT device_id, message, updated FROM device_models WHERE "
                              "message LIKE ?", ('%"pins"%',))
    else:
        for i in range(0, len(wanted), 500):
            chunk = wanted[i:i + 500]
            rows += store.db.query(
                "SELECT device_id, message, updated FROM device_models WHERE device_id IN ({}) "
                "AND message LIKE ?".format(", ".join("?" for _ in chunk)),
                list(chunk) + ['%"pins"%'])
    for dev, message, updated in rows:
        try:
            msg = json.loads(message) if message else None
        except ValueError:
            continue
        for name, version in reported(msg).items():
            out.setdefault((dev, name), {"device_id": dev, "name": name, "version": version,
                                         "source": "device", "actor": None, "reason": None,
                                         "created": updated})
    return [out[k] for k in sorted(out)]


def pin(store: Any, device: str, name: str, version: Optional[str], who: Optional[str] = None,
        reason: Optional[str] = None) -> Dict[str, Any]:
    """Record (or replace) the fleet pin of ``device``'s ``name``; returns the row. The
    deployments' runner sees the change mark and decides the changed devices."""
    protocol.check_id("device", device)
    model_names.validate_name(name)
    if version is not None:
        model_names.validate_version(version)
    if reason is not None and len(reason) > MAX_REASON:
        raise AgentError("bad_argument", "--reason: expected at most {} characters, found {}"
                         .format(MAX_REASON, len(reason)))
    row = {"device_id": device, "name": name, "version": version, "source": "fleet",
           "actor": who or actor(), "reason": reason, "created": time.time()}
    store.db.execute(
        "INSERT INTO device_pins (device_id, name, version, actor, reason, created) VALUES "
        "(?, ?, ?, ?, ?, ?) ON CONFLICT (device_id, name) DO UPDATE SET version = "
        "excluded.version, actor = excluded.actor, reason = excluded.reason, created = "
        "excluded.created",
        (device, name, version, row["actor"], reason, row["created"]))
    _touch(store)
    return row


def settle(store: Any, device: str, name: str, version: Optional[str]) -> None:
    """A rollback's reply: its pin without a version gets the one the device made active;
    a refused rollback (``version`` None) leaves no pin behind."""
    if version is None:
        store.db.execute("DELETE FROM device_pins WHERE device_id = ? AND name = ? AND version "
                         "IS NULL", (device, name))
    else:
        store.db.execute("UPDATE device_pins SET version = ? WHERE device_id = ? AND name = ? "
                         "AND version IS NULL", (version, device, name))
    _touch(store)


def unpin(store: Any, device: str, name: str) -> bool:
    """Remove the fleet pin; False when there was none."""
    found = store.db.query("SELECT 1 FROM device_pins WHERE device_id = ? AND name = ?",
                           (device, name))
    store.db.execute("DELETE FROM device_pins WHERE device_id = ? AND name = ?", (device, name))
    _touch(store)
    return bool(found)


def governed_by(store: Any, device: str, name: str) -> Optional[str]:
    """The live deployment that governs ``device``'s ``name`` (its recorded device rows),
    else None: a rollback of it becomes a pin, of an ungoverned model stays a rollback."""
    from agent.fleet.deployments.deployments import LIVE

    found = store.db.query(
        "SELECT d.deployment_id FROM deployment_devices dd JOIN deployments d ON "
        "d.deployment_id = dd.deployment_id WHERE dd.device_id = ? AND d.name = ? AND d.state "
        "IN ({}) ORDER BY d.created DESC".format(", ".join("?" for _ in LIVE)),
        (device, name) + tuple(LIVE))
    return str(found[0][0]) if found else None


def on_rollback_reply(store: Any, device: str, reply: Mapping[str, Any]) -> None:
    """A device's reply to a rollback (the service hears every one): a pin waiting for its
    version gets the one the device made active; a refusal leaves no pin of it behind (nor
    one to the version it asked for)."""
    res: Mapping[str, Any] = reply["result"] if isinstance(reply.get("result"), Mapping) \
        else {}
    rows = store.db.query("SELECT name, version FROM rollbacks WHERE request_id = ? AND "
                          "device_id = ?", (str(reply.get("request_id")), device))
    name = rows[0][0] if rows else None  # the rollback's own record, not the device's word
    if not isinstance(name, str):
        return
    if not reply.get("ok"):
        asked = rows[0][1] if rows else None
        if asked is not None:
            store.db.execute("DELETE FROM device_pins WHERE device_id = ? AND name = ? AND "
                             "version = ?", (device, name, asked))
        settle(store, device, name, None)
        return
    try:
        settle(store, device, model_names.validate_name(name),
               model_names.validate_version(res.get("version")))
    except AgentError:  # the device's word, malformed: the pin stays as it was
        return


def rollback_pins(store: Any, requests: List[Dict[str, Any]], reason: Optional[str] = None
                  ) -> Dict[str, str]:
    """``fleet rollback``'s requests ({request_id, device, name, version}) of a model that a
    deployment governs on the device become pins (version None: the one the rollback makes
    active, settled by the reply): request id -> the governing deployment."""
    out: Dict[str, str] = {}
    for t in requests:
        if t.get("name") is None:  # an earlier release's device, by sha256: no name to pin
            continue
        dep = governed_by(store, t["device"], t["name"])
        if dep is not None:
            pin(store, t["device"], t["name"], t.get("version"),
                reason=reason or "fleet rollback (deployment {})".format(dep))
            out[str(t["request_id"])] = dep
    return out
