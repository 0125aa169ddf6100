"""The service's part of deployments (``agent.fleet.deployments.deployments``): it makes the fleet
converge and keeps it so, working from changes, never from a scan of the fleet per tick.

- A new deployment (pending): one scan of the eligible devices; those that need the version
  and are online form the first wave, a rollout with the deployment's stages and policy
  (``agent.fleet.rollouts.durable`` and the service drive it like any rollout: pause, resume, abort
  on the failure rate). Offline devices wait.
- Afterwards the runner is told of changes: births and Wills (``touch`` from the service's
  status intake), models messages, job ends of its rollouts, label edits (the
  ``device_labels.updated`` index), deployments created or changed (their ``updated``), a
  rollout of its own that ended (then one scan of that deployment). Each touched device is
  decided again (``deployments.decide``) against the deployment that governs it now (the
  newest live one of each model name whose selector matches its labels); the devices that need
  their job are gathered and sent together in a catch-up rollout every ``CATCHUP_S``.
- A deployment whose registry blobs cannot be served (agent.fleet.database.blobs: missing,
  or their bytes no longer hash right) sends nothing: its devices that need the version are
  ``failed`` with the reason ``artifact_unavailable: blob ... (model of NAME@VERSION) ...``,
  looked at again every ``BLOB_RECHECK_S`` (bytes restored by a push of the version: they go).
- A device that leaves the selector of a deployment with ``on_leave: remove`` (and is governed
  by no other deployment of that model name) is sent the ``remove`` command, once it is online,
  if its status lists the feature ``remove_model`` (older daemons keep the model; logged).
- One instance decides at a time: the runner holds a lease in the ``meta`` table (several
  services on one database: the others wait, then take over with a full scan).
"""

import json
import logging
import time
import uuid
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Set, Tuple

from agent.fleet.database import device_models
from agent.fleet.deployments import deployments, labels, pins
from agent.fleet.rollouts import policy
from agent.wire import protocol

log = logging.getLogger("agent.fleet")

CATCHUP_S = 2.0  # devices that need their job are gathered this long into one rollout
BUSY_RETRY_S = 5.0  # a device in another unfinished rollout is looked at again after this
LEASE_KEY = "deployments_owner"
# Devices decided at a time: their statuses, labels and models are read for each batch (a
# service's start touches every device: 50,000 statuses decoded at once were 120 MiB).
DECIDE_BATCH = 1000
BLOB_RECHECK_S = 10.0  # a deployment's blobs are checked again after this (stat; hashed if changed)
TERMINAL_ROLLOUT = ("succeeded", "failed", "aborted", "halted", "timed_out", "cancelled")


def _chunks(ids: List[str], size: int = 500) -> Iterable[Tuple[List[str], str]]:
    for i in range(0, len(ids), size):
        part = ids[i:i + size]
        yield part, ", ".join("?" for _ in part)


class DeploymentRunner(object):
    def __init__(self, store: Any, instance: str, lease_s: float = 30.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.instance = instance
        self.lease_s = lease_s
        self.clock = clock
        self.leader = False
        self.dirty: Set[str] = set()
        self.full: Set[str] = set()  # deployments to scan whole
        self.deps: Dict[str, Dict[str, Any]] = {}  # live deployments, by id
        self.deps_seen = -1.0
        self.labels_seen = 0.0
        self.open: Dict[str, str] = {}  # unfinished rollout -> its deployment
        self.records: Dict[Tuple[str, str], Tuple[str, Optional[str]]] = {}
        self.sends: Dict[str, Set[str]] = {}  # deployment -> devices to send to
        self.last_send: Dict[str, float] = {}
        self.later: Dict[str, float] = {}  # busy device -> when to look again
        self.mine: Dict[str, float] = {}  # deployment -> the updated of our own last change
        self.blob_root: Optional[str] = None  # the registry's blob store (None: the database's)
        # deployment -> (when checked, the reason its blobs cannot be served or None)
        self.unservable: Dict[str, Tuple[float, Optional[str]]] = {}
        self.rescan: Dict[str, float] = {}  # deployment -> when to scan it again (its blobs)
        self.stats = {"scans": 0, "decided": 0, "rollouts": 0, "removals": 0}
        # on_leave remove: device -> model names to remove (sent once it is online); the
        # service sets send_command(device, command document) to publish on its command topic.
        self.removals: Dict[str, Set[str]] = {}
        self.send_command: Optional[Callable[[str, Dict[str, Any]], None]] = None
        self.pins: Dict[Tuple[str, str], Any] = {}  # the fleet pins: (device, name) -> version
        self.pins_mark: Any = None  # pins.changed_mark when they were last read

    # -- told by the service -------------------------------------------------------------------

    def touch(self, devices: Iterable[str]) -> None:
        self.dirty.update(devices)

    def watches(self, rollout_id: Optional[str]) -> bool:
        return rollout_id in self.open

    # -- the tick ------------------------------------------------------------------------------

    def _lease(self, now: float) -> bool:
        with self.store.transaction():
            rows = self.store.db.query("SELECT value FROM meta WHERE key = ?", (LEASE_KEY,))
            owner, until = "", 0.0
            if rows and rows[0][0]:
                owner, _, t = str(rows[0][0]).rpartition("|")
                until = float(t or 0)
            if owner not in ("", self.instance) and until > now:
                return False
            self.store.db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET "
                "value = excluded.value", (LEASE_KEY, "{}|{}".format(self.instance,
                                                                    now + self.lease_s)))
        return True

    def tick(self) -> None:
        now = self.clock()
        leader = self._lease(now)
        if leader and not self.leader:  # taken (over): everything from the database
            self._load()
        self.leader = leader
        if not leader:
            self.dirty.clear()
            return
        self._deployments_changed()
        for dev, _ts in labels.changed_since(self.store, self.labels_seen):
            self.dirty.add(dev)
            self.labels_seen = max(self.labels_seen, _ts)
        self._pins_changed()
        self._rollouts_ended()
        for dep_id in [d for d, t in self.rescan.items() if t <= now]:
            self.rescan.pop(dep_id, None)
            self.full.add(dep_id)
        for dep_id in sorted(self.full):
            self._scan(dep_id)
        self.full.clear()
        due = [d for d, t in self.later.items() if t <= now]
        for d in due:
            self.later.pop(d, None)
        self.dirty.update(due)
        if self.dirty:
            devices, self.dirty = sorted(self.dirty), set()
            for i in range(0, len(devices), DECIDE_BATCH):  # facts of a batch at a time
                self._decide(devices[i:i + DECIDE_BATCH])
        self._send(now)

    def _load(self) -> None:
        self.deps, self.deps_seen = {}, -1.0
        self.open = {}
        for rid, dep, _state in self.store.db.query(
                "SELECT dr.rollout_id, dr.deployment_id, r.state FROM deployment_rollouts dr "
                "JOIN rollouts r ON r.rollout_id = dr.rollout_id WHERE r.state IN "
                "('running', 'paused')"):
            self.open[rid] = dep
        self.records = {(r[0], r[1]): (r[2], r[3]) for r in self.store.db.query(
            "SELECT deployment_id, device_id, state, reason FROM deployment_devices")}
        self.labels_seen = self.clock()
        self.sends = {}

    def _deployments_changed(self) -> None:
        """Deployments created or changed since the last look (a small table)."""
        rows = self.store.db.query(
            "SELECT deployment_id, state, updated FROM deployments WHERE updated > ?",
            (self.deps_seen,))
        if not rows:
            return
        self.deps_seen = max(float(r[2] or 0) for r in rows)
        for dep in deployments.rows(self.store):
            if dep["state"] in deployments.LIVE:
                self.deps[dep["deployment_id"]] = dep
            else:
                self.deps.pop(dep["deployment_id"], None)
                self.sends.pop(dep["deployment_id"], None)
        for dep_id, _state, updated in rows:
            if self.mine.get(dep_id) == updated:
                continue  # our own change of state: scanned already
            if dep_id in self.deps:
                self.full.add(dep_id)
            else:  # superseded or removed: the devices it governed go to the others
                self.dirty.update(d for (dp, d) in self.records if dp == dep_id)

    def _pins_changed(self) -> None:
        """The devices whose fleet pins changed: one row a tick (the change mark), the table
        only when it moved."""
        mark = pins.changed_mark(self.store)
        if mark == self.pins_mark and self.pins_mark is not None:
            return
        self.pins_mark = mark
        now = {k: (r["version"],) for k, r in pins.fleet_pins(self.store).items()}
        for key in set(now) ^ set(self.pins) | {k for k in now if self.pins.get(k) != now[k]}:
            self.dirty.add(key[0])
        self.pins = now

    def _rollouts_ended(self) -> None:
        if not self.open:
            return
        states = self.store.rollout_states(list(self.open))
        for rid, dep_id in list(self.open.items()):
            row = states.get(rid)
            if row is not None and row["state"] in ("running", "paused"):
                continue
            self.open.pop(rid, None)
            dep = self.deps.get(dep_id)
            if dep is None:
                continue
            outcome = row["state"] if row else "cancelled"
            if dep["state"] == "rolling" and rid.endswith("-w"):
                if outcome in ("aborted", "halted"):
                    reason = (self.store.rollout(rid) or {}).get("reason") or outcome
                    self._set(dep, "halted", "first wave {}: {}".format(outcome, reason))
                else:
                    self._set(dep, "active", None)
            self.full.add(dep_id)

    def _set(self, dep: Dict[str, Any], state: str, reason: Optional[str]) -> None:
        self.mine[dep["deployment_id"]] = deployments.set_state(
            self.store, dep["deployment_id"], state, reason)
        dep["state"], dep["reason"] = state, reason
        log.info("deployment %s: %s%s", dep["deployment_id"], state,
                 " ({})".format(reason) if reason else "")

    # -- deciding ------------------------------------------------------------------------------

    def _facts(self, devices: Optional[List[str]]) -> Dict[str, Dict[str, Any]]:
        """device -> online, status, assigned labels, models message and when it was stored
        (``devices`` None: every eligible device)."""
        eligible = deployments.eligible_devices(self.store, devices)
        out: Dict[str, Dict[str, Any]] = {}
        queries = [("SELECT device_id, online, status FROM devices", None)] if devices is None \
            else [("SELECT device_id, online, status FROM devices WHERE device_id IN ({})"
                   .format(m), c) for c, m in _chunks(sorted(eligible))]
        for sql, params in queries:
            for dev, online, status in self.store.db.query(sql, params or ()):
                if dev in eligible:
                    out[dev] = {"online": bool(online), "status": json.loads(status) if status
                                else {}, "models": None, "models_at": 0.0}
        assigned = labels.assigned(self.store, None if devices is None else list(out))
        queries = [("SELECT device_id, message, updated FROM device_models", None)] \
            if devices is None else [
                ("SELECT device_id, message, updated FROM device_models WHERE device_id IN "
                 "({})".format(m), c) for c, m in _chunks(sorted(out))]
        for sql, params in queries:
            for dev, message, updated in self.store.db.query(sql, params or ()):
                if dev in out:
                    out[dev]["models"] = json.loads(message) if message else None
                    out[dev]["models_at"] = float(updated or 0)
        pinned: Dict[str, Dict[str, Any]] = {}
        for (dev, name), row in pins.fleet_pins(
                self.store, None if devices is None else list(out)).items():
            pinned.setdefault(dev, {})[name] = row
        for dev, f in out.items():
            f["labels"] = labels.selectable(f["status"], assigned.get(dev))
            f["pins"] = pinned.get(dev, {})
        return out

    def _last_jobs(self, dep_ids: List[str], devices: Optional[List[str]]
                   ) -> Dict[Tuple[str, str], Dict[str, Any]]:
        """(deployment, device) -> its newest job of that deployment."""
        out: Dict[Tuple[str, str], Dict[str, Any]] = {}
        if not dep_ids:
            return out
        base = ("SELECT dr.deployment_id, j.device_id, j.state, j.data, j.updated, r.state, "
                "r.created FROM jobs j JOIN deployment_rollouts dr ON dr.rollout_id = "
                "j.rollout_id JOIN rollouts r ON r.rollout_id = j.rollout_id WHERE "
                "dr.deployment_id IN ({})".format(", ".join("?" for _ in dep_ids)))
        queries = [(base, list(dep_ids))] if devices is None else [
            (base + " AND j.device_id IN ({})".format(m), list(dep_ids) + c)
            for c, m in _chunks(devices)]
        for sql, params in queries:
            for dep, dev, state, data, updated, ro_state, created in self.store.db.query(
                    sql, params):
                key = (dep, dev)
                timeouts = out[key]["timeouts"] if key in out else []
                if state == deployments.TIMED_OUT:  # each one an attempt
                    timeouts.append(float(updated or 0))
                if key in out and out[key]["created"] > float(created or 0):
                    continue
                item = json.loads(data) if data else {}
                out[key] = {"state": state, "error": item.get("error"),
                            "updated": float(updated or 0), "created": float(created or 0),
                            "open": ro_state in ("running", "paused"), "timeouts": timeouts}
        return out

    def _scan(self, dep_id: str) -> None:
        """Every eligible device against one deployment (a new, resumed, retried one, or one
        whose rollout ended)."""
        dep = self.deps.get(dep_id)
        if dep is None:
            return
        self.stats["scans"] += 1
        facts = self._facts(None)
        wanted = self._evaluate(facts, [dep_id])
        self._remove(facts)
        if dep["state"] == "pending":
            self._first_wave(dep, sorted(wanted.get(dep_id, ())))
        else:
            self.sends.setdefault(dep_id, set()).update(wanted.get(dep_id, ()))

    def _decide(self, devices: List[str]) -> None:
        facts = self._facts(devices)
        for dev in devices:  # gone from the eligible devices: governed by nothing
            if dev not in facts:
                for key in [k for k in self.records if k[1] == dev]:
                    deployments.record_devices(self.store, key[0], {dev: None})
                    self.records.pop(key, None)
        wanted = self._evaluate(facts, list(self.deps), devices)
        self._remove(facts)
        for dep_id, devs in wanted.items():
            if self.deps[dep_id]["state"] != "pending":  # pending: its first wave scans
                self.sends.setdefault(dep_id, set()).update(devs)

    def _evaluate(self, facts: Mapping[str, Dict[str, Any]], dep_ids: List[str],
                  devices: Optional[List[str]] = None) -> Dict[str, Set[str]]:
        """Decide every device of ``facts`` against the deployments of ``dep_ids`` that govern
        it; record what changed; return deployment -> the devices to send to."""
        live = sorted(self.deps.values(), key=lambda d: (d["created"], d["deployment_id"]))
        jobs = self._last_jobs(dep_ids, devices if devices is not None else None)
        retried = {d: deployments.retries(self.store, d) for d in dep_ids}
        changes: Dict[str, Dict[str, Any]] = {}
        wanted: Dict[str, Set[str]] = {}
        spent: Dict[str, List[str]] = {}  # deployment -> devices whose attempts are spent
        at_now = self.clock()
        for dev, f in facts.items():
            by_name = deployments.governing(live, f["labels"])
            gov = {d["deployment_id"] for d in by_name.values()}
            for dep_id in dep_ids:
                dep = self.deps[dep_id]
                key = (dep_id, dev)
                if dep_id not in gov:
                    if key in self.records:
                        changes.setdefault(dep_id, {})[dev] = None
                        self.records.pop(key, None)
                        if dep["spec"].get("on_leave") == "remove" and \
                                dep["name"] not in by_name:  # left, not handed over
                            self.removals.setdefault(dev, set()).add(dep["name"])
                    continue
                r = retried[dep_id]
                since = max(r.get(dev, 0.0), r.get(deployments.ALL, 0.0))
                job = jobs.get(key)
                verdict = deployments.decide(
                    dep, f["online"], f["models"], f["models_at"], job, since,
                    pin=pins.effective(f["pins"].get(dep["name"]), f["models"], dep["name"]),
                    attempts=sum(1 for t in (job or {}).get("timeouts", ()) if t > since),
                    now=at_now)
                self.stats["decided"] += 1
                blocked = (self.unservable.get(dep_id) or (0.0, None))[1]
                if verdict["send"] and blocked:  # as last decided: no flapping in between
                    verdict = dict(verdict, state="failed", reason=blocked)
                if verdict["at"] is not None:  # a backoff: decided again then
                    self.later[dev] = min(self.later.get(dev, verdict["at"]), verdict["at"])
                if verdict["halt"]:
                    spent.setdefault(dep_id, []).append(
                        "{} ({})".format(dev, verdict["reason"]))
                if verdict["send"]:
                    wanted.setdefault(dep_id, set()).add(dev)
                else:  # an earlier decision to send stands no more
                    self.sends.get(dep_id, set()).discard(dev)
                now = (verdict["state"], verdict["reason"])
                if self.records.get(key) != now:
                    self.records[key] = now
                    changes.setdefault(dep_id, {})[dev] = {"state": now[0], "reason": now[1]}
        for dep_id, states in changes.items():
            deployments.record_devices(self.store, dep_id, states)
        for dep_id, devs in spent.items():
            dep = self.deps[dep_id]
            if dep["state"] in deployments.SENDING:
                self._set(dep, "halted", "gave up after {} attempt(s) on {} device(s): {}".format(
                    deployments.max_attempts(dep["spec"]), len(devs), ", ".join(devs[:10])))
                self.sends.pop(dep_id, None)
        return wanted

    def _remove(self, facts: Mapping[str, Dict[str, Any]]) -> None:
        """The removals owed to the online devices of ``facts`` (on_leave remove)."""
        for dev in [d for d in self.removals if d in facts and facts[d]["online"]]:
            f = facts[dev]
            held = {m["name"] for m in device_models.entries(f["status"], f["models"])}
            for name in sorted(self.removals.pop(dev) & held):
                if "remove_model" not in device_models.features(f["status"]):
                    log.warning("device %s left a deployment of %s (on_leave remove) but its "
                                "daemon cannot remove models (no feature remove_model): kept",
                                dev, name)
                    continue
                if self.send_command is not None:
                    self.send_command(dev, {"protocol": protocol.PROTOCOL_VERSION,
                                            "command": "remove", "name": name,
                                            "request_id": "rm" + uuid.uuid4().hex[:10]})
                    self.stats["removals"] += 1
                    log.info("device %s left the deployments of %s: remove sent", dev, name)

    # -- sending -------------------------------------------------------------------------------

    def _blocked(self, dep: Dict[str, Any], devices: List[str]) -> bool:
        """Whether the deployment's blobs cannot be served now: then its ``devices`` are
        recorded failed with the reason, and looked at again later."""
        from agent.fleet.database import blobs

        dep_id = dep["deployment_id"]
        now = self.clock()
        checked, reason = self.unservable.get(dep_id) or (-1e18, None)
        if now - checked >= BLOB_RECHECK_S or reason is None:
            found = blobs.problems_of(self.store, self.blob_root, dep["spec"])
            reason = "artifact_unavailable: {}".format(found[1]) if found else None
            if reason != self.unservable.get(dep_id, (0.0, None))[1]:
                # The deployment's own reason carries the whole message (and is cleared when
                # the bytes are back); each device's, the code with the blob and version.
                full = "artifact_unavailable: {}".format(found[2]) if found else None
                log.log(logging.ERROR if found else logging.INFO, "deployment %s: %s", dep_id,
                        full or "its blobs can be served again")
                if found or str(dep.get("reason") or "").startswith("artifact_unavailable"):
                    self._set(self.deps.get(dep_id) or dict(dep), dep["state"], full)
            self.unservable[dep_id] = (now, reason)
        if reason is None:
            return False
        states = {d: {"state": "failed", "reason": reason} for d in devices
                  if self.records.get((dep_id, d)) != ("failed", reason)}
        for d in states:
            self.records[(dep_id, d)] = ("failed", reason)
        deployments.record_devices(self.store, dep_id, states)
        self.rescan[dep_id] = now + BLOB_RECHECK_S
        return True

    def _first_wave(self, dep: Dict[str, Any], devices: List[str]) -> None:
        spec = dep["spec"]
        if not devices:
            self._set(dep, "active", None)
            return
        if self._blocked(dep, devices):
            return  # pending, scanned again
        stages = policy.plan_stages(devices, spec.get("batch"), spec.get("percent"))
        self._rollout(dep, dep["deployment_id"] + "-w", "wave", stages)
        self._set(dep, "rolling", None)

    def _send(self, now: float) -> None:
        for dep_id, devs in list(self.sends.items()):
            dep = self.deps.get(dep_id)
            if not devs or dep is None or dep["state"] != "active" or \
                    now - self.last_send.get(dep_id, 0.0) < CATCHUP_S:
                continue
            busy = self.store.busy_devices(devs)
            ready = sorted(d for d in devs if d not in busy)
            for d in busy:
                self.later[d] = now + BUSY_RETRY_S
            self.sends[dep_id] = set()
            self.last_send[dep_id] = now
            if ready and self._blocked(dep, ready):
                continue
            if ready:
                n = len(deployments.rollouts_of(self.store, dep_id))
                self._rollout(dep, "{}-c{}".format(dep_id, n), "catch-up", [ready])

    def _rollout(self, dep: Mapping[str, Any], rollout_id: str, kind: str,
                 stages: List[List[str]]) -> None:
        spec = dep["spec"]
        now = self.clock()
        with self.store.transaction():
            self.store.insert_rollout(rollout_id, spec, stages,
                                      now + float(spec.get("timeout") or 3600.0))
            self.store.db.execute("INSERT INTO deployment_rollouts (rollout_id, deployment_id, "
                                  "kind, created) VALUES (?, ?, ?, ?)",
                                  (rollout_id, dep["deployment_id"], kind, now))
        self.open[rollout_id] = dep["deployment_id"]
        self.stats["rollouts"] += 1
        devices = [d for s in stages for d in s]
        self.sends.get(dep["deployment_id"], set()).difference_update(devices)
        for d in devices:
            self.records[(dep["deployment_id"], d)] = ("in_progress", None)
        deployments.record_devices(self.store, dep["deployment_id"], {
            d: {"state": "in_progress", "reason": None} for d in devices})
        log.info("deployment %s: %s %s to %d device(s)", dep["deployment_id"], kind, rollout_id,
                 sum(len(s) for s in stages))


def job_ended(runner: Optional[DeploymentRunner], rollout_id: Optional[str], device: str,
              msg: Mapping[str, Any]) -> None:
    """A job status the service accepted: a terminal one of a deployment's rollout touches
    its device (converged, failed)."""
    if runner is not None and runner.watches(rollout_id) and \
            protocol.is_terminal(str(msg.get("state"))):
        runner.touch([device])

