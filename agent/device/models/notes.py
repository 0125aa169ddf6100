"""What the device keeps about its model names beside the journal: the operator's pins
(``jetson-agent models pin NAME VERSION``) and each name's last health (the app's report, or
the reason of an automatic rollback), in one small JSON file written atomically, so both
survive a daemon restart and ``models ls`` reads them without the daemon.

    {"pins": {"<name>": "<version>"}, "health": {"<name>": "ok" | "<problem>"}}

Bounded: at most MAX_NAMES pins and health entries, health texts of at most MAX_HEALTH
characters; a file that is unreadable or not of this shape is treated as empty (logged), so a
damaged file never stops the daemon.
"""

import json
import logging
import os
from typing import Any, Dict, Optional

from agent import fsio
from agent.errors import AgentError
from agent.wire.model_names import validate_name, validate_version

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

FILE = "model_notes.json"
MAX_NAMES = 256  # as many names as a models message carries
MAX_HEALTH = 200
MAX_FILE_BYTES = 256 * 1024


def read(path: Optional[str]) -> Dict[str, Dict[str, str]]:
    """``{"pins": {...}, "health": {...}}`` from ``path``; empty parts where it is missing or
    not of the expected shape (the entries that are valid are kept)."""
    out: Dict[str, Dict[str, str]] = {"pins": {}, "health": {}}
    if not path:
        return out
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        doc = json.loads(data.decode("utf-8")) if len(data) <= MAX_FILE_BYTES else None
    except FileNotFoundError:
        return out
    except (OSError, ValueError) as exc:
        log.warning("model notes %s unreadable, starting without pins: %s", path, exc)
        return out
    if not isinstance(doc, dict):
        log.warning("model notes %s: expected a JSON object, ignored", path)
        return out
    for name, version in list((doc.get("pins") or {}).items())[:MAX_NAMES]:
        try:
            out["pins"][validate_name(name)] = validate_version(version)
        except AgentError:
            continue
    for name, text in list((doc.get("health") or {}).items())[:MAX_NAMES]:
        if isinstance(name, str) and isinstance(text, str) and text:
            out["health"][name] = text[:MAX_HEALTH]
    return out


class ModelNotes(object):
    """Pins and health of the device's names; ``path`` None keeps them in memory only."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        doc = read(path)
        self.pins: Dict[str, str] = doc["pins"]
        self.health: Dict[str, str] = _Health(self, doc["health"])

    @classmethod
    def in_state_dir(cls, state_dir: Optional[str]) -> "ModelNotes":
        return cls(os.path.join(state_dir, FILE) if state_dir else None)

    def _save(self) -> None:
        if self.path is None:
            return
        data = json.dumps({"pins": self.pins, "health": self.health}, sort_keys=True)
        fsio.atomic_write(self.path, data.encode("utf-8"), mode=0o644)

    # ------------------------------------------------------------------ pins

    def pin(self, name: str, version: str) -> None:
        validate_name(name)
        validate_version(version)
        if name not in self.pins and len(self.pins) >= MAX_NAMES:
            raise AgentError("bad_argument", "expected at most {} pinned names, found {} "
                             "already (unpin one first)".format(MAX_NAMES, len(self.pins)))
        self.pins[name] = version
        self._save()

    def unpin(self, name: str) -> Optional[str]:
        """The version ``name`` was pinned to (None: it was not)."""
        was = self.pins.pop(validate_name(name), None)
        if was is not None:
            self._save()
        return was

    def check(self, name: str, version: str) -> None:
        """AgentError ``model_pinned`` when ``name`` is pinned to another version."""
        pinned = self.pins.get(name)
        if pinned is not None and pinned != version:
            raise AgentError("model_pinned", "{} is pinned to version {} on this device; "
                             "expected a job for {}@{}, found one for version {} (jetson-agent "
                             "models unpin {} lets it switch)".format(
                                 name, pinned, name, pinned, version, name),
                             {"name": name, "pinned": pinned, "version": version})

    # ------------------------------------------------------------------ health

class _Health(dict):  # type: ignore[type-arg]
    """name -> "ok" | the problem; an assignment that changes it is saved (an app reporting
    "ok" every second writes nothing)."""

    def __init__(self, notes: ModelNotes, initial: Dict[str, str]) -> None:
        super(_Health, self).__init__(initial)
        self.notes = notes

    def __setitem__(self, name: str, text: str) -> None:
        text = (text or "ok")[:MAX_HEALTH]
        if self.get(name) == text:
            return
        if name not in self and len(self) >= MAX_NAMES:
            super(_Health, self).pop(next(iter(self)))
        super(_Health, self).__setitem__(name, text)
        self.notes._save()

    def pop(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        """Forget ``name`` (a removed model), saved like an assignment."""
        if name not in self:
            return default
        out = super(_Health, self).pop(name)
        self.notes._save()
        return out
