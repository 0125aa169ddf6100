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

The decision is ``commit_logic``'s (pure); adapter steps and probes run on threads that post a
``SwitchEvent`` back to the main loop; this module is where they meet the journal, the models
directory and the job.
"""

import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from agent.device.handoff import Entry, adapters_for
from agent.device.handoff.base import Adapter, ModelVersion
from agent.device.jobs.run import Run
from agent.device.journal.models import UNCONFIRMED, UNCONFIRMED_PREFIX
from agent.device.models import commit_logic
from agent.device.models import guard as models_guard
from agent.device.models import meta as model_meta
from agent.device.models import sets as model_sets
from agent.device.models.directory import ENGINE, ModelsDir, read_meta
from agent.device.models.live_check import LiveCheck
from agent.device.models.notes import ModelNotes
from agent.device.status_publisher import fit_result
from agent.errors import AgentError
from agent.wire.model_names import validate_name, validate_version

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

PROBE_EVERY_S = 2.0
DISK_CHECK_EVERY_S = 30.0  # the files of the active versions: engine there, whole
HEAL_EVERY_S = 5.0  # adapters' heal(): the app still has the committed versions (Triton restart)


class SwitchEvent(NamedTuple):
    """A thread's outcome, handled on the main loop."""

    token: int
    kind: str  # "written" | "handoff" | "probe" | "reverted" | "restored"
    value: Any = None
    error: Optional[str] = None
    code: Optional[str] = None  # the AgentError's code, where one failed the step


def names_for(doc: Dict[str, Any], model_sha: str) -> Tuple[str, str]:
    """A job's model name and version: its ``model_name`` / ``model_version``, else
    ``sha-<first 12 hex>`` and the first 12 hex of the model. AgentError bad_model_*."""
    name = doc.get("model_name")
    version = doc.get("model_version")
    name = validate_name(name) if name is not None else "sha-" + model_sha[:12]
    version = validate_version(version) if version is not None else model_sha[:12]
    return name, version


class Pending(object):
    """The switch in hand (one at a time)."""

    def __init__(self, token: int, name: str, version: str, previous: Optional[str],
                 run: Optional[Run], state: commit_logic.CommitState) -> None:
        self.token, self.name, self.version, self.previous = token, name, version, previous
        self.run, self.state = run, state
        self.result: Optional[Dict[str, Any]] = None  # the worker's, for the job's result
        self.phase = "handoff"  # handoff | waiting | rolling_back
        self.probe_running = False
        self.last_probe = 0.0
        self.probe_failed = False  # the probe ran and said no: an answer, not silence
        # (until it says yes: a probe that passed leaves only the app's silence)
        self.handoff_running = False  # an adapter still in switch(): never run a second
        self.retries = 0  # commit windows reopened because nobody answered (journal info)
        self.running: Optional[str] = None  # the version the live check compares with
        self.refusal: Optional[AgentError] = None  # the code a refusal ends the job with


class ModelSwitch(object):
    """``end(run, state, error=, result=)`` ends a job (job_end); ``set_stage(run, stage)``
    records its stage; ``published()`` tells the status publisher the models changed."""

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
        self.token = 0
        self.pending: Optional[Pending] = None
        # Pins and each name's last health (the app's problem or a rollback's reason), kept
        # across restarts (model_notes); the open model set's record (model_sets).
        state_dir = getattr(cfg, "state_dir", None)
        self.notes = ModelNotes.in_state_dir(state_dir)
        self.health: Dict[str, str] = self.notes.health  # name -> "ok" | the app's last problem
        self.sets = model_sets.ModelSets.in_state_dir(state_dir, clock)
        self.last_set_check = 0.0
        # name -> what the last models list said of its files (models_guard): a version whose
        # engine went missing or corrupt is a health problem, rechecked every DISK_CHECK_EVERY_S.
        self.disk_health: Dict[str, str] = {}
        self.last_disk_check = time.monotonic()
        self.writing: Dict[int, Tuple[Run, Dict[str, Any]]] = {}
        # name -> the last thing an adapter's heal() did (the models message and `models show`:
        # "handoff"), kept in the journal's notes for the CLI.
        self.handoff_notes: Dict[str, str] = {
            k: v for k, v in (journal.note("handoff") or {}).items() if isinstance(v, str)}
        self.last_heal, self.healing = time.monotonic(), False
        # The app's donated inputs: the live check before commit, INT8 ranges in the field.
        self.live = LiveCheck(cfg, models, lambda token, kind, value=None, error=None:
                              events.put(SwitchEvent(token, kind, value, error)))

    # ------------------------------------------------------------------ intake and start-up

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
                self._succeed(run, name, version, row["previous"])
            else:
                self._fail_rolled_back(run, name, version, active["version"] if active else None,
                                       "the version was rolled back while the agent stopped")
            return
        self._track(run, name, version, row["previous"], row["deadline"] or 0.0)
        p: Pending = self.pending  # type: ignore[assignment]
        p.retries = int(row["info"].get("unconfirmed_retries") or 0)
        run.stage = committing_stage(run)
        self.set_stage(run, run.stage)
        if row["info"].get("rollback_reason") and (row["deadline"] or 0.0) <= self.clock():
            self._rollback(p, row["info"]["rollback_reason"])  # a rollback the kill cut short
        elif (row["deadline"] or 0.0) <= self.clock():
            self._unanswered(p, "no confirmation within {:g} s (the agent was down)".format(
                self.m.commit_timeout_s))
        else:
            log.info("model %s@%s: still pending after a restart; handing it off again "
                     "(%.0f s left)", name, version, (row["deadline"] or 0) - self.clock())
            self._start_handoff(self.pending)  # type: ignore[arg-type]

    def orphans(self) -> None:
        """Pending versions no unfinished job waits for (its job gone): rolled back."""
        waiting = {(j["details"].get("model_name"), j["details"].get("model_version"))
                   for j in self.journal.unfinished_jobs()}
        for row in self.journal.pending_versions():
            if (row["name"], row["version"]) not in waiting and self.pending is None:
                self._track(None, row["name"], row["version"], row["previous"], 0.0)
                self._rollback(self.pending, "its job ended while the agent stopped")  # type: ignore
                return  # one at a time; the next after this one ends

    # ------------------------------------------------------------------ activation

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
        self.token += 1
        token = self.token
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
                                            error=_text(exc)))

        threading.Thread(target=write, name="model-write", daemon=True).start()

    def _on_written(self, ev: SwitchEvent) -> None:
        run, result = self.writing.pop(ev.token)
        name, version, path = ev.value
        if ev.error is not None:
            self.end(run, "FAILED", error=AgentError(
                "handoff_failed", "cannot write {}@{} to the models directory: {}".format(
                    name, version, ev.error)).to_dict())
            return
        adapters = adapters_for(self.entries, name)
        need = commit_logic.needs(bool(adapters), bool(self.m.probe),
                                  self._app_confirms(name))
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
                self._note_live(name, version, result["live_check"])
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
            self._drop_dirs(name, dropped)
            self._succeed(run, name, version, previous, result)
            return
        run.details["commit"] = "pending"
        run.stage = committing_stage(run)
        self.set_stage(run, run.stage)
        self.on_step("pending_recorded")
        self.changed()
        self._track(run, name, version, previous, deadline, need)
        self.pending.result = result  # type: ignore[union-attr]
        if "live" in need:
            self.pending.running = running  # type: ignore[union-attr]
            self.live.start(self.pending.token, name, version, str(running))  # type: ignore
        self._start_handoff(self.pending)  # type: ignore[arg-type]

    def _on_live(self, p: Pending, figures: Dict[str, Any]) -> None:
        """The live check's figures: a confirmation, or the version's refusal."""
        if p.result is not None:
            p.result["live_check"] = figures
        self._note_live(p.name, p.version, figures)
        if figures.get("skipped") or figures.get("passed"):
            p.state.on_live(True)
            return
        reason = "live check on {} donated samples against {}: top-1 agreement {} (at least " \
            "{:g}), {} error {}{}; worst samples {}".format(
                figures["samples"], p.running, "n/a" if figures["agreement"] is None else
                "{:.3f}".format(figures["agreement"]), figures["min_agreement"],
                figures["error_stat"], "NaN or infinite" if figures["error"] is None else
                "{:.4g}".format(figures["error"]),
                " (at most {:g})".format(figures["max_error"]) if figures["max_error"] else "",
                figures["worst"])
        p.refusal = AgentError("live_check_failed", reason, {"live_check": {
            k: figures[k] for k in ("samples", "agreement", "error", "error_stat",
                                    "min_agreement", "max_error", "worst", "running")}})
        p.state.on_live(False, reason)

    def _note_live(self, name: str, version: str, figures: Dict[str, Any]) -> None:
        try:
            self.models.update_meta(name, version, {"live_check": figures})
        except (OSError, ValueError, AgentError) as exc:
            log.warning("model %s@%s: cannot add the live check to meta.json: %s", name,
                        version, exc)

    def _app_confirms(self, name: str) -> bool:
        return "*" in self.m.app_confirms or name in self.m.app_confirms

    def _track(self, run: Optional[Run], name: str, version: str, previous: Optional[str],
               deadline: float, need: Optional[frozenset] = None) -> None:
        if need is None:
            need = commit_logic.needs(bool(adapters_for(self.entries, name)),
                                      bool(self.m.probe), self._app_confirms(name))
        self.token += 1
        self.pending = Pending(self.token, name, version, previous, run,
                               commit_logic.CommitState(need, deadline, self.m.commit_timeout_s))

    # ------------------------------------------------------------------ hand-off (threads)

    def _mv(self, name: str, version: Optional[str]) -> Optional[ModelVersion]:
        if version is None:
            return None
        path = self.models.version_dir(name, version)
        try:
            meta = read_meta(path)
        except (OSError, ValueError):
            meta = {}
        return ModelVersion(name, version, path, os.path.join(path, ENGINE), meta)

    def _start_handoff(self, p: Pending) -> None:
        adapters = adapters_for(self.entries, p.name)
        new, prev = self._mv(p.name, p.version), self._mv(p.name, p.previous)
        assert new is not None
        p.handoff_running = True

        def work() -> None:
            step = "prepare"
            try:
                for a in adapters:
                    a.prepare(new, prev)
                step = "switch"
                self.models.set_current(p.name, p.version)
                for a in adapters:
                    a.switch(new, prev)
                confirms = [a.confirm(new) for a in adapters]
                self.events.put(SwitchEvent(p.token, "handoff", confirms))
            except Exception as exc:  # noqa: BLE001 - the switch fails with the reason
                self.events.put(SwitchEvent(p.token, "handoff", step, error=_text(exc),
                                            code=getattr(exc, "code", None)))

        threading.Thread(target=work, name="model-handoff", daemon=True).start()

    def _start_heal(self) -> None:
        """On a thread: each adapter's heal() with the committed versions it serves."""
        self.last_heal = time.monotonic()
        healers = [e for e in self.entries if type(e.adapter).heal is not Adapter.heal]
        if not healers:
            return
        rows = [r for r in self.journal.active_versions() if r["state"] == "committed"]
        work_list = []
        for entry in healers:
            versions = [ModelVersion(r["name"], r["version"], "", "", {}) for r in rows
                        if entry.serves(r["name"])]
            if versions:
                work_list.append((entry.adapter, versions))
        if not work_list:
            return
        self.healing = True

        def work() -> None:
            notes: Dict[str, str] = {}
            for adapter, versions in work_list:
                try:
                    notes.update(adapter.heal(versions))
                except Exception as exc:  # noqa: BLE001 - tried again at the next tick
                    log.warning("model hand-off %s: heal failed: %s", adapter.kind, _text(exc))
            self.events.put(SwitchEvent(0, "healed", notes))

        threading.Thread(target=work, name="model-heal", daemon=True).start()

    def _start_probe(self, p: Pending) -> None:
        from agent.device.handoff.command import model_env, run

        p.probe_running, p.last_probe = True, time.monotonic()
        new, prev = self._mv(p.name, p.version), self._mv(p.name, p.previous)
        assert new is not None
        argv, timeout = list(self.m.probe), self.m.probe_timeout_s

        def work() -> None:
            try:
                run(argv, model_env(new, prev, "probe"), timeout)
                self.events.put(SwitchEvent(p.token, "probe", True))
            except Exception as exc:  # noqa: BLE001 - not yet: tried again
                self.events.put(SwitchEvent(p.token, "probe", False, error=_text(exc)))

        threading.Thread(target=work, name="model-probe", daemon=True).start()

    def _rollback(self, p: Pending, reason: str) -> None:
        """Mark the version expired (journal), then on a thread: ``current`` back, adapters
        revert; ``_on_reverted`` restores the journal and ends the job."""
        if p.phase == "rolling_back":
            return
        p.phase = "rolling_back"
        p.state.failure = p.state.failure or reason
        log.warning("model %s@%s: rolling back to %s: %s", p.name, p.version,
                    p.previous or "nothing", reason)
        self.journal.expire_pending(p.name, p.version, reason)
        adapters = adapters_for(self.entries, p.name)
        failed, prev = self._mv(p.name, p.version), self._mv(p.name, p.previous)
        assert failed is not None

        def work() -> None:
            errors = []
            try:
                if prev is not None and os.path.isdir(prev.path):
                    self.models.set_current(p.name, prev.version)
                else:
                    _unlink(os.path.join(self.models.name_dir(p.name), "current"))
            except Exception as exc:  # noqa: BLE001
                errors.append(_text(exc))
            for a in adapters:
                try:
                    a.revert(prev, failed)
                except Exception as exc:  # noqa: BLE001 - the others still revert
                    errors.append("{}: {}".format(a.kind, _text(exc)))
            self.events.put(SwitchEvent(p.token, "reverted", errors))

        threading.Thread(target=work, name="model-revert", daemon=True).start()

    # ------------------------------------------------------------------ events (main loop)

    def on_event(self, ev: SwitchEvent) -> None:
        if ev.kind == "written":
            self._on_written(ev)
            return
        if ev.kind == "healed":
            self.healing = False
            new = {k: v for k, v in (ev.value or {}).items() if self.handoff_notes.get(k) != v}
            if new:  # the same failure again: nothing to write, log or publish
                self.handoff_notes.update(new)
                self.journal.note_put("handoff", self.handoff_notes)
                for note in new.values():
                    log.warning("model hand-off: %s", note)
                self.changed()
            return
        if ev.kind == "field":
            if self.live.on_field(*ev.value):
                self.changed()  # the name's calibration_stale problem came or went
            return
        if ev.kind == "restored":
            if ev.error:
                log.warning("%s", ev.error)
                self.health[ev.value] = ev.error[:200]
            self.changed()
            return
        p = self.pending
        if p is None or ev.token != p.token:
            return
        if ev.kind == "handoff":
            p.handoff_running = False
        if ev.kind == "handoff" and p.phase == "handoff":
            if ev.error is not None and ev.value == "prepare":
                self._handoff_failed(p, ev.error, ev.code)
                return
            p.phase = "waiting"
            p.state.on_handoff(ev.value if ev.error is None else [], ev.error)
            self.on_step("pending")
        elif ev.kind == "probe":
            p.probe_running = False
            p.state.on_probe(bool(ev.value))
            p.probe_failed = not ev.value and "probe" not in p.state.confirmed
            if not ev.value:
                log.info("model %s@%s: probe not yet: %s", p.name, p.version, ev.error)
        elif ev.kind == "reverted":
            self._on_reverted(p, ev.value or [])
            return
        elif ev.kind == "live":
            self._on_live(p, ev.value or {})
        self._decide(p)

    def tick(self) -> None:
        try:
            self._check_set()
        except (KeyError, TypeError, ValueError) as exc:  # a damaged model_set.json
            log.error("model set record unreadable (%s): closed, its names stay as they are",
                      exc)
            self.sets.open = None
            self.sets.close(model_sets.REVERT)
        if time.monotonic() - self.last_disk_check >= DISK_CHECK_EVERY_S:
            before = dict(self.disk_health)
            self.models_list()
            if self.disk_health != before:
                self.changed()  # the status and the models message say so
        self.live.tick(lambda: [r for r in self.journal.active_versions()
                                if r["state"] == "committed"])
        p = self.pending
        if p is None and not self.healing and \
                time.monotonic() - self.last_heal >= HEAL_EVERY_S:
            self._start_heal()
        if p is None:
            if self.shared.run is None:
                self.orphans()
            return
        if p.phase == "waiting" and "probe" in p.state.need and "probe" not in \
                p.state.confirmed and not p.probe_running and \
                time.monotonic() - p.last_probe >= PROBE_EVERY_S:
            self._start_probe(p)
        self._decide(p)

    def _decide(self, p: Pending) -> None:
        if p.phase == "rolling_back":
            return
        if p.run is not None and self.shared.run is not p.run:
            # Its job ended under it (cancelled by the controller): never committed later.
            row = self.journal.job(p.run.job_id)
            self._rollback(p, UNCONFIRMED_PREFIX + "its job ended {}".format(
                row["state"] if row else "elsewhere"))
            return
        if p.phase == "handoff" and p.state.failure is None and p.state.committed_by is None \
                and p.state.deadline > self.clock():
            return  # the adapters' switch is still running
        decision = p.state.decide(self.clock())
        if decision.action == commit_logic.COMMIT:
            dropped = self.journal.commit_version(p.name, p.version, self.m.keep_versions)
            if self.handoff_notes.pop(p.name, None) is not None:
                self.journal.note_put("handoff", self.handoff_notes)
            self.journal.forget_rejected(p.name, p.version)  # an earlier unconfirmed try
            self._drop_dirs(p.name, dropped)
            self._commit_handoff(p)
            self.pending = None
            self.health[p.name] = "ok"
            log.info("model %s@%s committed (%s)", p.name, p.version, decision.reason)
            if p.run is not None:
                self._succeed(p.run, p.name, p.version, p.previous, p.result)
            else:
                self.changed()
        elif decision.action == commit_logic.ROLLBACK:
            refused = p.state.failure is not None or p.probe_failed
            if not refused and p.handoff_running:
                # An adapter still switching at the deadline: not judged, but not handed off
                # again over the running one either.
                self._rollback(p, UNCONFIRMED_PREFIX + decision.reason)
            elif not refused:
                self._unanswered(p, decision.reason)
            else:
                self._rollback(p, decision.reason)

    def _commit_handoff(self, p: Pending) -> None:
        """Each adapter's commit (Triton prunes its repository to keep_versions now that the
        version counts): quick file work, on the main loop, before any next switch starts."""
        new, prev = self._mv(p.name, p.version), self._mv(p.name, p.previous)
        assert new is not None
        for a in adapters_for(self.entries, p.name):
            try:
                a.commit(new, prev)
            except Exception as exc:  # noqa: BLE001 - committed all the same; logged
                log.warning("model hand-off %s: commit of %s@%s: %s", a.kind, p.name, p.version,
                            _text(exc))

    def _unanswered(self, p: Pending, reason: str) -> None:
        """The commit window closed with no answer (no report, no commit, the probe never
        ran to an end, the agent down): the app never judged the version. Its window reopens
        (the hand-off again) ``models.unconfirmed_retries`` times, then it is rolled back as
        ``unconfirmed`` (a later job may bring it again: not refused like a rejected one)."""
        if p.retries >= self.m.unconfirmed_retries:
            self._rollback(p, UNCONFIRMED_PREFIX + reason)
            return
        p.retries += 1
        deadline = self.clock() + self.m.commit_timeout_s
        log.warning("model %s@%s: unconfirmed (%s); handing it off again (retry %d of %d, "
                    "%.0f s)", p.name, p.version, reason, p.retries, self.m.unconfirmed_retries,
                    self.m.commit_timeout_s)
        self.journal.retry_pending(p.name, p.version, deadline, p.retries, reason)
        checked = p.state.confirmed & {"live"}  # the live check ran once: not again
        p.state = commit_logic.CommitState(p.state.need, deadline, self.m.commit_timeout_s)
        p.state.confirmed |= checked
        p.phase, p.probe_failed = "handoff", False
        self.changed()
        self._start_handoff(p)

    def _handoff_failed(self, p: Pending, error: str, code: Optional[str] = None) -> None:
        """``prepare`` failed: nothing was switched; the previous version stays active."""
        self.journal.restore_version(p.name, p.previous)
        self.pending = None
        if p.previous is None:
            _unlink(os.path.join(self.models.name_dir(p.name), "current"))
        self._drop_dirs(p.name, [p.version])
        if p.run is not None:
            self._end(p.run, "FAILED", error=AgentError(
                "handoff_failed", "handing {}@{} to the app failed before the switch: {}".format(
                    p.name, p.version, error),
                {"name": p.name, "version": p.version, "previous": p.previous,
                 "cause": code or "handoff_failed"}).to_dict())
        self.changed()

    def _on_reverted(self, p: Pending, errors: List[str]) -> None:
        reason = p.state.failure or "rolled back"
        self.journal.restore_version(p.name, p.previous, reject_reason=reason)
        self.pending = None
        self._drop_dirs(p.name, [p.version])
        self.health[p.name] = "rolled back from {}: {}".format(p.version, reason)[:200]
        if (self.sets.member(p.name) or {}).get("version") == p.version:
            self.sets.fail("{}@{} was rolled back: {}".format(p.name, p.version, reason))
            self._check_set(force=True)
        if errors:
            log.warning("model %s: revert problems: %s", p.name, "; ".join(errors))
        if p.run is not None:
            self._fail_rolled_back(p.run, p.name, p.version, p.previous, reason, errors,
                                   p.refusal)
        else:
            self.changed()

    # ------------------------------------------------------------------ model sets

    def _check_set(self, force: bool = False) -> None:
        """The open set committed, or reverted (model_sets.decide); on the main loop, at most
        once a second unless ``force``."""
        rec = self.sets.open
        if rec is None or (not force and time.monotonic() - self.last_set_check < 1.0):
            return
        self.last_set_check = time.monotonic()
        active = {r["name"]: (r["version"], r["state"]) for r in self.journal.active_versions()}
        p = self.pending
        if p is not None and p.name in rec["members"] and p.phase == "rolling_back" and \
                not rec.get("failed"):
            return  # its own rollback ends first (``_on_reverted`` fails the set)
        action, reason = model_sets.decide(rec, active, self.clock())
        if action == model_sets.COMMITTED:
            log.info("model set %s committed (%s)", rec["id"], ", ".join(rec["names"]))
            self.sets.close(model_sets.COMMITTED)
            self.changed()
        elif action == model_sets.REVERT:
            self._revert_set(rec, active, reason)

    def _revert_set(self, rec: Dict[str, Any], active: Dict[str, Tuple[str, str]],
                    reason: str) -> None:
        """Every member still at its set version back to the version the set replaced."""
        log.warning("model set %s: reverting every name: %s", rec["id"], reason)
        self.sets.close(model_sets.REVERT)
        why = "model set {} reverted: {}".format(rec["id"], reason)
        for name, version, before in model_sets.revert_plan(rec, active):
            p = self.pending
            if p is not None and p.name == name and p.version == version:
                # Its app never judged it: reverted with the set, not refused next time.
                self._rollback(p, UNCONFIRMED_PREFIX + why)
                continue
            try:
                if before is None:
                    raise AgentError("no_previous_version", "{} had no version before the "
                                     "set".format(name))
                self.rollback(name, before)
            except AgentError as exc:
                log.warning("model set %s: %s stays at %s: %s", rec["id"], name, version,
                            exc.message)
                self.health[name] = "{}; stays at {}: {}".format(why, version, exc.message)
                continue
            self.health[name] = "rolled back from {}: {}".format(version, why)
        self.changed()

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
        p = self.pending
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

    def pins(self) -> Dict[str, str]:
        return dict(self.notes.pins)

    # ------------------------------------------------------------------ the job's end

    def _succeed(self, run: Run, name: str, version: str, previous: Optional[str],
                 result: Optional[Dict[str, Any]] = None) -> None:
        out = dict(result or {})
        for key in ("io", "activate", "engine", "calibration_cache"):
            out.pop(key, None)
        prev_row = self.journal.model_version(name, previous) if previous else None
        out["activated"] = True
        out["previous_engine"] = prev_row["engine_key"] if prev_row else None
        out["model"] = {"name": name, "version": version, "previous": previous,
                        "state": "committed"}
        spec = model_sets.parse(run.doc) if run.doc.get("model_set") is not None else None
        if spec is not None:
            self._check_set(force=True)
            state = "open" if self.sets.open and self.sets.open["id"] == spec.id else \
                "committed" if self.sets.closed == (spec.id, model_sets.COMMITTED) else \
                "reverted"
            out["model"]["set"] = {"id": spec.id, "state": state}  # the rollout's view shows it
        run.details.pop("commit", None)
        self._end(run, "SUCCEEDED", result=fit_result(out))
        self.changed()

    def _fail_rolled_back(self, run: Run, name: str, version: str, previous: Optional[str],
                          reason: str, errors: Optional[List[str]] = None,
                          refusal: Optional[AgentError] = None) -> None:
        """``refusal``: the check that refused the version (its code and details), else the
        rollback is ``handoff_rolled_back``."""
        run.details.pop("commit", None)
        details: Dict[str, Any] = {"name": name, "version": version, "previous": previous,
                                   "reason": reason}
        if errors:
            details["revert_errors"] = errors[:5]
        if refusal is not None:
            details.update(refusal.details)
        self._end(run, "FAILED", error=AgentError(
            refusal.code if refusal is not None else "handoff_rolled_back",
            "{}@{} was rolled back to {}: {}".format(
                name, version, previous or "no version", reason), details).to_dict())
        self.changed()

    def _end(self, run: Run, state: str, **kwargs: Any) -> None:
        row = self.journal.job(run.job_id)
        if row is None or row["state"] != "IN_PROGRESS":
            return  # cancelled meanwhile: the version went its own way
        self.end(run, state, **kwargs)

    def _drop_dirs(self, name: str, versions: List[str]) -> None:
        for version in versions:
            self.models.remove_version(name, version)

    # ------------------------------------------------------------------ commands

    def commit(self, name: str, version: Optional[str], by: str) -> Dict[str, Any]:
        p = self._pending_for(name, version)
        p.state.on_commit(by)
        self._decide(p)
        return {"name": name, "version": p.version, "state": "committed"}

    def report_health(self, name: str, version: Optional[str], ok: bool,
                      detail: str) -> Dict[str, Any]:
        p = self.pending
        if p is not None and p.name == name and version in (None, p.version):
            p.state.on_health(ok, detail)
            self._decide(p)
            return {"name": name, "version": p.version, "state": "pending" if ok else
                    "rolling_back"}
        active = self.journal.active_version(validate_name(name))
        if active is None or (version is not None and version != active["version"]):
            raise AgentError("not_pending", "expected a health report on {}'s active version "
                             "{}, found version {!r}".format(
                                 name, active["version"] if active else "(none)", version))
        self.health[name] = "ok" if ok else (detail or "unhealthy")[:200]
        if not ok and (self.sets.member(name) or {}).get("version") == active["version"]:
            self.sets.fail("{}@{} reported unhealthy: {}".format(
                name, active["version"], detail or "unhealthy"))
            self._check_set(force=True)
        self.changed()
        return {"name": name, "version": active["version"], "state": active["state"]}

    def _pending_for(self, name: str, version: Optional[str]) -> Pending:
        validate_name(name)
        p = self.pending
        if p is None or p.name != name or (version is not None and version != p.version) \
                or p.phase == "rolling_back":
            raise AgentError("not_pending", "expected a pending version of {}, found {}".format(
                name, "{}@{} ({})".format(p.name, p.version, p.phase) if p else "none pending"))
        return p

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
        p = self.pending
        if p is not None and p.name == name:
            if p.phase != "rolling_back":
                self._rollback(p, "rolled back by an operator")
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
        problem = None if os.path.isdir(self.models.version_dir(name, target)) else "missing"
        if problem:
            raise AgentError("no_previous_version", "expected {}@{} in the models directory, "
                             "found it {}".format(name, target, problem))
        self.journal.restore_version(name, target)
        self.models.set_current(name, target)
        self.models.remove_version(name, active["version"])
        self._restore_handoff(name, target, active["version"])
        self.changed()
        restored = self.journal.active_version(name) or {}
        return {"name": name, "version": target, "replaced": active["version"],
                "model": restored.get("model"), "engine_key": restored.get("engine_key"),
                "precision": restored.get("precision"), "job_id": restored.get("job_id")}

    def _restore_handoff(self, name: str, version: str, replaced: str) -> None:
        adapters: List[Adapter] = adapters_for(self.entries, name)
        if not adapters:
            return
        new = self._mv(name, version)
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
                    name, version, _text(exc))
            self.events.put(SwitchEvent(0, "restored", name, error=error))

        threading.Thread(target=work, name="model-restore", daemon=True).start()

    def retry(self, name: str, version: str) -> Dict[str, Any]:
        """An operator lets a rejected version be activated again."""
        validate_name(name)
        validate_version(version)
        forgotten = self.journal.forget_rejected(name, version)
        self.changed()
        return {"name": name, "version": version, "forgotten": forgotten}

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
        self.disk_health = {}
        for row in self.journal.active_versions():
            on_disk = models_guard.health(problems, row["name"], row["version"])
            self.disk_health[row["name"]] = on_disk
            app = self.health.get(row["name"], "ok")
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


def committing_stage(run: Run) -> str:
    """The stage of a job whose version is pending: ``committing``; for a job without a model
    name (a controller of the release before named models, whose schema knows no such stage)
    ``activating``, with ``commit: pending`` in its details either way."""
    return "committing" if run.doc.get("model_name") is not None else "activating"


def _text(exc: BaseException) -> str:
    return exc.message if isinstance(exc, AgentError) else "{}: {}".format(
        type(exc).__name__, exc)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
