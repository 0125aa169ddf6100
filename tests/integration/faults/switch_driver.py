"""A daemon's model switch in a subprocess, for ``test_faults_switch``: recover the state
directory as a restarted daemon does (the models directory reconciled with the journal, a
pending version's wait resumed, an interrupted activation run again), then switch the name
``det`` to a new version, SIGKILLing itself at the step named by ``--kill-at``:

    version_written   the version directory renamed into place
    pending_recorded  the journal holds the version as pending
    link_switched     ``current`` renamed to the new version
    handoff_running   inside the hand-off (its command kills this process)
    pending           the hand-off done, waiting for the probe

The real parts: journal, models directory, the command adapter and the probe; the worker and
MQTT are left out (they have their own fault tests).

    python -m tests.integration.faults.switch_driver STATE_DIR --version V [--kill-at STEP]
"""

import argparse
import json
import os
import queue
import signal
import sys
import time

from agent.device import config, handoff
from agent.device.app import requests as app_requests
from agent.device.jobs.run import Run
from agent.device.journal.store import Journal
from agent.device.models.directory import ModelsDir
from agent.device.models.switch import ModelSwitch

HOOK = """import os, signal
if os.environ.get("SWITCH_KILL_AT") == "handoff_running" and \\
        os.environ["JETSON_AGENT_MODEL_EVENT"] == "switch":
    os.kill(os.getppid(), signal.SIGKILL)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("state_dir")
    ap.add_argument("--version")
    ap.add_argument("--kill-at", default="")
    args = ap.parse_args()
    os.environ.pop("SWITCH_KILL_AT", None)  # armed once the recovery is done
    hook = os.path.join(args.state_dir, "hook.py")
    if not os.path.exists(hook):
        with open(hook, "w") as f:
            f.write(HOOK)
    cfg = config.load(None, overrides={
        ("state_dir",): args.state_dir, ("models", "commit_timeout_s"): 60.0,
        ("models", "probe"): [sys.executable, "-c", "pass"]}, env={})
    entries = handoff.parse([{"type": "command", "command": [sys.executable, hook]}])
    journal = Journal(os.path.join(args.state_dir, "journal.sqlite3"))
    events: "queue.Queue" = queue.Queue()
    armed = {"on": False}

    def step(name: str) -> None:
        if armed["on"] and name == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    class Shared:
        run = None

    ended = {}

    def end(run, state, error=None, result=None):
        journal.set_state(run.job_id, state, error=error, result=result)
        ended[run.job_id] = state
        Shared.run = None

    def set_stage(run, stage):
        journal.set_state(run.job_id, "IN_PROGRESS", stage=stage, details=run.details)

    sw = ModelSwitch(cfg, journal, ModelsDir(cfg.models_dir, on_step=step), entries, events,
                     Shared, end, set_stage, lambda: None, lambda: {}, on_step=step)
    sw.reconcile()

    def pump(until) -> None:
        deadline = time.monotonic() + 60
        while not until() and time.monotonic() < deadline:
            try:
                ev = events.get(timeout=0.02)
            except queue.Empty:
                sw.tick()
                continue
            if isinstance(ev, app_requests.AppRequest):
                app_requests.answer(sw, ev)
            else:
                sw.on_event(ev)

    def deploy(row) -> None:
        run = Run(row, 60)
        Shared.run = run
        if run.details.get("commit") == "pending":
            sw.resume(run)
        else:
            run.needed["model"] = ("a" * 64, 1)
            engine = os.path.join(args.state_dir, "engine-" + row["doc"]["model_version"])
            sw.activate(run, {"engine_key": "key-" + row["doc"]["model_version"],
                              "precision": "fp16"}, engine)
        pump(lambda: run.job_id in ended)

    for row in journal.unfinished_jobs():  # what the scheduler hands on after a restart
        deploy(row)
    pump(lambda: sw.pending is None)  # orphans
    if args.version:
        job_id = "job-" + args.version
        engine = os.path.join(args.state_dir, "engine-" + args.version)
        with open(engine, "wb") as f:
            f.write(os.urandom(64 * 1024))
        doc = {"job_id": job_id, "kind": "deploy", "model_name": "det",
               "model_version": args.version}
        journal.add_job(doc)
        journal.set_state(job_id, "IN_PROGRESS")
        armed["on"] = True
        os.environ["SWITCH_KILL_AT"] = args.kill_at  # the hand-off command's environment
        deploy(journal.job(job_id))
    print(json.dumps({"ended": ended}))
    journal.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
