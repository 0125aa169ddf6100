"""Device labels on the controller: the ones an operator assigns (``fleet label``; the
``device_labels`` table), the ones a device claims (its birth status's ``platform.labels``,
kept apart and capped again here), and the ones derived from the verified status only (board,
jetpack, tensorrt, class). ``selectable`` is what a selector sees:

- ``board``, ``jetpack``, ``tensorrt``, ``class``: derived from the status's platform as the
  daemon detected it (never from a claim: a device cannot set them, an operator neither);
- ``fleet/KEY``: assigned by an operator; ``device/KEY``: claimed by the device;
- ``KEY``: the operator's value where there is one, else the device's claim.

A selector that trusts only the operator says ``fleet/site=...``; one that takes the device's
word says ``device/site=...`` or plain ``site=...``.
"""

import hashlib
import json
import re
import time
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from agent.errors import AgentError
from agent.wire import device_labels

_DROP = re.compile(r"^(nvidia|jetson|developer|kit|module|\d+gb|\(.*\))$")



def _slug(text: Any, drop: bool = False) -> Optional[str]:
    if not isinstance(text, str) or not text.strip():
        return None
    words = re.split(r"[^a-z0-9.]+", text.lower())
    words = [w for w in words if w and not (drop and _DROP.match(w))]
    out = "-".join(words).strip("-.")[:63].strip("-.")
    return out if out and device_labels.valid_value(out) else None


def derived(status: Optional[Mapping[str, Any]]) -> Dict[str, str]:
    """board (``Jetson Orin Nano 8GB`` -> ``orin-nano``), jetpack, tensorrt and class (the
    engine-sharing class, as ``c`` + 12 hex of its hash) from the status's platform."""
    from agent.fleet.transfer.sharing import device_class

    plat = (status or {}).get("platform")
    if not isinstance(plat, Mapping):
        return {}
    out: Dict[str, str] = {}
    for key, value in (("board", _slug(plat.get("board"), drop=True)),
                       ("jetpack", _slug(plat.get("jetpack"))),
                       ("tensorrt", _slug(plat.get("tensorrt")))):
        if value:
            out[key] = value
    cls = device_class(status)
    if cls:
        out["class"] = "c" + hashlib.sha256(cls.encode("utf-8")).hexdigest()[:12]
    return out


def reported(status: Optional[Mapping[str, Any]]) -> Dict[str, str]:
    """The labels a device claims (``platform.labels``), the valid ones, capped."""
    plat = (status or {}).get("platform")
    return device_labels.lenient(plat.get("labels") if isinstance(plat, Mapping) else None)[0]


def selectable(status: Optional[Mapping[str, Any]], assigned: Optional[Mapping[str, str]]
               ) -> Dict[str, str]:
    """Every label a selector can name for this device (see the module's docstring)."""
    claim = reported(status)
    mine = dict(assigned or {})
    out: Dict[str, str] = {}
    out.update(claim)
    out.update(mine)
    out.update({"device/" + k: v for k, v in claim.items()})
    out.update({"fleet/" + k: v for k, v in mine.items()})
    out.update(derived(status))
    return out


# ---------------------------------------------------------------------------- the table

def assigned(store: Any, devices: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, str]]:
    """device -> the labels an operator assigned (``devices``: only those)."""
    sql = "SELECT device_id, labels FROM device_labels"
    out: Dict[str, Dict[str, str]] = {}
    ids = None if devices is None else sorted(set(devices))
    chunks: List[Any] = [None] if ids is None else [ids[i:i + 500]
                                                    for i in range(0, len(ids), 500)]
    for chunk in chunks:
        rows = store.db.query(sql) if chunk is None else store.db.query(
            sql + " WHERE device_id IN ({})".format(", ".join("?" for _ in chunk)), chunk)
        for dev, text in rows:
            loaded = json.loads(text) if text else {}
            out[dev] = loaded if isinstance(loaded, dict) else {}
    return out


def assign(store: Any, device: str, set_: Mapping[str, str], remove: Iterable[str] = (),
           now: Optional[float] = None) -> Dict[str, str]:
    """Set and remove labels of ``device`` (which must be known); returns its labels now."""
    if store.device(device) is None:
        raise AgentError("unknown_device", "expected a device that reported to this fleet "
                         "database, found {!r} (fleet devices lists them)".format(device))
    checked = device_labels.check_labels(dict(set_), "fleet label {}".format(device))
    gone = [device_labels.check_key(k, "fleet label --remove") for k in remove]
    with store.transaction():
        current = assigned(store, [device]).get(device, {})
        current.update(checked)
        for k in gone:
            current.pop(k, None)
        if len(current) > device_labels.MAX_LABELS:
            raise AgentError("bad_label", "device {}: expected at most {} assigned labels, "
                             "found {}".format(device, device_labels.MAX_LABELS, len(current)))
        store.db.execute(
            "INSERT INTO device_labels (device_id, labels, updated) VALUES (?, ?, ?) ON "
            "CONFLICT (device_id) DO UPDATE SET labels = excluded.labels, updated = "
            "excluded.updated", (device, json.dumps(current, sort_keys=True),
                                 time.time() if now is None else now))
    return current


def changed_since(store: Any, since: float) -> List[Tuple[str, float]]:
    """(device, updated) of the assignments made after ``since`` (indexed)."""
    return [(r[0], float(r[1])) for r in store.db.query(
        "SELECT device_id, updated FROM device_labels WHERE updated > ? ORDER BY updated",
        (since,))]


def parse_assignments(items: Sequence[str]) -> Dict[str, str]:
    """``key=value`` arguments of ``fleet label``."""
    out: Dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise AgentError("bad_label", "fleet label: expected key=value (or --remove key), "
                             "found {!r}".format(item[:100]))
        out[key] = value
    return out
