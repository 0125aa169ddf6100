"""Commit or roll back a pending model version: the pure state machine (no I/O, no clock of
its own). A version activated with a hand-off or a probe configured is ``pending`` until every
confirmation it needs has come, and is rolled back on the first failure or at its deadline:

    needs            confirmed by
    "handoff"        every adapter's switch done and none of their confirm() said False
    "probe"          the ``models.probe`` command exited 0 (retried until the deadline)
    "app"            the app reported the version healthy (``models.app_confirms``)
    "live"           the live check on the app's donated inputs passed (``live_check``)

An explicit commit (the app's or ``jetson-agent models commit``) commits at once, save while the
live check runs: its verdict comes first (a refusal still refuses; with none by the deadline
the commit stands); an unhealthy report, an adapter that failed or said False, or the
deadline rolls back. With no needs (no hand-off, no probe, no app confirmation) a version
commits at once: the accuracy gate was the check. ``agent.device.models.switch`` drives it.
"""

from typing import FrozenSet, List, NamedTuple, Optional, Set

WAIT, COMMIT, ROLLBACK = "wait", "commit", "rollback"


class Decision(NamedTuple):
    action: str  # WAIT | COMMIT | ROLLBACK
    reason: str = ""


def needs(has_handoff: bool, has_probe: bool, app_confirms: bool) -> FrozenSet[str]:
    out: Set[str] = set()
    if has_handoff:
        out.add("handoff")
    if has_probe:
        out.add("probe")
    if app_confirms:
        out.add("app")
    return frozenset(out)


class CommitState(object):
    """One pending version. Feed it what happened; ``decide(now)`` says what to do."""

    def __init__(self, need: FrozenSet[str], deadline: float, timeout_s: float) -> None:
        self.need = need
        self.deadline = deadline
        self.timeout_s = timeout_s
        self.confirmed: Set[str] = set()
        self.failure: Optional[str] = None
        self.committed_by: Optional[str] = None

    def on_handoff(self, confirms: List[Optional[bool]], error: Optional[str] = None) -> None:
        """The adapters' switch finished (``error``: one raised) with their confirm()s."""
        if error is not None:
            self._fail("hand-off failed: " + error)
        elif any(c is False for c in confirms):
            self._fail("a hand-off adapter reported the version not ready")
        else:
            self.confirmed.add("handoff")

    def on_probe(self, ok: bool) -> None:
        if ok:
            self.confirmed.add("probe")

    def on_health(self, ok: bool, detail: str = "") -> None:
        if ok:
            self.confirmed.add("app")
        else:
            self._fail("the app reported it unhealthy" + (": " + detail if detail else ""))

    def on_live(self, ok: bool, reason: str = "") -> None:
        if ok:
            self.confirmed.add("live")
        elif self.failure is None:  # awaited even by an explicit commit: it still refuses
            self.failure = reason

    def on_commit(self, by: str) -> None:
        if self.failure is None:
            self.committed_by = by

    def _fail(self, reason: str) -> None:
        if self.failure is None and self.committed_by is None:
            self.failure = reason

    def decide(self, now: float) -> Decision:
        if self.failure is not None:
            return Decision(ROLLBACK, self.failure)
        if self.committed_by is not None:
            if "live" in self.need and "live" not in self.confirmed and now < self.deadline:
                return Decision(WAIT)  # the app's commit never skips the agent's own check
            return Decision(COMMIT, "committed by " + self.committed_by)
        if self.need <= self.confirmed:
            return Decision(COMMIT, "confirmed by " + (", ".join(sorted(self.need)) or
                                                        "the accuracy gate"))
        if now >= self.deadline:
            waiting = ", ".join(sorted(self.need - self.confirmed))
            return Decision(ROLLBACK, "no confirmation ({}) within {:g} s".format(
                waiting, self.timeout_s))
        return Decision(WAIT)

    def remaining(self, now: float) -> float:
        return max(0.0, self.deadline - now)
