"""How ``fleet rollout`` runs once everything was checked here: submitted to a ``fleet
serve`` that is up on the same database (``submit``; then followed with ``attach`` until it
ends), or embedded (``embedded``: the same service loop, in this process, for this one
rollout). Both return a ``Finished`` (the report, the rollout, whether Ctrl-C ended it); the
CLI prints it. Notices for people go through ``say`` (stderr).
"""

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from agent import fleet
from agent.errors import AgentError
from agent.fleet.commands import admission as admission_command
from agent.fleet.commands.db import (
    SERVICE_FRESH_S,
    add_to_store,
    resolve_url,
    service_up,
    store_dir,
)
from agent.fleet.database.store import Store
from agent.fleet.rollouts import durable
from agent.fleet.service import FleetService, busy_check

Say = Callable[[str], None]


@dataclass
class Targets:
    """``--devices``, ``--all``, ``--match`` and the stages (``--batch``, ``--percent``)."""
    devices: Optional[List[str]] = None
    all: bool = False
    match: Optional[str] = None
    batch: Optional[int] = None
    percent: Optional[float] = None


@dataclass
class RunOptions:
    """Where and how: ``db`` as given (None: the default to submit to, a database in ``work``
    when embedded), ``--submit``/``--embedded``, ``--detach``, ``--quiet``, ``--timeout``;
    ``model_path``, ``precision``, ``search`` and ``broker`` for the progress line and the
    report."""
    db: Optional[str] = None
    store: Optional[str] = None
    submit: bool = False
    embedded: bool = False
    detach: bool = False
    quiet: bool = False
    timeout: float = 3600.0
    share_group: Optional[str] = None
    admission: admission_command.Policy = field(default_factory=admission_command.Policy)
    targets: Targets = field(default_factory=Targets)
    model_path: str = ""
    precision: Optional[str] = None
    search: Optional[str] = None
    broker: Optional[str] = None


@dataclass
class Finished:
    """``report`` (None: detached before the end), the rollout as it ended, ``interrupted``
    (Ctrl-C), ``detached`` (``--detach``: submitted, not followed)."""
    report: Optional[Dict[str, Any]] = None
    rollout: Optional[fleet.Rollout] = None
    interrupted: bool = False
    detached: bool = False


def submit_or_embed(opts: RunOptions, rollout_id: str, spec: Dict[str, Any],
                    files: Dict[str, str], artifacts: Dict[str, Dict[str, Any]], work: str,
                    signer: Any, connect: Callable[[], Any], say: Say) -> Finished:
    """The rest of ``fleet rollout`` once everything was checked locally."""
    explicit = opts.db is not None
    if opts.submit or (not opts.embedded and explicit and service_up(resolve_url(opts.db))):
        return submit(opts, rollout_id, spec, files, artifacts, say)
    url = resolve_url(opts.db) if explicit else "sqlite:///" + os.path.join(work, "fleet.db")
    return embedded(opts, url, rollout_id, spec, files, artifacts, signer, connect, say)


def _stages(store: Store, targets: Targets, rollout_id: str) -> List[List[str]]:
    from agent.fleet.admission import admission

    known = [d["device"] for d in store.devices()]
    admission.check_members(store, targets.devices or [], known)
    devices = fleet.select_devices(known, targets.devices, targets.all, targets.match)
    busy_check(store, devices, rollout_id)
    return fleet.plan_stages(devices, targets.batch, targets.percent)


def submit(opts: RunOptions, rollout_id: str, spec: Dict[str, Any], files: Dict[str, str],
           artifacts: Dict[str, Dict[str, Any]], say: Say) -> Finished:
    url = resolve_url(opts.db)
    store = Store(url)
    try:
        existing = store.rollout(rollout_id)
        if existing is not None:
            if (existing["spec"] or {}).get("artifacts") != spec["artifacts"]:
                raise AgentError("bad_argument", "rollout {} already exists with other "
                                 "artifacts; choose another --rollout-id".format(rollout_id))
            say("rollout {} exists ({}): attaching".format(rollout_id, existing["state"]))
        else:
            if not store.services(SERVICE_FRESH_S):
                say("warning: no fleet service is running on {} (fleet serve --db ...): the "
                    "rollout starts when one does".format(url.split("@")[-1]))
            add_to_store(store, store_dir(opts.store, url), artifacts, files, copy=True)
            stages = _stages(store, opts.targets, rollout_id)
            store.insert_rollout(rollout_id, spec, stages, time.time() + opts.timeout)
            if not opts.quiet:
                say("rollout {}: submitted to the fleet service ({} device(s) in {} stage(s))"
                    .format(rollout_id, sum(len(s) for s in stages), len(stages)))
        if opts.detach:
            return Finished(detached=True)
        return attach(store, rollout_id, opts.quiet, extra=report_extra(opts, spec))
    finally:
        store.close()


def report_extra(opts: RunOptions, spec: Dict[str, Any]) -> Dict[str, Any]:
    model = dict((spec.get("artifacts") or {}).get("model") or {})
    return {"model": dict(model, path=spec.get("model_path")), "precision": spec.get(
        "precision"), "search": spec.get("search"), "broker": opts.broker,
            "preflight": spec.get("preflight")}


def embedded(opts: RunOptions, url: str, rollout_id: str, spec: Dict[str, Any],
             files: Dict[str, str], artifacts: Dict[str, Dict[str, Any]], signer: Any,
             connect: Callable[[], Any], say: Say) -> Finished:
    store = Store(url)
    conn = connect()
    interrupted = False
    try:
        service = FleetService(store, conn, signer, only=[rollout_id],
                               share_group=opts.share_group,
                               admission=admission_command.make(store, opts.admission))
        service.start()  # the registry fills from the devices' retained statuses
        add_to_store(store, store_dir(opts.store, url), artifacts, files, copy=False)
        stages = _stages(store, opts.targets, rollout_id)
        if signer is None:  # devices that drop unsigned jobs: refused now, not timed out later
            from agent.fleet.rollouts import signing_check

            unknown = signing_check.check_unsigned(
                signing_check.statuses_of(store.devices()), [d for s in stages for d in s])
            if unknown and not opts.quiet:
                say(signing_check.warning(unknown))
        store.insert_rollout(rollout_id, spec, stages, time.time() + opts.timeout)
        view = fleet.ProgressView(enabled=not opts.quiet)
        if not opts.quiet:
            say("rollout {}: {} ({}) to {} device(s) in {} stage(s); jobs {}".format(
                rollout_id, os.path.basename(opts.model_path), opts.precision,
                sum(len(s) for s in stages), len(stages),
                ", ".join([rollout_id] + ([rollout_id + fleet.SEARCH_SUFFIX]
                                          if opts.search else []))))
        interrupted = _drive(service, rollout_id, view, conn.directory.status, say)
        service.drain()
        store.release(service.instance)
        # Else the next 'fleet rollout --db' would take it for a service and submit to it.
        store.forget_service(service.instance)
        final = durable.load(store, rollout_id)
        assert final is not None
        view.update(final, conn.directory.status, force=True)
        report = fleet.rollout_report(final, store.statuses(), dict(
            report_extra(opts, spec), signing_key=signer.key_id if signer is not None else None))
    finally:
        conn.close()
        store.close()
    return Finished(report, final, interrupted)


def _drive(service: FleetService, rollout_id: str, view: Any, statuses: Dict[str, Any],
           say: Say) -> bool:
    """Step the service until the rollout ends; True when Ctrl-C ended it (every device not
    finished cancelled)."""
    service.on_change = lambda ro: view.update(ro, statuses)
    try:
        service.last_tick = 0.0
        while not service.finished(rollout_id):
            service.step()
            ro = service.rollouts.get(rollout_id)
            if ro is not None:
                view.update(ro, statuses)
    except KeyboardInterrupt:
        ro = service.rollouts.get(rollout_id)
        if ro is not None and not ro.done:
            # As --help says: embedded, nothing follows the devices after this process.
            say("interrupted: cancelling {} unfinished device(s), running ones included (an "
                "embedded rollout; submit it to 'fleet serve' to detach instead)".format(
                    sum(1 for r in ro.runs.values() if not r.terminal)))
            service.commit(ro, ro.expire("interrupted by the user", state="CANCELED",
                                         outcome="interrupted"))
        return True
    return False


def attach(store: Store, rollout_id: str, quiet: bool,
           extra: Optional[Dict[str, Any]] = None, poll_s: float = 0.5) -> Finished:
    """Follow a rollout the service drives until it ends (Ctrl-C detaches: ``Finished`` with
    no report, ``interrupted``; the rollout goes on)."""
    view = fleet.ProgressView(enabled=not quiet)
    try:
        while True:
            ro = durable.load(store, rollout_id)
            if ro is None:
                raise AgentError("unknown_job", "no rollout {!r} in {}".format(rollout_id,
                                                                               store.url))
            statuses = store.statuses()
            view.update(ro, statuses)
            row = store.rollout(rollout_id) or {}
            if row.get("state") not in ("running", "paused"):
                break
            time.sleep(poll_s)
    except KeyboardInterrupt:
        return Finished(interrupted=True)
    view.update(ro, statuses, force=True)
    return Finished(fleet.rollout_report(ro, statuses, extra), ro)
