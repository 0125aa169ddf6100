"""What operators and apps ask of a model name that is not being switched: a rollback to a
kept version, a retry of a rejected one, pins, a health report on the active version, and the
models list (``models ls``, the models message). A request on the version in hand goes to the
switch's table instead (``switch_states``: ``operator_rollback``, ``commit``, ``healthy``)."""

import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional

from agent.device.journal.models import UNCONFIRMED
from agent.device.models import guard as models_guard
from agent.device.models import switch_states as states
from agent.device.models.directory import ModelsDir
from agent.device.models.live_check import LiveCheck
from agent.device.models.notes import ModelNotes
from agent.device.models.sets import ModelSets
from agent.device.models.switch_handoff import HandoffRunner
from agent.device.models.switch_machine import SwitchMachine
from agent.errors import AgentError
from agent.wire.model_names import validate_name, validate_version

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon


class ModelRequests(object):
    """``member_failed(name, version, why)``: the name's model set fails with it."""

    def __init__(self, journal: Any, models: ModelsDir, machine: SwitchMachine,
                 runner: HandoffRunner, notes: ModelNotes, sets: ModelSets, live: LiveCheck,
                 handoff_notes: Dict[str, str], changed: Callable[[], None],
                 member_failed: Callable[[str, str, str], None]) -> None:
        self.journal, self.models, self.machine, self.runner = journal, models, machine, runner
        self.notes, self.sets, self.live, self.handoff_notes = notes, sets, live, handoff_notes
        self.changed, self.member_failed = changed, member_failed
        # name -> what the last models list said of its files (models_guard): a version whose
        # engine went missing or corrupt is a health problem, rechecked by the switch's tick.
        self.disk_health: Dict[str, str] = {}
        self.last_disk_check = time.monotonic()

    def rollback(self, name: str, version: Optional[str] = None,
                 override_pin: bool = False) -> Dict[str, Any]:
        """Back to a kept version (the previous one unless ``version``): the journal and
        ``current`` at once, the hand-off of the restored version on a thread.
        AgentError no_previous_version; model_pinned for a name pinned to another version
        (``override_pin``: the pin itself switching)."""
        validate_name(name)
        if version is not None:
            validate_version(version)
        pinned = self.notes.pins.get(name)
        if pinned is not None and not override_pin and version != pinned:
            raise AgentError("model_pinned", "{} is pinned to version {} on this device; "
                             "expected a rollback to it, or jetson-agent models unpin {} "
                             "first".format(name, pinned, name))
        p = self.machine.pending
        if p is not None and p.name == name:
            self.machine.fire(p, states.OPERATOR_ROLLBACK, reason="rolled back by an operator")
            return {"name": name, "version": p.previous, "replaced": p.version,
                    "state": "rolling_back"}
        active = self.journal.active_version(name)
        kept = [r for r in self.journal.model_versions(name) if not r["active"]]
        if version is not None:
            kept = [r for r in kept if r["version"] == version]
        elif active is not None and active["previous"]:
            kept.sort(key=lambda r: r["version"] != active["previous"])
        if active is None or not kept:
            raise AgentError("no_previous_version", "expected a kept version of {} to go back "
                             "to{}, found {}".format(
                                 name, " ({})".format(version) if version else "",
                                 "no model of that name" if active is None else
                                 "only {} (kept: {})".format(active["version"], ", ".join(
                                     r["version"] for r in self.journal.model_versions(name)))))
        target = kept[0]["version"]
        if not os.path.isdir(self.models.version_dir(name, target)):
            raise AgentError("no_previous_version", "expected {}@{} in the models directory, "
                             "found it missing".format(name, target))
        self.journal.restore_version(name, target)
        self.models.set_current(name, target)
        self.models.remove_version(name, active["version"])
        self.runner.start_restore(name, target, active["version"])
        self.changed()
        restored = self.journal.active_version(name) or {}
        return {"name": name, "version": target, "replaced": active["version"],
                "model": restored.get("model"), "engine_key": restored.get("engine_key"),
                "precision": restored.get("precision"), "job_id": restored.get("job_id")}

    def retry(self, name: str, version: str) -> Dict[str, Any]:
        """An operator lets a rejected version be activated again."""
        validate_name(name)
        validate_version(version)
        forgotten = self.journal.forget_rejected(name, version)
        self.changed()
        return {"name": name, "version": version, "forgotten": forgotten}

    def report_health(self, name: str, version: Optional[str], ok: bool,
                      detail: str) -> Dict[str, Any]:
        """The app's report on the active (committed) version: the name's health."""
        active = self.journal.active_version(validate_name(name))
        if active is None or (version is not None and version != active["version"]):
            raise AgentError("not_pending", "expected a health report on {}'s active version "
                             "{}, found version {!r}".format(
                                 name, active["version"] if active else "(none)", version))
        self.notes.health[name] = "ok" if ok else (detail or "unhealthy")[:200]
        if not ok:
            self.member_failed(name, active["version"], "{}@{} reported unhealthy: {}".format(
                name, active["version"], detail or "unhealthy"))
        self.changed()
        return {"name": name, "version": active["version"], "state": active["state"]}

    # ------------------------------------------------------------------ pins

    def pin(self, name: str, version: str) -> Dict[str, Any]:
        """Pin ``name`` to ``version``: jobs to another version are refused (model_pinned);
        the name switches to ``version`` now if that is a kept version and not the active one.
        AgentError no_previous_version when it is neither active nor kept."""
        validate_name(name)
        validate_version(version)
        active = self.journal.active_version(name)
        kept = [r["version"] for r in self.journal.model_versions(name)]
        if version not in kept:
            raise AgentError("no_previous_version", "expected a version of {} this device "
                             "keeps to pin, found {} (kept: {})".format(
                                 name, version, ", ".join(kept) or "none"))
        p = self.machine.pending
        if p is not None and p.name == name and p.version != version:
            raise AgentError("not_pending", "{}@{} is being switched right now; expected no "
                             "switch of {} in progress, pin it after it ends".format(
                                 name, p.version, name))
        switched = None
        if active is not None and active["version"] != version:
            switched = self.rollback(name, version, override_pin=True)
        self.notes.pin(name, version)
        log.info("model %s pinned to %s", name, version)
        self.changed()
        return {"name": name, "version": version, "pinned": True,
                "switched_from": switched["replaced"] if switched else None}

    def unpin(self, name: str) -> Dict[str, Any]:
        was = self.notes.unpin(name)
        self.changed()
        return {"name": name, "pinned": False, "was": was}

    # ------------------------------------------------------------------ reports

    def models_list(self) -> List[Dict[str, Any]]:
        """Per name, what the models message and ``models ls`` show."""
        out = []
        rejected: Dict[str, List[str]] = {}
        unconfirmed: Dict[str, List[str]] = {}
        for r in self.journal.rejected_versions():
            (unconfirmed if r["state"] == UNCONFIRMED else rejected).setdefault(
                r["name"], []).append(r["version"])
        problems = models_guard.check_models(self.models.root)
        self.last_disk_check = time.monotonic()
        self.disk_health.clear()
        for row in self.journal.active_versions():
            on_disk = models_guard.health(problems, row["name"], row["version"])
            self.disk_health[row["name"]] = on_disk
            app = self.notes.health.get(row["name"], "ok")
            problem = self.live.problem(row["name"], row["version"]) or on_disk
            field = self.live.summary(row["name"], row["version"])  # INT8 ranges in the field
            out.append({"name": row["name"], "version": row["version"], "state": row["state"],
                        "previous": row["previous"], "precision": row["precision"],
                        "engine_key": row["engine_key"], "job_id": row["job_id"],
                        "activated": row["activated"],
                        "health": (app if app != "ok" else problem)[:1024],
                        "pinned": self.notes.pins.get(row["name"]),
                        **({"handoff": self.handoff_notes[row["name"]][:512]}
                           if row["name"] in self.handoff_notes else {}),
                        "rejected": rejected.get(row["name"], [])[-16:],
                        "unconfirmed": unconfirmed.get(row["name"], [])[-16:],
                        "retries": int(row["info"].get("unconfirmed_retries") or 0),
                        **({"field": field} if field else {})})
        rec = self.sets.open or {"members": {}}
        for entry in out:
            if (rec["members"].get(entry["name"]) or {}).get("version") == entry["version"]:
                entry["set"] = {"id": rec["id"], "state": "open"}  # may still revert
        return out[:256]
