"""The ``remove`` device command (feature ``remove_model``): a model name uninstalled from the
device, as a deployment's ``on_leave: remove`` asks when the device left its selector.

In order: refused with ``model_switching`` while the app is switching versions of that name (a
pending version: the hand-off, the app's confirmation or a rollback are under way); the
journal forgets every kept version (rollback targets included; its rejections stay); the
name's directory is moved aside in one rename (the models directory never shows half a name;
a restart's reconcile deletes what this process could not); then, off the main loop, the
hand-off entries that serve the name are told to let it go (``Adapter.revert`` with no
previous version: Triton unloads it, a command adapter runs its revert) and the moved
directory is deleted. Removing a name the device does not hold answers ``absent`` (a repeated
command is harmless).
"""

import logging
import os
import shutil
import threading
import time
from typing import Any, Dict, List, Optional

from agent.device.handoff import adapters_for
from agent.device.handoff.base import ModelVersion
from agent.device.models.directory import ENGINE, REMOVED_PREFIX, read_meta
from agent.errors import AgentError
from agent.wire.model_names import validate_name

log = logging.getLogger("agent.device.daemon")


def remove(switch: Any, name: str) -> Dict[str, Any]:
    """{name, removed: [versions], state: removed | absent}."""
    validate_name(name)
    pending = switch.pending
    if pending is not None and pending.name == name:
        raise AgentError("model_switching", "expected {} to be idle before removing it, found "
                         "version {} {} (the app is switching to it): remove it once the "
                         "switch ended".format(name, pending.version, pending.phase))
    models, journal = switch.models, switch.journal
    active = journal.active_version(name)
    versions = journal.forget_model(name)
    aside = _move_aside(models.name_dir(name))
    if not versions and aside is None:
        return {"name": name, "removed": [], "state": "absent"}
    mv: Optional[ModelVersion] = None
    if active is not None:
        path = os.path.join(aside or models.name_dir(name), active["version"])
        try:
            meta = read_meta(path)
        except (OSError, ValueError):
            meta = {}
        mv = ModelVersion(name, active["version"], path, os.path.join(path, ENGINE), meta)
    adapters = adapters_for(switch.entries, name) if mv is not None else []
    switch.health.pop(name, None)
    switch.notes.unpin(name)  # a pin of a removed name would refuse its next deployment
    switch.disk_health.pop(name, None)
    switch.live.forget(name)  # the app's donated inputs of the name go with it
    switch.changed()  # the models message without the name
    threading.Thread(target=_let_go, args=(adapters, mv, aside), name="model-remove",
                     daemon=True).start()
    log.info("model %s removed (versions %s)", name, ", ".join(versions) or "none kept")
    return {"name": name, "removed": versions, "state": "removed"}


def _move_aside(path: str) -> Optional[str]:
    if not os.path.lexists(path):
        return None
    aside = os.path.join(os.path.dirname(path), "{}{}-{}".format(
        REMOVED_PREFIX, os.path.basename(path), int(time.time() * 1000)))
    os.rename(path, aside)
    return aside


def _let_go(adapters: List[Any], mv: Optional[ModelVersion], aside: Optional[str]) -> None:
    for a in adapters:
        try:
            a.revert(None, mv)
        except Exception as exc:  # noqa: BLE001 - logged: the name is gone from the device
            log.warning("hand-off %s: letting %s go after its removal failed: %s", a.kind,
                        mv.name if mv else "?", exc)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
