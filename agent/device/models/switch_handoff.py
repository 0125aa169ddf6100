"""The switch's hand-off runner: the adapters' steps on threads, each posting a ``SwitchEvent``
back to the main loop (where ``switch_machine`` takes it through the transition table).

    start_handoff   prepare (every adapter), ``current`` -> the version, switch, confirm
    start_probe     the ``models.probe`` command
    start_revert    ``current`` back (or gone), every adapter's revert
    start_restore   prepare and switch of a version an operator went back to
    start_heal      heal() of the adapters that have it, with the committed versions
    commit          every adapter's commit (quick file work, on the main loop)
"""

import logging
import os
import threading
from typing import Any, Callable, Dict, List, NamedTuple, Optional

from agent.device.handoff import Entry, adapters_for
from agent.device.handoff.base import Adapter, ModelVersion
from agent.device.models.directory import ENGINE, ModelsDir, read_meta
from agent.errors import AgentError

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon


class SwitchEvent(NamedTuple):
    """A thread's outcome, handled on the main loop."""

    token: int
    kind: str  # "written" | "handoff" | "probe" | "reverted" | "restored" | "healed" | ...
    value: Any = None
    error: Optional[str] = None
    code: Optional[str] = None  # the AgentError's code, where one failed the step


class HandoffRunner(object):
    """``post(SwitchEvent)`` puts an outcome on the main loop's queue."""

    def __init__(self, models: ModelsDir, entries: List[Entry],
                 post: Callable[[SwitchEvent], None]) -> None:
        self.models, self.entries, self.post = models, entries, post

    def adapters(self, name: str) -> List[Adapter]:
        return adapters_for(self.entries, name)

    def version(self, name: str, version: Optional[str]) -> Optional[ModelVersion]:
        if version is None:
            return None
        path = self.models.version_dir(name, version)
        try:
            meta = read_meta(path)
        except (OSError, ValueError):
            meta = {}
        return ModelVersion(name, version, path, os.path.join(path, ENGINE), meta)

    def start_handoff(self, token: int, name: str, version: str,
                      previous: Optional[str]) -> None:
        adapters = self.adapters(name)
        new, prev = self.version(name, version), self.version(name, previous)
        assert new is not None

        def work() -> None:
            step = "prepare"
            try:
                for a in adapters:
                    a.prepare(new, prev)
                step = "switch"
                self.models.set_current(name, version)
                for a in adapters:
                    a.switch(new, prev)
                confirms = [a.confirm(new) for a in adapters]
                self.post(SwitchEvent(token, "handoff", confirms))
            except Exception as exc:  # noqa: BLE001 - the switch fails with the reason
                self.post(SwitchEvent(token, "handoff", step, error=text(exc),
                                      code=getattr(exc, "code", None)))

        _thread(work, "model-handoff")

    def start_probe(self, token: int, name: str, version: str, previous: Optional[str],
                    argv: List[str], timeout_s: float) -> None:
        from agent.device.handoff.command import model_env, run

        new, prev = self.version(name, version), self.version(name, previous)
        assert new is not None

        def work() -> None:
            try:
                run(argv, model_env(new, prev, "probe"), timeout_s)
                self.post(SwitchEvent(token, "probe", True))
            except Exception as exc:  # noqa: BLE001 - not yet: tried again
                self.post(SwitchEvent(token, "probe", False, error=text(exc)))

        _thread(work, "model-probe")

    def start_revert(self, token: int, name: str, version: str,
                     previous: Optional[str]) -> None:
        adapters = self.adapters(name)
        failed, prev = self.version(name, version), self.version(name, previous)
        assert failed is not None

        def work() -> None:
            errors = []
            try:
                if prev is not None and os.path.isdir(prev.path):
                    self.models.set_current(name, prev.version)
                else:
                    self.drop_current(name)
            except Exception as exc:  # noqa: BLE001
                errors.append(text(exc))
            for a in adapters:
                try:
                    a.revert(prev, failed)
                except Exception as exc:  # noqa: BLE001 - the others still revert
                    errors.append("{}: {}".format(a.kind, text(exc)))
            self.post(SwitchEvent(token, "reverted", errors))

        _thread(work, "model-revert")

    def start_restore(self, name: str, version: str, replaced: str) -> None:
        adapters = self.adapters(name)
        if not adapters:
            return
        new = self.version(name, version)
        assert new is not None
        prev = ModelVersion(name, replaced, self.models.version_dir(name, replaced), "", {})

        def work() -> None:
            error = None
            try:
                for a in adapters:
                    a.prepare(new, prev)
                for a in adapters:
                    a.switch(new, prev)
            except Exception as exc:  # noqa: BLE001 - reported as the name's health
                error = "hand-off of {}@{} after a rollback failed: {}".format(
                    name, version, text(exc))
            self.post(SwitchEvent(0, "restored", name, error=error))

        _thread(work, "model-restore")

    def start_heal(self, committed: Callable[[], List[Dict[str, Any]]]) -> bool:
        """Each adapter's heal() with the committed versions it serves (``committed()``: the
        journal's rows, read only where an adapter heals); False: nothing to do."""
        healers = [e for e in self.entries if type(e.adapter).heal is not Adapter.heal]
        rows = committed() if healers else []
        work_list = []
        for entry in healers:
            versions = [ModelVersion(r["name"], r["version"], "", "", {}) for r in rows
                        if entry.serves(r["name"])]
            if versions:
                work_list.append((entry.adapter, versions))
        if not work_list:
            return False

        def work() -> None:
            notes: Dict[str, str] = {}
            for adapter, versions in work_list:
                try:
                    notes.update(adapter.heal(versions))
                except Exception as exc:  # noqa: BLE001 - tried again at the next tick
                    log.warning("model hand-off %s: heal failed: %s", adapter.kind, text(exc))
            self.post(SwitchEvent(0, "healed", notes))

        _thread(work, "model-heal")
        return True

    def commit(self, name: str, version: str, previous: Optional[str]) -> None:
        """Each adapter's commit (Triton prunes its repository to keep_versions now that the
        version counts): quick file work, on the main loop, before any next switch starts."""
        new, prev = self.version(name, version), self.version(name, previous)
        assert new is not None
        for a in self.adapters(name):
            try:
                a.commit(new, prev)
            except Exception as exc:  # noqa: BLE001 - committed all the same; logged
                log.warning("model hand-off %s: commit of %s@%s: %s", a.kind, name, version,
                            text(exc))

    def drop_current(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.models.name_dir(name), "current"))
        except OSError:
            pass


def text(exc: BaseException) -> str:
    return exc.message if isinstance(exc, AgentError) else "{}: {}".format(
        type(exc).__name__, exc)


def _thread(work: Callable[[], None], name: str) -> None:
    threading.Thread(target=work, name=name, daemon=True).start()
