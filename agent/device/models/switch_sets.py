"""The open model set, watched from the switch's main loop: committed once every member is,
reverted (every member back to the version the set replaced) when one fails or its deadline
passes. The decision is ``model_sets.decide``'s (pure); this is where it meets the switch."""

import logging
import time
from typing import Any, Callable, Dict, Optional, Tuple

from agent.device.models import sets as model_sets
from agent.device.models.switch_states import ROLLING_BACK
from agent.errors import AgentError

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon


class SetWatcher(object):
    """``pending()`` is the switch in hand (or None); ``revert_pending(p, why)`` rolls it back
    with the set; ``rollback(name, version)`` takes another name back (an operator's
    rollback)."""

    def __init__(self, sets: model_sets.ModelSets, journal: Any, health: Dict[str, str],
                 changed: Callable[[], None], clock: Callable[[], float],
                 pending: Callable[[], Any], revert_pending: Callable[[Any, str], None],
                 rollback: Callable[[str, str], Any]) -> None:
        self.sets, self.journal, self.health, self.changed = sets, journal, health, changed
        self.clock, self.pending = clock, pending
        self.revert_pending, self.rollback = revert_pending, rollback
        self.last_check = 0.0

    def tick(self) -> None:
        try:
            self.check()
        except (KeyError, TypeError, ValueError) as exc:  # a damaged model_set.json
            log.error("model set record unreadable (%s): closed, its names stay as they are",
                      exc)
            self.sets.open = None
            self.sets.close(model_sets.REVERT)

    def check(self, force: bool = False) -> None:
        """The open set committed, or reverted (model_sets.decide); at most once a second
        unless ``force``."""
        rec = self.sets.open
        if rec is None or (not force and time.monotonic() - self.last_check < 1.0):
            return
        self.last_check = time.monotonic()
        active = {r["name"]: (r["version"], r["state"]) for r in self.journal.active_versions()}
        p = self.pending()
        if p is not None and p.name in rec["members"] and p.phase == ROLLING_BACK and \
                not rec.get("failed"):
            return  # its own rollback ends first (``member_failed`` fails the set)
        action, reason = model_sets.decide(rec, active, self.clock())
        if action == model_sets.COMMITTED:
            log.info("model set %s committed (%s)", rec["id"], ", ".join(rec["names"]))
            self.sets.close(model_sets.COMMITTED)
            self.changed()
        elif action == model_sets.REVERT:
            self._revert(rec, active, reason)

    def member_failed(self, name: str, version: str, why: str) -> None:
        """``name@version`` failed (rolled back, reported unhealthy): its set, if it is a
        member at that version, fails and reverts."""
        if (self.sets.member(name) or {}).get("version") == version:
            self.sets.fail(why)
            self.check(force=True)

    def state_of(self, set_id: str) -> str:
        """open | committed | reverted, checked now."""
        self.check(force=True)
        if self.sets.open and self.sets.open["id"] == set_id:
            return "open"
        return "committed" if self.sets.closed == (set_id, model_sets.COMMITTED) else \
            "reverted"

    def _revert(self, rec: Dict[str, Any], active: Dict[str, Tuple[str, str]],
                reason: str) -> None:
        """Every member still at its set version back to the version the set replaced."""
        log.warning("model set %s: reverting every name: %s", rec["id"], reason)
        self.sets.close(model_sets.REVERT)
        why = "model set {} reverted: {}".format(rec["id"], reason)
        for name, version, before in model_sets.revert_plan(rec, active):
            p = self.pending()
            if p is not None and p.name == name and p.version == version:
                self.revert_pending(p, why)  # its app never judged it: not refused next time
                continue
            problem: Optional[str] = None
            try:
                if before is None:
                    raise AgentError("no_previous_version", "{} had no version before the "
                                     "set".format(name))
                self.rollback(name, before)
            except AgentError as exc:
                log.warning("model set %s: %s stays at %s: %s", rec["id"], name, version,
                            exc.message)
                problem = exc.message
            self.health[name] = "{}; stays at {}: {}".format(why, version, problem) \
                if problem else "rolled back from {}: {}".format(version, why)
        self.changed()

