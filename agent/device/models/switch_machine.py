"""The switch in hand (one ``Pending`` at a time), driven through ``switch_states``' table:
``fire(p, event)`` looks up the row for the version's phase, moves it to the next phase and
runs the row's actions in order (``_do_<action>``): the journal writes, the hand-off runner's
threads, the job's end. Nothing here decides; the table and ``commit_logic`` do."""

import logging
import time
from typing import Any, Callable, Dict, List, Optional

from agent.device.jobs.run import Run
from agent.device.journal.models import UNCONFIRMED_PREFIX
from agent.device.models import commit_logic
from agent.device.models import switch_states as states
from agent.device.models.directory import ModelsDir
from agent.device.models.live_check import LiveCheck
from agent.device.models.switch_handoff import HandoffRunner, SwitchEvent
from agent.device.models.switch_jobs import JobEnds
from agent.errors import AgentError

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

PROBE_EVERY_S = 2.0
THREAD_EVENTS = ("handoff", "probe", "reverted", "live")  # SwitchEvent kinds of a Pending


class Pending(object):
    """The switch in hand (one at a time)."""

    def __init__(self, token: int, name: str, version: str, previous: Optional[str],
                 run: Optional[Run], state: commit_logic.CommitState,
                 phase: str = states.HANDOFF) -> None:
        self.token, self.name, self.version, self.previous = token, name, version, previous
        self.run, self.state = run, state
        self.result: Optional[Dict[str, Any]] = None  # the worker's, for the job's result
        self.phase = phase  # switch_states' phases
        self.probe_running = False
        self.last_probe = 0.0
        self.probe_failed = False  # the probe ran and said no: an answer, not silence
        # (until it says yes: a probe that passed leaves only the app's silence)
        self.handoff_running = False  # an adapter still in switch(): never run a second
        self.retries = 0  # commit windows reopened because nobody answered (journal info)
        self.running: Optional[str] = None  # the version the live check compares with
        self.refusal: Optional[AgentError] = None  # the code a refusal ends the job with


class SwitchMachine(object):
    """``m``: the ``models`` config section; ``shared.run``: the daemon's job in hand;
    ``health``: name -> "ok" | its last problem; ``handoff_notes``: name -> the last thing an
    adapter's heal() did; ``rolled_back(name, version, why)``: its model set fails with it."""

    def __init__(self, m: Any, journal: Any, models: ModelsDir, runner: HandoffRunner,
                 live: LiveCheck, shared: Any, jobs: JobEnds, health: Dict[str, str],
                 handoff_notes: Dict[str, str], changed: Callable[[], None],
                 rolled_back: Callable[[str, str, str], None], clock: Callable[[], float],
                 on_step: Callable[[str], None]) -> None:
        self.m, self.journal, self.models, self.runner = m, journal, models, runner
        self.live, self.shared, self.jobs, self.health = live, shared, jobs, health
        self.handoff_notes, self.changed, self.rolled_back = handoff_notes, changed, rolled_back
        self.clock, self.on_step = clock, on_step
        self.token = 0
        self.pending: Optional[Pending] = None

    def next_token(self) -> int:
        self.token += 1
        return self.token

    def needs(self, name: str) -> frozenset:
        return commit_logic.needs(bool(self.runner.adapters(name)), bool(self.m.probe),
                                  "*" in self.m.app_confirms or name in self.m.app_confirms)

    def track(self, run: Optional[Run], name: str, version: str, previous: Optional[str],
              deadline: float, need: Optional[frozenset] = None,
              phase: str = states.HANDOFF) -> Pending:
        state = commit_logic.CommitState(self.needs(name) if need is None else need, deadline,
                                         self.m.commit_timeout_s)
        self.pending = Pending(self.next_token(), name, version, previous, run, state, phase)
        return self.pending

    def fire(self, p: Pending, event: str, value: Any = None, reason: str = "") -> None:
        """The row for (p.phase, event): p moves on, its actions run in order."""
        try:
            row = states.step(p.phase, event)
        except states.NoTransition as exc:
            log.warning("model %s@%s: %s (ignored)", p.name, p.version, exc)
            return
        p.phase = row.next
        for action in row.actions:
            getattr(self, "_do_" + action)(p, value, reason)

    def on_event(self, ev: SwitchEvent) -> None:
        """A thread's outcome for the version in hand (another token: a stale one, dropped)."""
        p = self.pending
        if p is None or ev.token != p.token:
            return
        if ev.kind == "handoff":
            failed = ev.error is not None and ev.value == "prepare"
            self.fire(p, states.PREPARE_FAILED if failed else states.HANDOFF_DONE, ev)
        elif ev.kind == "probe":
            self.fire(p, states.PROBE_PASSED if ev.value else states.PROBE_FAILED, ev)
        elif ev.kind == "reverted":
            self.fire(p, states.REVERTED, ev.value or [])
        elif ev.kind == "live":
            self.fire(p, states.LIVE, ev.value or {})

    def tick(self) -> None:
        p = self.pending
        if p is None:
            return
        if states.probe_due(p.state, p.probe_running, time.monotonic() - p.last_probe,
                            PROBE_EVERY_S):
            self.fire(p, states.PROBE_DUE)
        if self.pending is p:
            self.fire(p, states.TICK)

    # ------------------------------------------------------------------ what happened

    def _do_handoff_ended(self, p: Pending, ev: SwitchEvent, reason: str) -> None:
        p.handoff_running = False

    def _do_probe_ended(self, p: Pending, ev: SwitchEvent, reason: str) -> None:
        p.probe_running = False

    def _do_note_handoff(self, p: Pending, ev: SwitchEvent, reason: str) -> None:
        p.state.on_handoff(ev.value if ev.error is None else [], ev.error)

    def _do_note_probe(self, p: Pending, ev: SwitchEvent, reason: str) -> None:
        p.state.on_probe(bool(ev.value))
        p.probe_failed = not ev.value and "probe" not in p.state.confirmed
        if not ev.value:
            log.info("model %s@%s: probe not yet: %s", p.name, p.version, ev.error)

    def _do_note_health(self, p: Pending, value: Any, reason: str) -> None:
        ok, detail = value
        p.state.on_health(ok, detail)

    def _do_note_commit(self, p: Pending, by: str, reason: str) -> None:
        p.state.on_commit(by)

    def _do_note_live(self, p: Pending, figures: Dict[str, Any], reason: str) -> None:
        """The live check's figures: a confirmation, or the version's refusal."""
        if p.result is not None:
            p.result["live_check"] = figures
        self.note_live(p.name, p.version, figures)
        if figures.get("skipped") or figures.get("passed"):
            p.state.on_live(True)
            return
        why = "live check on {} donated samples against {}: top-1 agreement {} (at least " \
            "{:g}), {} error {}{}; worst samples {}".format(
                figures["samples"], p.running, "n/a" if figures["agreement"] is None else
                "{:.3f}".format(figures["agreement"]), figures["min_agreement"],
                figures["error_stat"], "NaN or infinite" if figures["error"] is None else
                "{:.4g}".format(figures["error"]),
                " (at most {:g})".format(figures["max_error"]) if figures["max_error"] else "",
                figures["worst"])
        p.refusal = AgentError("live_check_failed", why, {"live_check": {
            k: figures[k] for k in ("samples", "agreement", "error", "error_stat",
                                    "min_agreement", "max_error", "worst", "running")}})
        p.state.on_live(False, why)

    def note_live(self, name: str, version: str, figures: Dict[str, Any]) -> None:
        try:
            self.models.update_meta(name, version, {"live_check": figures})
        except (OSError, ValueError, AgentError) as exc:
            log.warning("model %s@%s: cannot add the live check to meta.json: %s", name,
                        version, exc)

    def _do_step_pending(self, p: Pending, value: Any, reason: str) -> None:
        self.on_step("pending")

    def _do_decide(self, p: Pending, value: Any, reason: str) -> None:
        alive = p.run is None or self.shared.run is p.run
        event, why = states.verdict(p.phase, p.state, self.clock(), alive, p.handoff_running,
                                    p.probe_failed, p.retries < self.m.unconfirmed_retries)
        if event == states.JOB_ENDED:  # cancelled by the controller: never committed later
            row = self.journal.job(p.run.job_id) if p.run is not None else None
            why = "its job ended {}".format(row["state"] if row else "elsewhere")
        self.fire(p, event, reason=why)

    # ------------------------------------------------------------------ what to do

    def _do_start_handoff(self, p: Pending, value: Any, reason: str) -> None:
        p.handoff_running = True
        self.runner.start_handoff(p.token, p.name, p.version, p.previous)

    def _do_start_probe(self, p: Pending, value: Any, reason: str) -> None:
        p.probe_running, p.last_probe = True, time.monotonic()
        self.runner.start_probe(p.token, p.name, p.version, p.previous, list(self.m.probe),
                                self.m.probe_timeout_s)

    def _do_retry_handoff(self, p: Pending, value: Any, reason: str) -> None:
        """The commit window closed with no answer (no report, no commit, the probe never
        ran to an end, the agent down): the app never judged the version. Its window reopens
        (the hand-off again) ``models.unconfirmed_retries`` times (``verdict`` counts), then
        it is rolled back as ``unconfirmed`` (a later job may bring it again)."""
        p.retries += 1
        deadline = self.clock() + self.m.commit_timeout_s
        log.warning("model %s@%s: unconfirmed (%s); handing it off again (retry %d of %d, "
                    "%.0f s)", p.name, p.version, reason, p.retries, self.m.unconfirmed_retries,
                    self.m.commit_timeout_s)
        self.journal.retry_pending(p.name, p.version, deadline, p.retries, reason)
        checked = p.state.confirmed & {"live"}  # the live check ran once: not again
        p.state = commit_logic.CommitState(p.state.need, deadline, self.m.commit_timeout_s)
        p.state.confirmed |= checked
        p.probe_failed = False
        self.changed()
        self._do_start_handoff(p, None, "")

    def _do_commit(self, p: Pending, value: Any, reason: str) -> None:
        dropped = self.journal.commit_version(p.name, p.version, self.m.keep_versions)
        if self.handoff_notes.pop(p.name, None) is not None:
            self.journal.note_put("handoff", self.handoff_notes)
        self.journal.forget_rejected(p.name, p.version)  # an earlier unconfirmed try
        self.drop_dirs(p.name, dropped)
        self.runner.commit(p.name, p.version, p.previous)
        self.pending = None
        self.health[p.name] = "ok"
        log.info("model %s@%s committed (%s)", p.name, p.version, reason)
        if p.run is not None:
            self.jobs.succeed(p.run, p.name, p.version, p.previous, p.result)
        else:
            self.changed()

    def _do_rollback(self, p: Pending, value: Any, reason: str) -> None:
        """Mark the version expired (journal), then on a thread: ``current`` back, adapters
        revert; ``restore`` follows (the ``reverted`` event)."""
        p.state.failure = p.state.failure or reason
        log.warning("model %s@%s: rolling back to %s: %s", p.name, p.version,
                    p.previous or "nothing", reason)
        self.journal.expire_pending(p.name, p.version, reason)
        self.runner.start_revert(p.token, p.name, p.version, p.previous)

    def _do_rollback_unconfirmed(self, p: Pending, value: Any, reason: str) -> None:
        """Never judged by its app: rolled back, but not refused when a job brings it again."""
        self._do_rollback(p, value, UNCONFIRMED_PREFIX + reason)

    def _do_restore(self, p: Pending, errors: List[str], reason: str) -> None:
        """Reverted: the journal restores the previous version, remembers this one as
        rejected (or unconfirmed), and the job ends."""
        why = p.state.failure or "rolled back"
        self.journal.restore_version(p.name, p.previous, reject_reason=why)
        self.pending = None
        self.drop_dirs(p.name, [p.version])
        self.health[p.name] = "rolled back from {}: {}".format(p.version, why)[:200]
        self.rolled_back(p.name, p.version, "{}@{} was rolled back: {}".format(
            p.name, p.version, why))
        if errors:
            log.warning("model %s: revert problems: %s", p.name, "; ".join(errors))
        if p.run is not None:
            self.jobs.fail_rolled_back(p.run, p.name, p.version, p.previous, why, errors,
                                       p.refusal)
        else:
            self.changed()

    def _do_abandon(self, p: Pending, ev: SwitchEvent, reason: str) -> None:
        """``prepare`` failed: nothing was switched; the previous version stays active."""
        self.journal.restore_version(p.name, p.previous)
        self.pending = None
        if p.previous is None:
            self.runner.drop_current(p.name)
        self.drop_dirs(p.name, [p.version])
        if p.run is not None:
            self.jobs.end_if_running(p.run, "FAILED", error=AgentError(
                "handoff_failed", "handing {}@{} to the app failed before the switch: {}".format(
                    p.name, p.version, ev.error),
                {"name": p.name, "version": p.version, "previous": p.previous,
                 "cause": ev.code or "handoff_failed"}).to_dict())
        self.changed()

    def drop_dirs(self, name: str, versions: List[str]) -> None:
        for version in versions:
            self.models.remove_version(name, version)
