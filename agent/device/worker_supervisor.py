"""The worker subprocess: launch it, read its JSON lines (progress, result, error), stop it on
cancel, timeout or shutdown (SIGTERM, then SIGKILL), and end the job (through ``job_end``) with
the reason it gives or the way it died; a deployed engine goes to the model switch.

Memory: the worker gets an RLIMIT_DATA ceiling (``limits.worker_memory_bytes``, default three
quarters of the device's memory) right after it starts, so a blow-up the artifact checks missed
ends in the worker (MemoryError -> FAILED ``out_of_memory`` naming the limit), never in the
daemon. RLIMIT_DATA and not RLIMIT_AS: CUDA reserves large address ranges it never backs, which
an address-space limit would count. The unit's ``MemoryMax=`` is the outer bound; a kernel OOM
kill of the worker (SIGKILL with the cgroup's oom_kill count raised) is ``out_of_memory`` too."""

import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, Optional

from agent.device.config import Config, http_ca_file
from agent.device.daemon_state import DaemonState
from agent.device.jobs.end import REJECT_CODES, JobEnding
from agent.device.jobs.run import PROGRESS_EVERY_S, Run
from agent.device.models import guard as models_guard
from agent.device.status_publisher import StatusPublisher, fit_result
from agent.device.worker_process import (
    WorkerEvent,
    describe_exit,
    limit_memory,
    oom_kills,
    signal_group,
    stderr_tail,
)
from agent.errors import CODES, AgentError
from agent.fsio import atomic_write
from agent.wire import protocol
from agent.wire.device.artifacts import ArtifactStore
from agent.worker import jobs

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

KILL_GRACE_S = 5.0  # SIGTERM to SIGKILL for a worker being stopped
# What a native allocation failure leaves in the worker's stderr before it dies.
MEMORY_MARKERS = ("MemoryError", "bad_alloc", "Cannot allocate memory", "Failed to allocate",
                  "out of memory")
WORKER_STAGES = ("calibrating", "building", "verifying", "searching", "benchmarking",
                 "activating")
AGENT_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER_PACKAGES = ("agent", "calib")  # what the worker imports from this installation
MAX_WORKER_LINE_BYTES = 4 << 20  # a worker's JSON line (results are capped far below)


def shared_engine_paths(run: Any, own_class: Any) -> Any:
    """The job's artifact paths, without a shared ``engine`` its builder's signature does not
    bind (docs/security.md, "A shared engine's trust chain"): (paths, why refused or "")."""
    paths = dict(run.paths)
    if "engine" not in paths:
        return paths, ""
    from agent.wire import device_identity

    ref: Dict[str, Any] = (run.doc.get("artifacts") or {}).get("engine") or {}
    builder: Dict[str, Any] = ref["builder"] if isinstance(ref.get("builder"), dict) else {}
    raw = device_identity.public_key_of({"alg": "ed25519",
                                         "public_key": builder.get("public_key")})
    statement = device_identity.engine_statement(
        str(builder.get("device")), str(builder.get("job_id")), str(ref.get("sha256")),
        int(ref.get("size") or 0), builder.get("engine_class"))
    why = ""
    if raw is None or not builder.get("sig"):
        why = "the shared engine carries no builder signature: built here"
    elif not device_identity.verify_engine(raw, statement, str(builder["sig"])):
        why = "the shared engine's builder signature does not verify: built here"
    elif builder.get("engine_class") != own_class:
        why = "the shared engine was built for another device class: built here"
    if why:
        log.warning("job %s: %s", run.job_id, why)
        paths.pop("engine")
    return paths, why



def worker_path(state_dir: str) -> str:
    """A directory holding only our packages (symlinks), for the worker's PYTHONPATH: the
    worker may be another interpreter (JetPack 4.6's Python 3.6), which must not pick up
    the daemon's site-packages (numpy built for another Python)."""
    path = os.path.join(state_dir, "pythonpath")
    os.makedirs(path, exist_ok=True)
    for package in WORKER_PACKAGES:
        src = os.path.join(AGENT_PARENT, package)
        link = os.path.join(path, package)
        if not os.path.isdir(src):
            continue
        if os.path.islink(link) and os.readlink(link) == src:
            continue
        tmp = link + ".tmp"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(src, tmp)
        os.replace(tmp, link)
    return path


def worker_env(state_dir: str) -> Dict[str, str]:
    """The environment of a worker-side child process (a job's worker, a live check)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [worker_path(state_dir)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                    if p])
    env["JETSON_AGENT_STATE_DIR"] = state_dir
    return env

class WorkerSupervisor:
    """The worker subprocess of the job in hand. Its reader thread puts ``WorkerEvent``s on
    ``events`` (the main loop's queue), which come back through ``on_event``."""

    def __init__(self, cfg: Config, device: str, state_dir: str, store: ArtifactStore,
                 journal: Any, events: "queue.Queue[Any]", shared: DaemonState,
                 publisher: StatusPublisher, ending: JobEnding,
                 show_activity: Callable[[], None],
                 activate_model: Callable[[Run, Dict[str, Any], str], None]) -> None:
        self.cfg = cfg
        self.device = device
        self.state_dir = state_dir
        self.store = store
        self.journal = journal
        self.activate_model = activate_model  # a deployed engine becomes a model version
        self.events = events
        self.shared = shared
        self.publisher = publisher
        self.ending = ending
        self.show_activity = show_activity
        self.token = 0  # tells this worker's events from an earlier one's
        self.oom_kills_at_launch = 0  # the cgroup's OOM kill count when the worker started
        # This device's platform.engine_class (a shared engine of another class is refused).
        self.engine_class: Callable[[], Any] = lambda: None

    def launch(self, run: Run) -> None:
        for sha, _ in run.needed.values():
            self.store.touch(sha)
        run.work_dir = os.path.join(self.state_dir, "work", run.job_id)
        os.makedirs(run.work_dir, exist_ok=True)
        paths, refused = shared_engine_paths(run, self.engine_class())
        if "plugin" in paths:  # a signed plugin artifact: loaded only from the models dir
            from agent.engines import plugins

            entry = plugins.install_library(paths.pop("plugin"), run.needed["plugin"][0],
                                            self.cfg.models_dir)
            run.plan = dict(run.plan, plugins=list(run.plan.get("plugins") or []) + [entry])
        spec = jobs.make_spec(
            run.job_id, run.kind, run.plan, paths, run.backend, run.work_dir,
            os.path.join(self.cfg.cache_dir, "engines"),
            os.path.join(self.cfg.cache_dir, "calibration"),
            run.fingerprint, self.cfg.cache.engine_budget_bytes, gate=run.doc.get("gate"),
            bench=run.doc.get("bench"), search=run.doc.get("search"),
            fallback_reason=run.fallback_reason, limits=self._worker_limits())
        # The artifact's own name, for `cache ls` (the worker stages it as model.onnx).
        spec["model_label"] = ((run.doc.get("artifacts") or {}).get("model") or {}).get("name")
        spec["device"] = self.device
        spec["platform_root"] = self.cfg.platform_root  # conditions.snapshot reads it
        spec["share"] = dict(run.doc.get("share") or {})  # fleet engine sharing: offer URL
        if refused:  # a shared engine not bound to its builder: never handed to the worker
            spec["share"]["refused"] = refused
        if spec["share"].get("offer"):  # the offer is signed with the device key, here
            from agent.wire.device_identity import default_key_path

            spec["share"]["signer"] = [sys.executable, "-m", "agent.wire.device_identity",
                                       "sign-engine", self.cfg.security.device_key or
                                       default_key_path(self.cfg.source)]
            spec["share"]["engine_class"] = self.engine_class()
            # An https:// upload URL is verified with the daemon's CA (transfer.http_ca_file,
            # else broker.tls.ca_file; none: the system's CAs).
            spec["share"]["ca_file"] = http_ca_file(self.cfg)
        # The job's builds never evict an engine a kept model version uses, and publish files
        # the app's group can read.
        spec.update(models_guard.worker_spec_fields(self.cfg.models_dir, self.cfg.models.group))
        spec_path = os.path.join(run.work_dir, "job.json")
        atomic_write(spec_path, json.dumps(spec, sort_keys=True).encode("utf-8"))
        env = worker_env(self.state_dir)
        env["PYTHONUNBUFFERED"] = "1"
        run.stderr_path = os.path.join(run.work_dir, "worker.log")
        self.token += 1
        run.token = self.token
        python = self.cfg.worker_python or sys.executable
        try:
            with open(run.stderr_path, "ab") as stderr:
                run.proc = subprocess.Popen(
                    [python, "-m", "agent.worker", "--job", spec_path, "--state-dir",
                     self.state_dir],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=env,
                    cwd=run.work_dir, start_new_session=True)
        except OSError as exc:
            raise AgentError("worker_crashed", "cannot start the worker with {} (worker_python):"
                             " {}".format(python, exc.strerror or exc))
        limit_memory(run.proc.pid, self.worker_memory_bytes())
        self.oom_kills_at_launch = oom_kills()
        # Recorded with the stage change: a restarted agent knows the worker ran (and its pid).
        run.details["worker"] = "started"
        run.details["worker_pid"] = str(run.proc.pid)
        run.stage = "checking"  # the worker reads and checks the artifacts first
        self.publisher.set_state(run, "IN_PROGRESS", stage=run.stage, progress=None)
        threading.Thread(target=self._read_worker, args=(run.proc, run.token),
                         name="worker-reader", daemon=True).start()
        log.info("job %s: worker %d started (%s, %s)", run.job_id, run.proc.pid, run.kind,
                 run.plan.get("precision"))

    def worker_memory_bytes(self) -> int:
        """The worker's RLIMIT_DATA: the configured size, or 3/4 of the device's memory."""
        configured = self.cfg.limits.worker_memory_bytes
        if configured:
            return int(configured)
        try:
            total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return 0
        return int(total * 3 // 4)

    def _worker_limits(self) -> Dict[str, Any]:
        limits = self.cfg.limits
        return {"inflate_ratio": limits.inflate_ratio,
                "inflate_min_bytes": limits.inflate_min_bytes,
                "max_data_bytes": limits.max_data_bytes,
                "memory_bytes": self.worker_memory_bytes(),
                "build_memory_bytes": self.build_memory_bytes()}

    def build_memory_bytes(self) -> Optional[int]:
        """The cap on a TensorRT build's memory pools (builder.memory_limit; its default is a
        share of RAM on a shared-memory board, where the serving app lives beside it)."""
        from agent.engines.backends.tensorrt_plan import build_memory_limit
        from agent.platform.detection import memory_for_builds

        return build_memory_limit(self.cfg.builder.memory_limit,
                                  *memory_for_builds(self.cfg.platform_root))

    def _read_worker(self, proc: "subprocess.Popen[bytes]", token: int) -> None:
        assert proc.stdout is not None
        # A line is bounded: a worker printing without newlines cannot grow the daemon (the
        # pieces of a longer line fail JSON and take the non-JSON path).
        out = proc.stdout
        for line in iter(lambda: out.readline(MAX_WORKER_LINE_BYTES), b""):
            self.events.put(WorkerEvent("line", token, line))
        proc.stdout.close()
        self.events.put(WorkerEvent("exit", token, returncode=proc.wait()))

    def on_event(self, ev: WorkerEvent) -> None:
        run = self.shared.run
        if run is None or ev.token != run.token:
            return
        if ev.kind == "exit":
            self._on_worker_exit(run, ev.returncode)
            return
        try:
            msg = json.loads(ev.line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            log.warning("job %s: worker wrote a non-JSON line: %r", run.job_id, ev.line[:200])
            return
        if not isinstance(msg, dict):
            return
        kind = msg.get("type")
        if kind == "progress":
            self._on_worker_progress(run, msg)
        elif kind == "result" and isinstance(msg.get("result"), dict):
            run.result = msg["result"]
        elif kind == "error" and isinstance(msg.get("error"), dict):
            run.error = msg["error"]

    def _on_worker_progress(self, run: Run, msg: Dict[str, Any]) -> None:
        if run.cancel_requested or run.timed_out or run.stopping_for_shutdown:
            return
        stage = msg.get("stage")
        if stage not in protocol.STAGES:
            return
        done, of = msg.get("done"), msg.get("of")
        progress = ({"done": done, "of": of} if isinstance(done, int) and isinstance(of, int)
                    and done >= 0 and of >= 0 else None)
        now = time.monotonic()
        if stage == run.stage and now - run.last_progress < PROGRESS_EVERY_S and not (
                progress and progress["of"] and progress["done"] >= progress["of"]):
            return
        run.last_progress = now
        if stage != run.stage:
            run.stage = stage
            self.show_activity()
        self.publisher.set_state(run, "IN_PROGRESS", stage=stage, progress=progress)

    def _on_worker_exit(self, run: Run, returncode: int) -> None:
        run.proc = None
        if run.stopping_for_shutdown:
            return  # the job stays IN_PROGRESS and runs again after the restart
        log.info("job %s: worker %s", run.job_id, describe_exit(returncode))
        if run.cancel_requested:
            details = {"partial_result": run.result} if run.result else None
            self.ending.end(run, "CANCELED", error=AgentError(
                "cancelled", "cancelled by the controller", details).to_dict())
        elif run.timed_out:
            self.ending.end(run, "TIMED_OUT", error=AgentError(
                "job_timed_out", "the job ran longer than its timeout of {:g} s".format(
                    run.timeout_s)).to_dict())
        elif returncode == 0 and run.result is not None:
            try:
                self._succeed(run, run.result)
            except Exception as exc:  # noqa: BLE001 - the job fails with the reason, we go on
                log.exception("job %s: cannot record its result", run.job_id)
                if self.shared.run is run:
                    self.ending.end(run, "FAILED", error=AgentError(
                        "internal_error", "{}: {}".format(type(exc).__name__, exc)).to_dict())
        elif run.error is not None and returncode in (2, 3):
            code = run.error.get("code")
            if not isinstance(code, str) or code not in CODES:
                run.error = {"code": "internal_error", "message": str(run.error)[:500]}
                code = "internal_error"
            state = "REJECTED" if code in REJECT_CODES else "FAILED"
            self.ending.end(run, state, error=run.error)
        elif self._ran_out_of_memory(run, returncode):
            limit = self.worker_memory_bytes()
            self.ending.end(run, "FAILED", error=AgentError(
                "out_of_memory", "the worker {} after running out of memory: the job needs more "
                "than its limit of {:,} bytes (limits.worker_memory_bytes) or the service's "
                "MemoryMax=".format(describe_exit(returncode), limit),
                {"returncode": returncode, "limit_bytes": limit,
                 "stderr_tail": stderr_tail(run.stderr_path, 500)}).to_dict())
        else:
            tail = stderr_tail(run.stderr_path)
            self.ending.end(run, "FAILED", error=AgentError(
                "worker_crashed", "the worker {} while running the job".format(
                    describe_exit(returncode)),
                {"returncode": returncode, "stderr_tail": tail}).to_dict())

    def _ran_out_of_memory(self, run: Run, returncode: int) -> bool:
        """A worker death that was an allocation failure: the kernel's OOM killer (the cgroup
        counted a kill) or a native abort whose last words say so."""
        if returncode == -signal.SIGKILL and oom_kills() > self.oom_kills_at_launch:
            return True
        if returncode >= 0 and run.error is not None:
            return False
        tail = stderr_tail(run.stderr_path, 800)
        return any(marker in tail for marker in MEMORY_MARKERS)

    def _succeed(self, run: Run, result: Dict[str, Any]) -> None:
        result = dict(result)
        activate = result.pop("activate", False)
        engine_path = result.pop("engine", None)
        if activate and result.get("engine_key") and engine_path:
            # The model switch ends the job: now, or when its version is committed or rolled
            # back (agent/device/models/switch.py).
            self.activate_model(run, result, engine_path)
            return
        for key in ("io", "calibration_cache"):
            result.pop(key, None)
        self.ending.end(run, "SUCCEEDED", result=fit_result(result))

    def stop_worker(self, run: Run) -> None:
        proc = run.proc
        if proc is None or run.kill_at is not None:
            return
        run.kill_at = time.monotonic() + KILL_GRACE_S
        signal_group(proc, signal.SIGTERM)

    def check_run(self) -> None:
        run = self.shared.run
        if run is None:
            return
        now = time.monotonic()
        if run.details.get("commit") == "pending":
            return  # the model switch's commit timeout governs (models.commit_timeout_s)
        if not run.timed_out and not run.cancel_requested and now > run.deadline:
            run.timed_out = True
            log.warning("job %s: timed out after %g s", run.job_id, run.timeout_s)
            if run.proc is not None:
                self.stop_worker(run)
            else:
                self.ending.end(run, "TIMED_OUT", error=AgentError(
                    "job_timed_out", "the job did not finish within its timeout of {:g} s "
                    "(stage {})".format(run.timeout_s, run.stage)).to_dict())
                return
        if run.proc is not None and run.kill_at is not None and now > run.kill_at:
            log.warning("job %s: worker ignored SIGTERM for %g s; killing it", run.job_id,
                        KILL_GRACE_S)
            signal_group(run.proc, signal.SIGKILL)
            run.kill_at = now + 3600  # one SIGKILL is enough

    def stop_for_shutdown(self) -> None:
        """The daemon is stopping: stop the worker (SIGTERM, then SIGKILL); its job stays
        IN_PROGRESS and runs again after the restart."""
        run = self.shared.run
        if run is not None and run.proc is not None:
            run.stopping_for_shutdown = True
            proc = run.proc
            signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                signal_group(proc, signal.SIGKILL)
                proc.wait(5)


def clean_work_dirs(state_dir: str, journal: Any) -> None:
    """At start-up: remove the work directories of jobs that have ended."""
    work = os.path.join(state_dir, "work")
    if not os.path.isdir(work):
        return
    keep = {j["job_id"] for j in journal.unfinished_jobs()}
    for name in os.listdir(work):
        if name not in keep:
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)
