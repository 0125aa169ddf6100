"""The switch after a restart, from the journal's records: the models directory made to match
(``reconcile``), a pending version's job resumed (``resume``), pending versions whose job is
gone rolled back (``orphans``). What happens to a resumed version is the table's
(``switch_states.resumed_verdict``, then the ``resumed`` rows)."""

import logging
import os
from typing import Any, Callable, Dict, List

from agent.device.jobs.run import Run
from agent.device.models import meta as model_meta
from agent.device.models import switch_states as states
from agent.device.models.directory import ModelsDir
from agent.device.models.live_check import LiveCheck
from agent.device.models.switch_jobs import JobEnds, committing_stage
from agent.device.models.switch_machine import Pending, SwitchMachine
from agent.errors import AgentError

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon


class SwitchRecords(object):
    def __init__(self, journal: Any, models: ModelsDir, machine: SwitchMachine,
                 jobs: JobEnds, live: LiveCheck, set_stage: Callable[[Run, str], None],
                 platform_status: Callable[[], Dict[str, Any]],
                 clock: Callable[[], float]) -> None:
        self.journal, self.models, self.machine, self.jobs = journal, models, machine, jobs
        self.live, self.set_stage = live, set_stage
        self.platform_status, self.clock = platform_status, clock

    def reconcile(self) -> None:
        """At start-up, before the main loop: the models directory made to match the journal
        (``current`` of a version whose rollback is due goes straight back)."""
        now = self.clock()
        active: Dict[str, str] = {}
        kept: Dict[str, List[str]] = {}
        for row in self.journal.model_versions():
            self._materialise(row)
            kept.setdefault(row["name"], []).append(row["version"])
            if row["active"]:
                expired = row["state"] == "pending" and (row["deadline"] or 0) <= now
                active[row["name"]] = row["previous"] if expired and row["previous"] \
                    else row["version"]
        self.models.reconcile(active, kept)

    def _materialise(self, row: Dict[str, Any]) -> None:
        """A kept version without its directory (a journal upgraded from the release before
        named models): written from the engine cache's file when that is still there."""
        if os.path.isdir(self.models.version_dir(row["name"], row["version"])):
            return
        engine = (row["info"] or {}).get("engine")
        if not isinstance(engine, str) or not os.path.isfile(engine):
            return
        result = {"engine_key": row["engine_key"], "precision": row["precision"],
                  "throughput_qps": (row["info"] or {}).get("throughput_qps"),
                  "backend": (row["info"] or {}).get("backend")}
        platform = self.platform_status()

        def meta_for(engine_sha: str, engine_size: int) -> Dict[str, Any]:
            return model_meta.build(row["name"], row["version"], row["model"], result, platform,
                                    {}, row["job_id"], row["activated"], row["state"],
                                    engine_sha, engine_size)

        try:
            self.models.write_version(row["name"], row["version"], engine, None, meta_for)
        except AgentError as exc:
            log.warning("model %s@%s: %s", row["name"], row["version"], exc)

    def resume(self, run: Run) -> None:
        """A job found IN_PROGRESS with its version pending at start-up (scheduler)."""
        name, version = run.details.get("model_name", ""), run.details.get("model_version", "")
        row = self.journal.model_version(name, version) if name and version else None
        if row is None or not row["active"] or row["state"] != "pending":
            active = self.journal.active_version(name) if name else None
            if row is not None and row["active"]:
                self.jobs.succeed(run, name, version, row["previous"])
            else:
                self.jobs.fail_rolled_back(
                    run, name, version, active["version"] if active else None,
                    "the version was rolled back while the agent stopped")
            return
        m = self.machine.m
        p = self.machine.track(run, name, version, row["previous"], row["deadline"] or 0.0,
                               phase=states.RESUMED)
        p.retries = int(row["info"].get("unconfirmed_retries") or 0)
        run.stage = committing_stage(run)
        self.set_stage(run, run.stage)
        cut_short = row["info"].get("rollback_reason")  # a rollback the kill cut short
        self._resume_live(p, again=not (cut_short and p.state.deadline <= self.clock()))
        event, why = states.resumed_verdict(p.state, self.clock(), cut_short,
                                            p.retries < m.unconfirmed_retries,
                                            m.commit_timeout_s)
        if event == states.IN_WINDOW:
            log.info("model %s@%s: still pending after a restart; handing it off again "
                     "(%.0f s left)", name, version, p.state.remaining(self.clock()))
        self.machine.fire(p, event, reason=why)

    def _resume_live(self, p: Pending, again: bool) -> None:
        """A version pending across a restart: its live check's recorded end read back, else
        (cut short, or never started) the check runs again: never committed without it."""
        figures = self.live.recorded(p.name, p.version)
        skipped = figures.get("skipped") if figures else self.live.skip_reason(p.name,
                                                                               p.previous)
        p.result = {"live_check": {"skipped": skipped}} if skipped is not None else {}
        if skipped is not None:  # skipped when activated (said so then), or now
            if figures is None:
                self.machine.note_live(p.name, p.version, {"skipped": skipped})
            return
        p.state.need = p.state.need | {"live"}
        p.running = figures.get("running") if figures else p.previous
        if figures is not None:
            self.machine.fire(p, states.LIVE, figures)
        elif again:
            self.live.start(p.token, p.name, p.version, str(p.previous))

    def orphans(self) -> None:
        """Pending versions no unfinished job waits for (its job gone): rolled back."""
        waiting = {(j["details"].get("model_name"), j["details"].get("model_version"))
                   for j in self.journal.unfinished_jobs()}
        for row in self.journal.pending_versions():
            if (row["name"], row["version"]) not in waiting and self.machine.pending is None:
                p = self.machine.track(None, row["name"], row["version"], row["previous"], 0.0,
                                       phase=states.RESUMED)
                self.machine.fire(p, states.ORPHANED,
                                  reason="its job ended while the agent stopped")
                return  # one at a time; the next after this one ends
