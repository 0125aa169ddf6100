"""``fleet devices ls`` as data: every device with its platform, models, labels, telemetry
and admission mark, from the registry of ``fleet serve`` (its database) when one runs, else
from what the broker retains (each birth's signature judged as the service would).
"""

import os
from typing import Any, Callable, Dict, List, Optional

from agent import fleet
from agent.errors import AgentError
from agent.fleet.database import device_models
from agent.wire.topics import TopicInfo


def devices(url: Optional[str], connect: Callable[[], Any], wait: float,
            selector: Any = None) -> List[Dict[str, Any]]:
    """The rows (``device_rows`` plus ``admission``: the device's mark, None for a member
    with nothing to check), only those ``selector`` matches. ``url``: the registry's
    database, else the broker (listening ``wait`` s for telemetry)."""
    seen = None
    marks: Dict[str, str] = {}
    assigned: Dict[str, Dict[str, str]] = {}
    if url:
        directory, seen, marks, assigned = _db_directory(url)
    else:
        conn = connect()
        rows_keys = _admission_view()
        conn.gate = lambda info, ev: _mark(marks, rows_keys, info, ev)
        try:
            directory = fleet.discover(conn, telemetry_wait=max(0.0, wait))
        finally:
            conn.close()
    rows = device_rows(directory, seen, assigned)
    if selector is not None:
        rows = [r for r in rows if selector.matches(r["labels"])]
    for r in rows:
        r["admission"] = marks.get(r["device"])
    return rows


def device_rows(directory: fleet.DeviceDirectory,
                last_seen: Optional[Dict[str, Any]] = None,
                assigned: Optional[Dict[str, Dict[str, str]]] = None) -> List[Dict[str, Any]]:
    """``last_seen``: device -> when the registry last heard from it (default: the time of
    its last status). An offline device keeps the board its last full status named.
    ``assigned``: the labels an operator gave each device (fleet label; the registry's)."""
    from agent.fleet.deployments import labels

    rows = []
    for dev in directory.known():
        st = directory.status[dev]
        plat = st.get("platform") or {}
        models = device_models.entries(st, directory.models.get(dev))
        tele = directory.telemetry.get(dev)
        rows.append({
            "device": dev, "online": st.get("online"), "boot": st.get("boot"),
            "since": st.get("ts"), "reason": st.get("reason"),
            "board": plat.get("board"), "jetpack": plat.get("jetpack"),
            "tensorrt": plat.get("tensorrt"), "backend": plat.get("backend"),
            "precisions": plat.get("precisions"), "agent_version": st.get("agent_version"),
            "active_engines": st.get("active_engines") or [],
            "features": sorted(device_models.features(st)),
            "models": models,
            "models_text": device_models.text(models),
            "telemetry": tele,
            "last_seen": (last_seen or {}).get(dev, st.get("ts")),
            "labels": labels.selectable(st, (assigned or {}).get(dev)),
        })
    return rows


def _db_directory(url: str) -> Any:
    """(directory, device -> last seen) from the registry of 'fleet serve'."""
    from agent.fleet.database.store import Store
    from agent.fleet.deployments import labels

    store = Store(url, schema="read")
    try:
        directory = fleet.DeviceDirectory()
        directory.models.update(device_models.load(store))
        seen: Dict[str, Any] = {}
        for dev in store.devices():
            directory.status[dev["device"]] = dev["status"]
            seen[dev["device"]] = dev["last_seen"]
            if dev["telemetry"]:
                directory.telemetry[dev["device"]] = dev["telemetry"]
        keys = store.device_keys()
        marks = {d: str((keys.get(d) or {}).get("state") or "") or None for d in seen}
        return directory, seen, {d: m for d, m in marks.items() if m != "admitted" and m}, \
            labels.assigned(store)
    finally:
        store.close()


# What a device's birth may say and still be listed as a fleet member (None: nothing to
# check, as before admission existed).
MEMBERS = (None, "admitted", "signed", "legacy")


def _admission_view() -> Any:
    """(pinned rows, keys, policy) to judge births read from the broker by: the default
    registry's ``device_keys`` when there is one, $JETSON_AGENT_FLEET_ADMISSION_KEYS and
    $JETSON_AGENT_FLEET_ADMISSION."""
    from agent.fleet.admission import admission
    from agent.fleet.database.db import sqlite_path
    from agent.fleet.database.store import Store, default_db_url

    rows: Dict[str, Any] = {}
    url = default_db_url()
    if os.path.exists(sqlite_path(url)):
        try:
            store = Store(url)
            try:
                rows = store.device_keys()
            finally:
                store.close()
        except (AgentError, Exception):  # noqa: BLE001 - a registry we cannot read: none
            rows = {}
    keys: Dict[str, bytes] = {}
    path = os.environ.get("JETSON_AGENT_FLEET_ADMISSION_KEYS")
    if path:
        try:
            keys = admission.load_keys_file(path)
        except AgentError:
            keys = {}
    return rows, keys, os.environ.get("JETSON_AGENT_FLEET_ADMISSION") or "manual"


def _mark(marks: Dict[str, str], rows_keys: Any, info: TopicInfo, ev: Any) -> bool:
    """The connection's gate while ``fleet devices`` reads the broker: every message passes;
    each birth's signature is judged (``admission.membership``)."""
    from agent.fleet.admission import admission

    if info.kind == "status" and info.device and ev.payload:
        marks[info.device] = admission.membership(info.device, ev, *rows_keys)
    return True
