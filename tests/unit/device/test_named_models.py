"""Named models on the device, below the daemon: the journal's in-place upgrade from the previous
release's schema, names and versions, meta.json, the models directory, the hand-off list and the
``command`` adapter, the commit state machine, and the model switch driven as the main loop
drives it (its threads' events pumped here): commit, unhealthy report, timeout, a failing
hand-off, a restart while pending, rollback by name, a rejected version refused."""

import os
import queue
import sqlite3
import sys
import time

import pytest

from agent.device import config, handoff
from agent.device.app import requests as app_requests
from agent.device.jobs.run import Run
from agent.device.journal.store import Journal
from agent.device.models import commit_logic
from agent.device.models import meta as model_meta
from agent.device.models.directory import ModelsDir, version_problem
from agent.device.models.switch import ModelSwitch, names_for
from agent.errors import AgentError
from agent.wire.model_names import validate_name, validate_version

FIXTURES = os.path.join(os.path.join(os.path.dirname(__file__), "..", ".."), "fixtures", "journal")
A, B = "a" * 64, "b" * 64


def test_journal_v1_upgrades_in_place(tmp_path):
    path = str(tmp_path / "journal.sqlite3")
    db = sqlite3.connect(path)
    with open(os.path.join(FIXTURES, "journal_v1.sql")) as f:
        db.executescript(f.read())
    db.execute("PRAGMA user_version=1")
    db.commit()
    db.close()
    with Journal(path) as j:
        # jobs, outbox, transfers, boot, notes, sequences: all there
        assert [r["job_id"] for r in j.jobs()] == ["deploy-1", "deploy-2"]
        assert j.job("deploy-1")["result"] == {"engine_key": "k1"}
        assert len(j.outbox_pending()) == 1 and j.transfers()[0]["sha256"] == A
        assert j.boot() == 1 and j.note("connection") == {"x": 1}
        assert j.last_sequence("key1") == 5
        # engines -> versions of sha-<12 hex>
        rows = {(r["name"], r["version"]): r for r in j.model_versions()}
        active = rows[("sha-" + A[:12], A[:12])]
        assert active["active"] and active["state"] == "committed"
        assert active["engine_key"].startswith("e2") and active["precision"] == "int8"
        previous = rows[("sha-" + A[:12], A[:12] + "+e1000000")]
        assert not previous["active"] and previous["info"]["engine"] == "/x/e1"
        assert active["previous"] == previous["version"]
        assert rows[("sha-" + B[:12], B[:12])]["engine_key"].startswith("f1")
        assert j.previous_engine(A)["engine_key"].startswith("e1")
        assert sorted(e["model"] for e in j.active_engines()) == [A, B]
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 2
    assert db.execute("SELECT COUNT(*) FROM engines").fetchone()[0] == 3  # nothing dropped
    db.close()
    with Journal(path) as j:  # opening again changes nothing
        assert len(j.model_versions()) == 3


def test_upgraded_versions_get_their_directories(tmp_path):
    engine = tmp_path / "cache-engine"
    engine.write_bytes(b"plan")
    with Journal(str(tmp_path / "journal.sqlite3")) as j:
        j.activate_version("sha-" + A[:12], A[:12], A, "e1", "fp16", "j1",
                           info={"engine": str(engine)})
    h = Harness(tmp_path)
    assert h.current("sha-" + A[:12]) == A[:12]
    path = os.path.join(h.cfg.models_dir, "sha-" + A[:12], A[:12])
    assert version_problem(path) is None


def test_names_and_versions():
    assert validate_name("detector-v1.2_x") == "detector-v1.2_x"
    assert validate_version("2.0.1+build.7") == "2.0.1+build.7"
    for bad in ("", "Det", ".x", "a/b", "a" * 65, None, 3):
        with pytest.raises(AgentError) as e:
            validate_name(bad)
        assert e.value.code == "bad_model_name" and "expected" in e.value.message
    for bad in (".", "..", "-x", "a/b", "a b", "v" * 65):
        with pytest.raises(AgentError) as e:
            validate_version(bad)
        assert e.value.code == "bad_model_version"
    assert names_for({}, A) == ("sha-" + A[:12], A[:12])
    assert names_for({"model_name": "det", "model_version": "v2"}, A) == ("det", "v2")


def test_meta_json_keys():
    meta = model_meta.build(
        "det", "v1", A, {"engine_key": "k", "precision": "int8", "layers_kept": {"fc": "fp32"},
                         "io": {"inputs": [{"name": "x", "shape": [1, 3], "dtype": "float32"}],
                                "outputs": [{"name": "y", "shape": [1], "dtype": "float32"}]},
                         "accuracy": {"passed": True, "top1_agreement": 0.99},
                         "throughput_qps": 12.5},
        {"board": "orin", "jetpack": "6.0", "tensorrt": "8.6"},
        {"gpu": "orin", "cuda": "12.2", "tensorrt": "8.6", "backend": "tensorrt"}, "j1", 5.0,
        "pending", "e" * 64, 100)
    assert set(meta) == set(model_meta.META_KEYS)
    assert meta["gate"] == {"passed": True, "top1_agreement": 0.99}
    assert meta["portability"]["cuda"] == "12.2" and meta["inputs"][0]["name"] == "x"


def test_commit_logic():
    s = commit_logic.CommitState(commit_logic.needs(True, False, True), 10.0, 10.0)
    assert s.decide(1.0).action == commit_logic.WAIT
    s.on_handoff([None, True])
    assert s.decide(1.0).action == commit_logic.WAIT
    s.on_health(True)
    assert s.decide(1.0).action == commit_logic.COMMIT
    s = commit_logic.CommitState(commit_logic.needs(False, True, False), 10.0, 10.0)
    assert s.decide(10.0) == (commit_logic.ROLLBACK, "no confirmation (probe) within 10 s")
    s = commit_logic.CommitState(commit_logic.needs(True, False, False), 10.0, 10.0)
    s.on_handoff([False])
    s.on_commit("x")  # too late: the failure wins
    assert s.decide(1.0).action == commit_logic.ROLLBACK
    assert commit_logic.CommitState(frozenset(), 0, 0).decide(0).action == commit_logic.COMMIT
    s = commit_logic.CommitState(frozenset({"live", "app"}), 10.0, 10.0)
    s.on_live(True)
    assert s.decide(1.0).action == commit_logic.WAIT  # the app's word is still awaited
    s.on_health(True)
    assert s.decide(1.0).action == commit_logic.COMMIT
    s = commit_logic.CommitState(frozenset({"live"}), 10.0, 10.0)
    s.on_live(False, "live check: top-1 agreement 0.1")
    assert s.decide(1.0) == (commit_logic.ROLLBACK, "live check: top-1 agreement 0.1")
    # An explicit commit waits for the live check's verdict (a refusal still wins), and
    # stands at the deadline without one.
    s = commit_logic.CommitState(frozenset({"live", "app"}), 10.0, 10.0)
    s.on_commit("the app")
    assert s.decide(1.0).action == commit_logic.WAIT
    assert s.decide(10.0) == (commit_logic.COMMIT, "committed by the app")
    s.on_live(False, "live check: top-1 agreement 0.1")
    assert s.decide(1.0) == (commit_logic.ROLLBACK, "live check: top-1 agreement 0.1")
    s = commit_logic.CommitState(frozenset({"live", "app"}), 10.0, 10.0)
    s.on_commit("the app")
    s.on_live(True)
    assert s.decide(1.0) == (commit_logic.COMMIT, "committed by the app")


def test_handoff_list_is_checked():
    entries = handoff.parse([{"type": "command", "models": ["det"], "command": ["true"]}])
    assert entries[0].adapter.kind == "command" and entries[0].serves("det")
    assert not entries[0].serves("other")
    bad = [[{"type": "nope", "command": ["x"]}], [{"type": "command", "command": "true"}],
           [{"type": "command", "command": ["x"], "shell": True}],
           [{"type": "command", "models": ["Bad Name"], "command": ["x"]}], ["x"]]
    for entry in bad:
        with pytest.raises(AgentError) as e:
            handoff.parse(entry)
        assert e.value.code == "bad_config" and "handoff[0]" in e.value.message, entry


def test_config_models_section(tmp_path):
    path = tmp_path / "agent.yaml"
    path.write_text("state_dir: {}\nmodels:\n  keep_versions: 3\n  probe: [\"true\"]\n"
                    "handoff:\n  - type: command\n    command: [\"true\"]\n".format(tmp_path))
    cfg = config.load(str(path), env={})
    assert cfg.models.keep_versions == 3 and cfg.models.probe == ["true"]
    assert cfg.models_dir == os.path.join(str(tmp_path), "models")
    assert cfg.handoff[0]["type"] == "command"
    path.write_text("models:\n  keep_versions: 1\n")
    with pytest.raises(AgentError) as e:
        config.load(str(path), env={})
    assert "keep_versions" in e.value.message


def test_models_dir_writes_whole_versions(tmp_path):
    engine = tmp_path / "engine.bin"
    engine.write_bytes(b"E" * 1000)
    md = ModelsDir(str(tmp_path / "models"))
    steps = []
    md.on_step = steps.append

    def meta_for(sha, size):
        return {"engine_sha256": sha, "engine_size": size}

    path = md.write_version("det", "v1", str(engine), None, meta_for)
    assert version_problem(path) is None
    assert os.stat(path + "/model.engine").st_ino == engine.stat().st_ino  # a hard link
    assert oct(os.stat(path + "/model.engine").st_mode & 0o777) == "0o640"
    md.set_current("det", "v1")
    assert os.readlink(str(tmp_path / "models/det/current")) == "v1"
    assert steps == ["version_written", "link_switched"]
    md.write_version("det", "v2", str(engine), None, meta_for)
    md.set_current("det", "v2")
    assert not md.remove_version("det", "v2")  # current: never removed
    os.makedirs(str(tmp_path / "models/det/.tmp-v3"))
    md.reconcile({"det": "v1"}, {"det": ["v1"]})
    assert md.current("det") == "v1" and md.versions("det") == ["v1"]
    assert not os.path.exists(str(tmp_path / "models/det/.tmp-v3"))


# --------------------------------------------------------------------------- the switch

class Harness:
    """A ModelSwitch on a real journal and models directory; ``pump`` plays the main loop."""

    def __init__(self, tmp_path, handoff_list=(), **models):
        overrides = {("state_dir",): str(tmp_path)}
        for key, value in models.items():
            overrides[("models", key)] = value
        self.cfg = config.load(None, overrides=overrides, env={})
        self.tmp = tmp_path
        self.journal = Journal(str(tmp_path / "journal.sqlite3"))
        self.events = queue.Queue()
        self.ended = {}
        self.changes = 0
        self.switch = self._switch(list(handoff_list))

    def _switch(self, handoff_list):
        class Shared:
            run = None

        self.shared = Shared()  # the job in hand, as the daemon's (JobEnding frees it)

        def end(run, state, error=None, result=None):
            self.journal.set_state(run.job_id, state, error=error, result=result)
            self.ended[run.job_id] = (state, error, result)
            if self.shared.run is run:
                self.shared.run = None

        def changed():
            self.changes += 1

        sw = ModelSwitch(self.cfg, self.journal, ModelsDir(self.cfg.models_dir),
                         handoff.parse(handoff_list), self.events, self.shared, end,
                         lambda run, stage: self.journal.set_state(
                             run.job_id, "IN_PROGRESS", stage=stage, details=run.details),
                         changed, lambda: {"board": "test"})
        sw.reconcile()
        return sw

    def restart(self, handoff_list=()):
        self.events = queue.Queue()
        self.switch = self._switch(list(handoff_list))

    def deploy(self, job_id, name, version, engine_bytes, sha=A):
        engine = self.tmp / (job_id + ".engine")
        engine.write_bytes(engine_bytes)
        self.journal.add_job({"job_id": job_id, "kind": "deploy"})
        self.journal.set_state(job_id, "IN_PROGRESS")
        run = Run({"job_id": job_id, "kind": "deploy", "details": {},
                   "doc": {"model_name": name, "model_version": version}}, 60)
        run.needed["model"] = (sha, 1)
        self.shared.run = run
        self.switch.activate(run, {"engine_key": "key-" + job_id, "precision": "fp16"},
                             str(engine))
        return run

    def pump(self, until, timeout=15.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = until()
            if value:
                return value
            try:
                ev = self.events.get(timeout=0.05)
            except queue.Empty:
                self.switch.tick()
                continue
            if isinstance(ev, app_requests.AppRequest):
                app_requests.answer(self.switch, ev)
            else:
                self.switch.on_event(ev)
        raise AssertionError("timed out; ended: {}".format(self.ended))

    def current(self, name):
        return self.switch.models.current(name)


def test_no_handoff_commits_at_once_and_names_live_side_by_side(tmp_path):
    h = Harness(tmp_path)
    h.deploy("j1", "det", "v1", b"one")
    h.pump(lambda: "j1" in h.ended)
    h.deploy("j2", "det", "v2", b"two")
    h.pump(lambda: "j2" in h.ended)
    h.deploy("j3", "cls", "v1", b"three", sha=B)
    h.pump(lambda: "j3" in h.ended)
    state, _, result = h.ended["j2"]
    assert state == "SUCCEEDED"
    assert result["model"] == {"name": "det", "version": "v2", "previous": "v1",
                               "state": "committed"}
    assert h.current("det") == "v2" and h.current("cls") == "v1"
    with open(os.path.join(h.cfg.models_dir, "det", "current", "model.engine"), "rb") as f:
        assert f.read() == b"two"
    listed = {m["name"]: m for m in h.switch.models_list()}
    assert listed["det"]["previous"] == "v1" and listed["det"]["state"] == "committed"
    # rollback by name: v1 back, v2's directory gone, nothing left to go back to
    out = h.switch.rollback("det")
    assert out["version"] == "v1" and out["replaced"] == "v2"
    assert h.current("det") == "v1" and h.switch.models.versions("det") == ["v1"]
    with pytest.raises(AgentError) as e:
        h.switch.rollback("det")
    assert e.value.code == "no_previous_version" and "expected" in e.value.message


def test_app_unhealthy_report_rolls_back_and_rejects(tmp_path):
    h = Harness(tmp_path, app_confirms=["det"], commit_timeout_s=30)
    h.deploy("j1", "det", "v1", b"one")
    h.pump(lambda: h.switch.pending is not None and h.switch.pending.phase == "waiting")
    reply = h.switch.commit("det", None, "the app")  # the app commits v1
    assert reply["state"] == "committed" and h.ended["j1"][0] == "SUCCEEDED"
    h.deploy("j2", "det", "v2", b"two")
    h.pump(lambda: h.current("det") == "v2" and h.switch.pending.phase == "waiting")
    assert h.journal.job("j2")["stage"] == "committing"
    assert h.journal.active_version("det")["state"] == "pending"
    # the app's report, through the socket's handler as its thread would send it
    handle = app_requests.handler(h.events)
    import threading

    answers = []
    t = threading.Thread(target=lambda: answers.append(handle(
        {"op": "health", "name": "det", "version": "v2", "ok": False,
         "detail": "outputs wrong on 3 of 5 stored inputs"}, {"uid": os.getuid()})))
    t.start()
    h.pump(lambda: "j2" in h.ended)
    t.join(5)
    assert answers[0]["ok"] is True
    state, error, _ = h.ended["j2"]
    assert state == "FAILED" and error["code"] == "handoff_rolled_back"
    assert error["details"]["version"] == "v2" and error["details"]["previous"] == "v1"
    assert "outputs wrong" in error["message"]
    assert h.current("det") == "v1" and h.switch.models.versions("det") == ["v1"]
    assert [r["version"] for r in h.journal.rejected_versions("det")] == ["v2"]
    with pytest.raises(AgentError) as e:
        h.switch.check_job({"model_name": "det", "model_version": "v2"}, A)
    assert e.value.code == "version_rejected"
    h.switch.check_job({"model_name": "det", "model_version": "v3"}, A)  # a newer one: fine
    h.switch.retry("det", "v2")
    h.switch.check_job({"model_name": "det", "model_version": "v2"}, A)  # retried: fine


def test_probe_timeout_rolls_back(tmp_path):
    h = Harness(tmp_path, probe=[sys.executable, "-c", "raise SystemExit(1)"],
                commit_timeout_s=2)
    h.deploy("j1", "det", "v1", b"one")
    h.pump(lambda: "j1" in h.ended)
    assert h.ended["j1"][0] == "FAILED"  # the first version too: no previous, no current
    assert h.current("det") is None and h.journal.active_version("det") is None
    assert "no confirmation (probe) within 2 s" in h.ended["j1"][1]["message"]


def test_command_adapter_gets_the_model_and_its_failure_rolls_back(tmp_path):
    log = tmp_path / "handoff.log"
    script = tmp_path / "reload.py"
    script.write_text(
        "import os, sys\n"
        "e = os.environ\n"
        "open({!r}, 'a').write(' '.join(e['JETSON_AGENT_MODEL_' + k] for k in ('EVENT', "
        "'NAME', 'VERSION', 'PREVIOUS_VERSION')) + '\\n')\n"
        "assert os.path.exists(e['JETSON_AGENT_MODEL_ENGINE'])\n"
        "assert os.path.exists(e['JETSON_AGENT_MODEL_META'])\n"
        "sys.exit(3 if e['JETSON_AGENT_MODEL_VERSION'] == 'v3' and "
        "e['JETSON_AGENT_MODEL_EVENT'] == 'switch' else 0)\n".format(str(log)))
    entries = [{"type": "command", "models": ["det"],
                "command": [sys.executable, str(script)], "timeout_s": 20}]
    h = Harness(tmp_path, entries)
    h.deploy("j1", "det", "v1", b"one")
    h.pump(lambda: "j1" in h.ended)
    h.deploy("j2", "det", "v2", b"two")
    h.pump(lambda: "j2" in h.ended)
    h.deploy("j3", "det", "v3", b"three")
    h.pump(lambda: "j3" in h.ended)
    assert [h.ended[j][0] for j in ("j1", "j2", "j3")] == ["SUCCEEDED", "SUCCEEDED", "FAILED"]
    assert h.ended["j3"][1]["code"] == "handoff_rolled_back"
    assert "exited with status 3" in h.ended["j3"][1]["message"]
    assert log.read_text().splitlines() == ["switch det v1 ", "switch det v2 v1",
                                            "switch det v3 v2", "revert det v2 v3"]
    assert h.current("det") == "v2"


def test_restart_while_pending_resumes_or_rolls_back(tmp_path):
    flag = tmp_path / "healthy"
    probe = [sys.executable, "-c", "import os, sys; sys.exit(0 if os.path.exists({!r}) else 1)"
             .format(str(flag))]
    h = Harness(tmp_path, probe=probe, commit_timeout_s=60, unconfirmed_retries=0)
    flag.write_text("")
    h.deploy("j1", "det", "v1", b"one")
    h.pump(lambda: "j1" in h.ended)
    flag.unlink()
    run = h.deploy("j2", "det", "v2", b"two")
    h.pump(lambda: h.current("det") == "v2" and h.switch.pending.phase == "waiting")
    # the daemon dies here; a new one resumes the job the scheduler hands it
    h.restart()
    assert h.current("det") == "v2"
    row = h.journal.job("j2")
    assert row["details"]["commit"] == "pending"
    h.shared.run = Run(row, 60)  # the scheduler's
    h.switch.resume(h.shared.run)
    flag.write_text("")
    h.pump(lambda: "j2" in h.ended)
    assert h.ended["j2"][0] == "SUCCEEDED" and h.current("det") == "v2"
    # pending again, and the deadline passes while the daemon is down: rolled back on restart
    flag.unlink()
    h.deploy("j3", "det", "v3", b"three")
    h.pump(lambda: h.current("det") == "v3" and h.switch.pending.phase == "waiting")
    db = sqlite3.connect(str(tmp_path / "journal.sqlite3"))
    db.execute("UPDATE models SET deadline = 1 WHERE version = 'v3'")
    db.commit()
    db.close()
    h.restart()
    assert h.current("det") == "v2"  # straight back, before anything else runs
    h.shared.run = Run(h.journal.job("j3"), 60)
    h.switch.resume(h.shared.run)
    h.pump(lambda: "j3" in h.ended)
    assert h.ended["j3"][1]["code"] == "handoff_rolled_back"
    assert "unconfirmed: " in h.ended["j3"][1]["message"]  # nobody answered: not rejected
    assert [(r["version"], r["state"]) for r in h.journal.rejected_versions("det")] == [
        ("v3", "unconfirmed")]
    assert h.journal.active_version("det")["version"] == "v2"
    assert run.job_id == "j2"


def test_a_live_check_refusal_recorded_before_a_restart_still_refuses(tmp_path):
    """The check refused v2 (meta.json holds its figures) and the daemon died before the
    rollback began: the resumed wait ends in the same refusal, never in a commit."""
    h = Harness(tmp_path, app_confirms=["det"], commit_timeout_s=60)
    h.deploy("j1", "det", "v1", b"one")
    h.pump(_pending(h, "v1"))
    h.switch.commit("det", None, "the app")
    h.deploy("j2", "det", "v2", b"two")
    h.pump(_pending(h, "v2"))
    assert "0 donated samples" in h.switch.live.recorded("det", "v2")["skipped"]
    refused = {"passed": False, "samples": 64, "agreement": 0.1, "error": 0.4,
               "error_stat": "mean", "min_agreement": 0.95, "max_error": None, "worst": [5, 2],
               "running": "v1"}
    h.switch.models.update_meta("det", "v2", {"live_check": refused})
    h.restart()
    h.shared.run = Run(h.journal.job("j2"), 60)
    h.switch.resume(h.shared.run)
    h.pump(lambda: "j2" in h.ended)
    state, error, _ = h.ended["j2"]
    assert state == "FAILED" and error["code"] == "live_check_failed", error
    assert error["details"]["live_check"]["worst"] == [5, 2] and h.current("det") == "v1"


def test_an_apps_commit_waits_for_the_live_checks_verdict(tmp_path):
    """The app commits before the live check has ended: the reply says pending, and the
    check's refusal still rolls the version back."""
    from agent.device.models.switch import SwitchEvent

    h = Harness(tmp_path, app_confirms=["det"], commit_timeout_s=60)
    h.deploy("j1", "det", "v1", b"one")
    h.pump(_pending(h, "v1"))
    h.switch.commit("det", None, "the app")
    started = []
    h.switch.live.skip_reason = lambda name, running: None  # enough samples, say
    h.switch.live.start = lambda *args: started.append(args)
    h.deploy("j2", "det", "v2", b"two")
    h.pump(_pending(h, "v2"))
    token = h.switch.pending.token
    assert started == [(token, "det", "v2", "v1")]
    assert h.switch.commit("det", "v2", "the app")["state"] == "pending"
    h.events.put(SwitchEvent(token, "live", {
        "passed": False, "samples": 64, "agreement": 0.1, "error": 0.4, "error_stat": "mean",
        "min_agreement": 0.95, "max_error": None, "worst": [5], "running": "v1"}))
    h.pump(lambda: "j2" in h.ended)
    assert h.ended["j2"][1]["code"] == "live_check_failed" and h.current("det") == "v1"


def _pending(h, version):
    return lambda: h.current("det") == version and h.switch.pending is not None and \
        h.switch.pending.phase == "waiting"


def test_a_pending_version_keeps_every_rollback_target(tmp_path):
    h = Harness(tmp_path, app_confirms=["det"], commit_timeout_s=30, keep_versions=2)
    for job, version in (("j1", "v1"), ("j2", "v2")):
        h.deploy(job, "det", version, version.encode())
        h.pump(_pending(h, version))
        h.switch.commit("det", None, "the app")
    h.deploy("j3", "det", "v3", b"three")
    h.pump(_pending(h, "v3"))
    # v3 pending does not count against keep_versions: v1 is still a rollback target
    assert [r["version"] for r in h.journal.model_versions("det")] == ["v3", "v2", "v1"]
    assert h.switch.models.versions("det") == ["v1", "v2", "v3"]
    h.switch.report_health("det", "v3", False, "refused by the probe")
    h.pump(lambda: "j3" in h.ended)
    assert h.current("det") == "v2"
    out = h.switch.rollback("det", "v1")
    assert out["version"] == "v1" and h.current("det") == "v1"
    # a commit prunes: v1, v2 committed with keep_versions 2 keeps the active and one more
    h.deploy("j4", "det", "v4", b"four")
    h.pump(_pending(h, "v4"))
    h.switch.commit("det", None, "the app")
    assert [r["version"] for r in h.journal.model_versions("det")] == ["v4", "v1"]


def test_unconfirmed_version_is_retried_once_then_not_rejected(tmp_path):
    h = Harness(tmp_path, app_confirms=["det"], commit_timeout_s=30)
    h.deploy("j1", "det", "v1", b"one")
    h.pump(_pending(h, "v1"))
    h.switch.pending.state.deadline = 0  # the commit window closes: nobody answered
    h.pump(lambda: h.switch.pending.retries == 1 and h.switch.pending.phase == "waiting")
    row = h.journal.active_version("det")
    assert row["state"] == "pending" and row["info"]["unconfirmed_retries"] == 1
    assert row["deadline"] > time.time() + 20  # a new window
    assert h.switch.models_list()[0]["retries"] == 1
    h.switch.commit("det", None, "the app")
    assert h.ended["j1"][0] == "SUCCEEDED"
    h.deploy("j2", "det", "v2", b"two")
    for _ in range(2):  # its window closes twice: the retry is spent
        h.pump(_pending(h, "v2"))
        h.switch.pending.state.deadline = 0
        h.switch.tick()
    h.pump(lambda: "j2" in h.ended)
    state, error, _ = h.ended["j2"]
    assert state == "FAILED" and error["code"] == "handoff_rolled_back"
    assert "unconfirmed: no confirmation (app)" in error["message"]
    assert h.current("det") == "v1"
    listed = h.switch.models_list()[0]
    assert listed["unconfirmed"] == ["v2"] and listed["rejected"] == []
    h.switch.check_job({"model_name": "det", "model_version": "v2"}, A)  # not refused
    h.deploy("j3", "det", "v2", b"two")  # brought again, and committed this time
    h.pump(_pending(h, "v2"))
    h.switch.commit("det", None, "the app")
    assert h.ended["j3"][0] == "SUCCEEDED" and h.journal.rejected_versions("det") == []


def test_a_cancelled_pending_job_is_rolled_back(tmp_path):
    h = Harness(tmp_path, app_confirms=["det"], commit_timeout_s=30)
    h.deploy("j1", "det", "v1", b"one")
    h.pump(_pending(h, "v1"))
    h.switch.commit("det", None, "the app")
    h.deploy("j2", "det", "v2", b"two")
    h.pump(_pending(h, "v2"))
    # the controller cancels j2: intake ends it (JobEnding frees the job in hand)
    h.journal.set_state("j2", "CANCELED")
    h.shared.run = None
    h.pump(lambda: h.switch.pending is None)
    assert h.current("det") == "v1" and h.journal.active_version("det")["version"] == "v1"
    with pytest.raises(AgentError) as e:
        h.switch.commit("det", "v2", "the app")
    assert e.value.code == "not_pending"
    assert "j2" not in h.ended  # it stays CANCELED
    assert h.journal.job("j2")["state"] == "CANCELED"


def test_a_commit_of_a_version_rolling_back_is_refused_by_the_table(tmp_path):
    """The switch's table has no row for a commit while rolling back: not_pending, and the
    rollback goes on (a second operator rollback is a row that does nothing)."""
    h = Harness(tmp_path, app_confirms=["det"], commit_timeout_s=30)
    h.deploy("j1", "det", "v1", b"one")
    h.pump(_pending(h, "v1"))
    h.switch.commit("det", None, "the app")
    h.deploy("j2", "det", "v2", b"two")
    h.pump(_pending(h, "v2"))
    assert h.switch.rollback("det")["state"] == "rolling_back"
    assert h.switch.rollback("det")["state"] == "rolling_back"
    with pytest.raises(AgentError) as e:
        h.switch.commit("det", "v2", "the app")
    assert e.value.code == "not_pending" and "det@v2 (rolling_back)" in e.value.message
    h.pump(lambda: "j2" in h.ended)
    assert h.ended["j2"][1]["code"] == "handoff_rolled_back" and h.current("det") == "v1"


def test_a_failing_probe_is_an_answer_and_a_passing_one_leaves_the_apps_silence(tmp_path):
    flag = tmp_path / "healthy"
    probe = [sys.executable, "-c", "import os, sys; sys.exit(0 if os.path.exists({!r}) else 1)"
             .format(str(flag))]
    h = Harness(tmp_path, probe=probe, app_confirms=["det"], commit_timeout_s=60,
                unconfirmed_retries=0)
    flag.write_text("")
    h.deploy("j1", "det", "v1", b"one")
    h.pump(lambda: h.switch.pending is not None and "probe" in h.switch.pending.state.confirmed)
    h.switch.pending.state.deadline = 0  # the probe said yes; the app said nothing
    h.pump(lambda: "j1" in h.ended)
    assert "unconfirmed: no confirmation (app)" in h.ended["j1"][1]["message"]
    flag.unlink()
    h.deploy("j2", "det", "v2", b"two")
    h.pump(lambda: h.switch.pending is not None and h.switch.pending.probe_failed)
    h.switch.pending.state.deadline = 0  # the probe said no until the end: refused
    h.pump(lambda: "j2" in h.ended)
    assert "unconfirmed" not in h.ended["j2"][1]["message"]
    assert [(r["version"], r["state"]) for r in h.journal.rejected_versions("det")] == [
        ("v1", "unconfirmed"), ("v2", "rejected")]
def test_meta_names_the_builder_of_an_adopted_engine_only():
    import base64
    import hashlib

    raw = b"k" * 32
    doc = {"artifacts": {"engine": {"sha256": "e" * 64, "builder": {
        "device": "orin-b", "job_id": "ro-1", "sig": "c2ln",
        "public_key": base64.b64encode(raw).decode("ascii"), "engine_class": None}}}}
    got = model_meta.provenance(doc, {"share": {"mode": "adopted"}})
    assert got == {"device": "orin-b", "key_id": hashlib.sha256(raw).hexdigest()[:16],
                   "job_id": "ro-1", "sig": "c2ln", "shared_sha256": "e" * 64}
    assert model_meta.provenance(doc, {"share": {"mode": "built"}}) is None
    assert model_meta.provenance({}, {"share": {"mode": "adopted"}}) is None
    bad = {"artifacts": {"engine": {"builder": {"device": "x", "public_key": "%%"}}}}
    assert model_meta.provenance(bad, {"share": {"mode": "adopted"}})["key_id"] is None
