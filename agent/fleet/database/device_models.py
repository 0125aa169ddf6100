"""The models each device holds, as the controller knows them: from the device's retained
``models`` message (devices with the feature ``named_models``: every name with its version,
state and health), else from its status's ``active_engines`` (an older daemon: one entry per
active engine, shown under the name such a daemon's models get after an upgrade,
``sha-<first 12 hex>``). Also what a status says the device understands (``features``).

Pure functions for views (``entries``, ``text``, ``problems``), and the ``device_models`` table
(``save``, ``load``): one row per device holding its last models message.
"""

import json
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

from agent.wire import model_names, status_messages

FEATURE = model_names.FEATURE
MAX_FEATURES = 64


def features(status: Optional[Mapping[str, Any]]) -> frozenset:
    """The features a status's ``platform.features`` lists (strings only, bounded)."""
    plat = (status or {}).get("platform")
    listed = plat.get("features") if isinstance(plat, Mapping) else None
    if not isinstance(listed, list):
        return frozenset()
    return frozenset(f for f in listed[:MAX_FEATURES] if isinstance(f, str) and len(f) <= 64)


def named(status: Optional[Mapping[str, Any]]) -> bool:
    """Whether the device takes model names (job fields, rollback by name)."""
    return FEATURE in features(status)


def newer(last: Optional[Mapping[str, Any]], msg: Mapping[str, Any]) -> bool:
    """Whether ``msg`` may replace ``last`` (a models message of an older boot may not)."""
    return last is None or not status_messages.status_is_stale(last.get("boot"), msg)


def _num(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def entries(status: Optional[Mapping[str, Any]], models: Optional[Mapping[str, Any]]
            ) -> List[Dict[str, Any]]:
    """Every model the device holds, sorted by name: {name, version, state, previous,
    precision, engine_key, job_id, activated, health, model, legacy}. From ``models`` when the
    device sent one, else from ``status["active_engines"]`` (``legacy`` True, state
    ``active``)."""
    out: List[Dict[str, Any]] = []
    if isinstance(models, Mapping) and isinstance(models.get("models"), list):
        for m in models["models"]:
            if not isinstance(m, Mapping):
                continue
            out.append({"name": str(m.get("name")), "version": str(m.get("version")),
                        "state": str(m.get("state") or "-"), "previous": m.get("previous"),
                        "precision": m.get("precision"), "engine_key": m.get("engine_key"),
                        "job_id": m.get("job_id"), "activated": _num(m.get("activated")),
                        "health": str(m.get("health") or "ok"),
                        "model": m.get("model"), "legacy": False})
    else:
        for e in (status or {}).get("active_engines") or []:
            sha = e.get("model") if isinstance(e, Mapping) else None
            if not isinstance(sha, str) or len(sha) != 64:
                continue
            out.append({"name": model_names.derived_name(sha),
                        "version": model_names.default_version(sha), "state": "active",
                        "previous": None, "precision": e.get("precision"),
                        "engine_key": e.get("engine_key"), "job_id": e.get("job_id"),
                        "activated": _num(e.get("activated")), "health": "ok", "model": sha,
                        "legacy": True})
    return sorted(out, key=lambda m: (m["name"], m["version"]))


def text(items: Sequence[Mapping[str, Any]]) -> str:
    """``name@version (state)`` for every model, comma separated; "-" for none."""
    return ", ".join("{} ({})".format(model_names.label(m["name"], m["version"]), m["state"])
                     for m in items) or "-"


def problems(items: Sequence[Mapping[str, Any]]) -> List[str]:
    """``name@version: problem`` for each model whose health is not ok."""
    return ["{}: {}".format(model_names.label(m["name"], m["version"]), m["health"])
            for m in items if m.get("health") not in (None, "ok")]


# ---------------------------------------------------------------------------- the table

def save(store: Any, messages: Mapping[str, Mapping[str, Any]],
         now: Optional[float] = None, reset: Sequence[str] = ()) -> None:
    """device -> its models message, upserted (one row per device). A message of an older
    boot than the stored one is dropped (a late retained copy), except from the devices of
    ``reset`` (re-imaged: born again with a lower boot)."""
    if not messages:
        return
    now = time.time() if now is None else now
    stored = load(store, [d for d in messages if d not in reset])
    rows = [(dev, msg.get("boot"), json.dumps(dict(msg), sort_keys=True), now)
            for dev, msg in sorted(messages.items()) if newer(stored.get(dev), msg)]
    store.db.executemany(
        "INSERT INTO device_models (device_id, boot, message, updated) VALUES (?, ?, ?, ?) "
        "ON CONFLICT (device_id) DO UPDATE SET boot = excluded.boot, message = "
        "excluded.message, updated = excluded.updated", rows)


def load(store: Any, devices: Optional[Sequence[str]] = None) -> Dict[str, Dict[str, Any]]:
    """device -> its last models message (``devices``: only those)."""
    sql = "SELECT device_id, message FROM device_models"
    out: Dict[str, Dict[str, Any]] = {}
    ids = None if devices is None else sorted(set(devices))
    chunks = [None] if ids is None else [ids[i:i + 500] for i in range(0, len(ids), 500)]
    for chunk in chunks:
        if chunk is None:
            rows = store.db.query(sql)
        else:
            rows = store.db.query(sql + " WHERE device_id IN ({})".format(
                ", ".join("?" for _ in chunk)), chunk)
        for dev, message in rows:
            loaded = json.loads(message) if message else None
            if isinstance(loaded, dict):
                out[dev] = loaded
    return out
