"""Named models on the device: a deployed engine becomes a version of its model name, reaches
the app, and is committed or rolled back (docs/daemon.md, "Named models, hand-off, commit").

A switch, in order (each step durable before the next, so a kill -9 anywhere leaves ``current``
on a complete version and nothing pending for ever):

    1. version directory written (temporary name, fsync, rename)     thread
    2. journal: the version active, ``pending`` with its deadline      main loop
       (``committed`` at once when nothing has to confirm it)
    3. hand-off ``prepare`` of every adapter serving the name         thread
    4. ``current`` -> the version (new link + rename)                  thread
    5. hand-off ``switch``, then ``confirm``                          thread
    6. wait: probe runs, the app's report or commit (app socket)       main loop + probe thread
    7. commit (journal, then the adapters' ``commit``), or roll back: the journal marks the
       version expired, ``current`` back, adapters ``revert``, the journal restores the
       previous version and remembers this one as rejected; the job ends SUCCEEDED, or
       FAILED ``handoff_rolled_back``

On restart (``reconcile`` then ``resume``): temporary leftovers go, ``current`` follows the
journal, a pending version whose deadline passed is rolled back, another resumes its wait (the
hand-off runs again for it). The daemon holds the job (stage ``committing``) while its version
is pending: other jobs wait at most ``models.commit_timeout_s`` (one switch at a time is the
simple, safe choice on a device).

``ModelSwitch`` is the facade the daemon calls; its parts, one concern each:

    switch_states     the decisions: (phase, event) -> next phase, actions (pure, a table)
    commit_logic      which confirmations a version needs and has (pure)
    switch_machine    the version in hand: runs the table's actions (journal, job, threads)
    switch_handoff    the adapters' steps and the probe on threads, posting ``SwitchEvent``
    switch_records    after a restart: reconcile, resume, orphans
    switch_requests   rollback, retry, pins, health of the active version, the models list
    switch_sets       the open model set committed or reverted
    switch_jobs       how the job ends
"""

import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from agent.device.handoff import Entry
from agent.device.jobs.run import Run
from agent.device.journal.models import UNCONFIRMED
from agent.device.models import meta as model_meta
from agent.device.models import sets as model_sets
from agent.device.models import switch_states as states
from agent.device.models.directory import ENGINE, ModelsDir, read_meta
from agent.device.models.live_check import LiveCheck
from agent.device.models.notes import ModelNotes
from agent.device.models.switch_handoff import HandoffRunner, SwitchEvent, text
from agent.device.models.switch_jobs import JobEnds, committing_stage
from agent.device.models.switch_machine import Pending, SwitchMachine
from agent.device.models.switch_records import SwitchRecords
from agent.device.models.switch_requests import ModelRequests
from agent.device.models.switch_sets import SetWatcher
from agent.errors import AgentError
from agent.wire.model_names import validate_name, validate_version

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

DISK_CHECK_EVERY_S = 30.0  # the files of the active versions: engine there, whole
HEAL_EVERY_S = 5.0  # adapters' heal(): the app still has the committed versions (Triton restart)
__all__ = ["ModelSwitch", "SwitchEvent", "committing_stage", "names_for"]


def names_for(doc: Dict[str, Any], model_sha: str) -> Tuple[str, str]:
    """A job's model name and version: its ``model_name`` / ``model_version``, else
    ``sha-<first 12 hex>`` and the first 12 hex of the model. AgentError bad_model_*."""
    name = doc.get("model_name")
    version = doc.get("model_version")
    name = validate_name(name) if name is not None else "sha-" + model_sha[:12]
    version = validate_version(version) if version is not None else model_sha[:12]
    return name, version


class ModelSwitch(object):
    """``end(run, state, error=, result=)`` ends a job (job_end); ``set_stage(run, stage)``
    records its stage; ``changed()`` tells the status publisher the models changed."""

    def __init__(self, cfg: Any, journal: Any, models: ModelsDir, entries: List[Entry],
                 events: Any, shared: Any, end: Callable[..., None],
                 set_stage: Callable[[Run, str], None], changed: Callable[[], None],
                 platform_status: Callable[[], Dict[str, Any]],
                 clock: Callable[[], float] = time.time,
                 on_step: Callable[[str], None] = lambda step: None) -> None:
        """``on_step(step)``: after "pending_recorded" (the journal holds the pending version)
        and "pending" (hand-off done, waiting): a hook for fault tests and timings."""
        self.on_step = on_step
        self.cfg, self.journal, self.models, self.entries = cfg, journal, models, entries
        self.events, self.shared, self.end, self.set_stage = events, shared, end, set_stage
        self.changed, self.platform_status, self.clock = changed, platform_status, clock
        self.m = cfg.models
        # Pins and each name's last health (the app's problem or a rollback's reason), kept
        # across restarts (model_notes); the open model set's record (model_sets).
        state_dir = getattr(cfg, "state_dir", None)
        self.notes = ModelNotes.in_state_dir(state_dir)
        self.health: Dict[str, str] = self.notes.health  # name -> "ok" | the app's last problem
        self.sets = model_sets.ModelSets.in_state_dir(state_dir, clock)
        self.writing: Dict[int, Tuple[Run, Dict[str, Any]]] = {}
        # name -> the last thing an adapter's heal() did (the models message and `models show`:
        # "handoff"), kept in the journal's notes for the CLI.
        self.handoff_notes: Dict[str, str] = {
            k: v for k, v in (journal.note("handoff") or {}).items() if isinstance(v, str)}
        self.last_heal, self.healing = time.monotonic(), False
        # The app's donated inputs: the live check before commit, INT8 ranges in the field.
        self.live = LiveCheck(cfg, models, lambda token, kind, value=None, error=None:
                              events.put(SwitchEvent(token, kind, value, error)))
        self.runner = HandoffRunner(models, entries, events.put)
        self.set_watch = SetWatcher(self.sets, journal, self.health, changed, clock,
                                    lambda: self.machine.pending, self._revert_with_set,
                                    lambda name, version: self.requests.rollback(name, version))
        self.jobs = JobEnds(journal, end, changed, self.set_watch.state_of)
        self.machine = SwitchMachine(self.m, journal, models, self.runner, self.live, shared,
                                     self.jobs, self.health, self.handoff_notes, changed,
                                     self.set_watch.member_failed, clock, on_step)
        self.records = SwitchRecords(journal, models, self.machine, self.jobs, self.live,
                                     set_stage, platform_status, clock)
        self.requests = ModelRequests(journal, models, self.machine, self.runner, self.notes,
                                      self.sets, self.live, self.handoff_notes, changed,
                                      self.set_watch.member_failed)
        # What the daemon and the CLI's requests call, as they were before the split.
        self.reconcile, self.resume, self.orphans = \
            self.records.reconcile, self.records.resume, self.records.orphans
        self.rollback, self.retry = self.requests.rollback, self.requests.retry
        self.pin, self.unpin, self.models_list = \
            self.requests.pin, self.requests.unpin, self.requests.models_list

    @property
    def pending(self) -> Optional[Pending]:
        return self.machine.pending

    @property
    def disk_health(self) -> Dict[str, str]:
        return self.requests.disk_health

    def pins(self) -> Dict[str, str]:
        return dict(self.notes.pins)

    def _committed(self) -> List[Dict[str, Any]]:
        return [r for r in self.journal.active_versions() if r["state"] == "committed"]

    def _revert_with_set(self, p: Pending, why: str) -> None:
        self.machine.fire(p, states.SET_REVERTED, reason=why)

    # ------------------------------------------------------------------ intake and activation

    def check_job(self, doc: Dict[str, Any], model_sha: str) -> None:
        """Before any download: names valid, and not a version the app rejected here."""
        name, version = names_for(doc, model_sha)
        self.notes.check(name, version)
        self.sets.check(model_sets.parse(doc), name)
        for row in self.journal.rejected_versions(name):
            if row["version"] == version and row["state"] != UNCONFIRMED:
                raise AgentError("version_rejected", "{}@{} was rejected on this device ({}); "
                                 "expected a new version, or an operator's retry (jetson-agent "
                                 "models retry {} {})".format(name, version, row["reason"],
                                                             name, version))

    def activate(self, run: Run, result: Dict[str, Any], engine: str) -> None:
        """The worker built and gated an engine: make it a version of its name (the job ends
        here, now or when the version is committed or rolled back)."""
        model_sha = run.needed["model"][0]
        name, version = names_for(run.doc, model_sha)
        try:  # a pin or a model set that came while this job was building
            self.notes.check(name, version)
            self.sets.check(model_sets.parse(run.doc), name)
        except AgentError as exc:
            self.end(run, "FAILED", error=exc.to_dict())
            return
        key = str(result["engine_key"])
        held = self.journal.model_version(name, version)
        if held is not None and held["engine_key"] != key:
            version = "{}+{}".format(version[:55], key[:8])  # a second engine of one version
        run.details.update(model_name=name, model_version=version)
        run.stage = "activating"
        self.set_stage(run, "activating")
        token = self.machine.next_token()
        onnx = run.paths.get("model")
        platform, fingerprint = self.platform_status(), dict(run.fingerprint)
        activated = self.clock()

        built_by = model_meta.provenance(run.doc, result)  # an engine the fleet shared

        def meta_for(engine_sha: str, engine_size: int) -> Dict[str, Any]:
            plan = run.doc.get("plan") or {}
            return model_meta.build(name, version, model_sha, result, platform, fingerprint,
                                    run.job_id, activated, "pending", engine_sha, engine_size,
                                    dla_core=plan.get("dla_core"), shapes=plan.get("shapes"),
                                    built_by=built_by,
                                    plugins=(run.plan or {}).get("plugins"))  # with paths

        self.writing[token] = (run, result)
        calibration_set = run.paths.get("calibration") if result.get("precision") == "int8" \
            else None

        def write() -> None:
            try:
                path = self.models.write_version(name, version, engine, onnx, meta_for,
                                                 calibration=result.get("calibration_cache"))
                if calibration_set:  # what the field's inputs are compared with (live_check)
                    self.live.note_calibration_set(name, version, calibration_set)
                self.events.put(SwitchEvent(token, "written", (name, version, path)))
            except Exception as exc:  # noqa: BLE001 - reported on the job
                self.events.put(SwitchEvent(token, "written", (name, version, None),
                                            error=text(exc)))

        threading.Thread(target=write, name="model-write", daemon=True).start()

    def _on_written(self, ev: SwitchEvent) -> None:
        run, result = self.writing.pop(ev.token)
        name, version, path = ev.value
        if ev.error is not None:
            self.end(run, "FAILED", error=AgentError(
                "handoff_failed", "cannot write {}@{} to the models directory: {}".format(
                    name, version, ev.error)).to_dict())
            return
        need = self.machine.needs(name)
        meta = read_meta(path)
        info = {"engine": os.path.join(path, ENGINE), "backend": run.backend,
                "accuracy_passed": (result.get("accuracy") or {}).get("passed"),
                "throughput_qps": result.get("throughput_qps")}
        if meta.get("built_by"):  # the journal keeps who built an adopted engine too
            info["built_by"] = meta["built_by"]
        active = self.journal.active_version(name)
        running = active["version"] if active is not None and active["state"] == "committed" \
            else None
        if running == version and active is not None and \
                active["engine_key"] == meta.get("engine_key"):
            need = frozenset()  # the same version again: refreshed, nothing to hand off
        else:
            skipped = self.live.skip_reason(name, running)
            if skipped is None:
                need = need | {"live"}
            else:
                result["live_check"] = {"skipped": skipped}
                self.machine.note_live(name, version, result["live_check"])
        deadline = self.clock() + self.m.commit_timeout_s
        spec = model_sets.parse(run.doc)
        if spec is not None:  # durable before the switch: a crash after it can revert the set
            self.sets.started(spec, name, version, (active or {}).get("version"))
        replaced, dropped = self.journal.activate_version(
            name, version, meta["model_sha256"], str(meta.get("engine_key")),
            meta.get("precision"), run.job_id, info, "pending" if need else "committed",
            deadline if need else None, self.m.keep_versions)
        previous = replaced["version"] if replaced else (active or {}).get("previous")
        if not need:
            self.models.set_current(name, version)
            self.machine.drop_dirs(name, dropped)
            self.jobs.succeed(run, name, version, previous, result)
            return
        run.details["commit"] = "pending"
        run.stage = committing_stage(run)
        self.set_stage(run, run.stage)
        self.on_step("pending_recorded")
        self.changed()
        p = self.machine.track(run, name, version, previous, deadline, need,
                               phase=states.RECORDED)
        p.result = result
        if "live" in need:
            p.running = running
            self.live.start(p.token, name, version, str(running))
        self.machine.fire(p, states.START)

    # ------------------------------------------------------------------ the main loop

    def on_event(self, ev: SwitchEvent) -> None:
        if ev.kind == "written":
            self._on_written(ev)
        elif ev.kind == "healed":
            self.healing = False
            new = {k: v for k, v in (ev.value or {}).items() if self.handoff_notes.get(k) != v}
            if new:  # the same failure again: nothing to write, log or publish
                self.handoff_notes.update(new)
                self.journal.note_put("handoff", self.handoff_notes)
                for note in new.values():
                    log.warning("model hand-off: %s", note)
                self.changed()
        elif ev.kind == "field":
            if self.live.on_field(*ev.value):
                self.changed()  # the name's calibration_stale problem came or went
        elif ev.kind == "restored":
            if ev.error:
                log.warning("%s", ev.error)
                self.health[ev.value] = ev.error[:200]
            self.changed()
        else:  # the version in hand's: through the switch's table
            self.machine.on_event(ev)

    def tick(self) -> None:
        self.set_watch.tick()
        if time.monotonic() - self.requests.last_disk_check >= DISK_CHECK_EVERY_S:
            before = dict(self.disk_health)
            self.models_list()
            if self.disk_health != before:
                self.changed()  # the status and the models message say so
        self.live.tick(self._committed)
        if self.machine.pending is None:
            if not self.healing and time.monotonic() - self.last_heal >= HEAL_EVERY_S:
                self.last_heal = time.monotonic()
                self.healing = self.runner.start_heal(self._committed)
            if self.shared.run is None:
                self.orphans()
            return
        self.machine.tick()

    # ------------------------------------------------------------------ the app's requests

    def commit(self, name: str, version: Optional[str], by: str) -> Dict[str, Any]:
        p = self._pending_for(name, version)
        self.machine.fire(p, states.COMMIT_REQUEST, by)  # still pending while the live
        return {"name": name, "version": p.version,      # check's verdict is awaited
                "state": "pending" if self.machine.pending is p else "committed"}

    def report_health(self, name: str, version: Optional[str], ok: bool,
                      detail: str) -> Dict[str, Any]:
        p = self.machine.pending
        if p is not None and p.name == name and version in (None, p.version):
            self.machine.fire(p, states.HEALTHY if ok else states.UNHEALTHY, (ok, detail))
            return {"name": name, "version": p.version, "state": "pending" if ok else
                    "rolling_back"}
        return self.requests.report_health(name, version, ok, detail)

    def _pending_for(self, name: str, version: Optional[str]) -> Pending:
        validate_name(name)
        p = self.machine.pending
        if p is None or p.name != name or (version is not None and version != p.version) \
                or not states.accepts(p.phase, states.COMMIT_REQUEST):
            raise AgentError("not_pending", "expected a pending version of {}, found {}".format(
                name, "{}@{} ({})".format(p.name, p.version, p.phase) if p else "none pending"))
        return p
