"""Prometheus ``/metrics`` of the fleet service (``prometheus_client``): a collector that reads
the fleet database at scrape time, so every instance on the same database reports the same
fleet and nothing is kept in memory between scrapes.

Families (all gauges): devices by state and board, per-device online/last seen, rollout
progress (devices per state, stage, fraction finished; running and paused rollouts and those
finished within a day), every model a device holds (``device_model_info`` with its version
and state, ``device_model_healthy``: one series per name the device holds, at most 256), the
newest engine's throughput, latency and accuracy per device (labelled with its ``model``
name), the share of the field's activations an INT8 version clips
(``device_model_int8_clip_ratio``, from the device's telemetry ``int8_clip_rate.<name>``) and
how far the field's inputs drifted from its calibration set (``device_model_int8_input_drift``,
from ``int8_input_drift.<name>``),
temperatures, power, GPU/CPU load and memory per device; live deployments (at most 100):
devices per convergence state, failures per reason, converged ratio.
Label values come from devices: they are cut to ``MAX_LABEL`` characters, and a device has
at most ``bounds.MAX_SERIES_PER_FAMILY`` sensors per family (agent.fleet.admission.bounds).
"""

import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

from agent.fleet.admission import bounds
from agent.fleet.database.store import ACTIVE, Store
from agent.fleet.web import views

MAX_LABEL = 64
FINISHED_KEPT_S = 86400.0  # finished rollouts stay in /metrics for a day
PREFIX = "jetson_fleet_"
MAX_DEPLOYMENTS = 100  # live deployments in /metrics (bounded series)
MAX_REASONS = 16  # failure reasons per deployment
CLIP_PREFIX = "int8_clip_rate."  # the device's telemetry key per INT8 name
DRIFT_PREFIX = "int8_input_drift."  # ... its inputs' histogram distance from calibration


def _label(value: Any) -> str:
    return ("" if value is None else str(value))[:MAX_LABEL]


class FleetCollector(object):
    """``prometheus_client`` custom collector over a ``Store``."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def describe(self) -> List[Any]:
        return []  # collected on demand; no registration-time scrape of the database

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        def gauge(name: str, doc: str, labels: List[str]) -> Any:
            return GaugeMetricFamily(PREFIX + name, doc, labels=labels)

        now = time.time()
        counters = self.store.admission_counters()
        # A counter (exposed as ..._total): the admission counters only grow.
        dropped = CounterMetricFamily(PREFIX + "messages_dropped", "device messages dropped by "
                                      "admission (device not admitted, bad or missing "
                                      "signature, replayed), and pending devices evicted",
                                      labels=["reason"])
        for reason in ("dropped", "bad_signature", "replayed", "pending_evicted") + (
                "impostor", "key_bound_elsewhere", "pending_rate_limited", "will_replayed"):
            dropped.add_metric([reason], float(counters.get(reason, 0)))
        yield dropped
        rows = views.fleet_rows(self.store, now)
        by_state: Dict[Tuple[str, str], int] = {}
        by_health: Dict[str, int] = {}
        online = gauge("device_online", "1 if the device is online", ["device", "board"])
        seen = gauge("device_last_seen_timestamp_seconds", "when the device was last heard of",
                     ["device"])
        tput = gauge("engine_throughput_qps", "active engine throughput (inferences/s)",
                     ["device", "model", "precision"])
        # Seconds (Prometheus' base unit); "stat", not "quantile": a gauge of the device's
        # measured p50/p99, not a summary.
        lat = gauge("engine_latency_seconds", "active engine latency (the device's benchmark: "
                    "stat p50, p99)", ["device", "model", "stat"])
        acc = gauge("engine_accuracy", "active engine accuracy against the goldens",
                    ["device", "model", "metric"])
        info = gauge("device_model_info", "1 per model a device holds (its version and "
                     "state: pending, committed; active: an older daemon)",
                     ["device", "model", "version", "state"])
        healthy = gauge("device_model_healthy", "1 if the device reports the model healthy",
                        ["device", "model"])
        temp = gauge("device_temperature_celsius", "device temperature", ["device", "sensor"])
        power = gauge("device_power_watts", "device power draw", ["device", "rail"])
        load = gauge("device_load_percent", "GPU/CPU/EMC load", ["device", "unit"])
        mem = gauge("device_memory_used_ratio", "RAM and swap in use", ["device", "kind"])
        clip = gauge("device_model_int8_clip_ratio", "share of the field's activations beyond "
                     "an INT8 version's calibrated range (its worst tensor, on the app's "
                     "donated inputs)", ["device", "model"])
        drift = gauge("device_model_int8_input_drift", "histogram distance of the app's donated "
                      "inputs from an INT8 version's calibration set (its worst input)",
                      ["device", "model"])
        for r in rows:
            dev, board = _label(r["device"]), _label(r["board"] or "unknown")
            key = ("online" if r["online"] else "offline", board)
            by_state[key] = by_state.get(key, 0) + 1
            by_health[r["health"]] = by_health.get(r["health"], 0) + 1
            online.add_metric([dev, board], 1.0 if r["online"] else 0.0)
            if r["last_seen"]:
                seen.add_metric([dev], float(r["last_seen"]))
            for m in r["models"]:
                info.add_metric([dev, _label(m["name"]), _label(m["version"]),
                                 _label(m["state"])], 1.0)
                healthy.add_metric([dev, _label(m["name"])], 1.0 if m["health"] == "ok"
                                   else 0.0)
            job = r["engine_job"]
            if job is not None:
                model = _label(engine_model(r["models"], job))
                if job["throughput_qps"] is not None:
                    tput.add_metric([dev, model, _label(job["precision"])],
                                    job["throughput_qps"])
                for stat, k in (("p50", "latency_p50_ms"), ("p99", "latency_p99_ms")):
                    if job[k] is not None:
                        lat.add_metric([dev, model, stat], job[k] / 1000.0)
                for name, value in sorted((job["accuracy"] or {}).items()):
                    v = views._num(value)
                    if v is not None and name in ACCURACY_KEYS:
                        acc.add_metric([dev, model, name], v)
                live = views._num((job["live_check"] or {}).get("agreement"))
                if live is not None:  # the device's live check on the app's own inputs
                    acc.add_metric([dev, model, "live_agreement"], live)
            metrics = r["metrics"]
            for sensor, c in sorted(bounds.first(views.temperatures(metrics)).items()):
                temp.add_metric([dev, _label(sensor)], c)
            for rail, mw in sorted(bounds.first(views.power_rails(metrics)).items()):
                power.add_metric([dev, _label(rail)], mw / 1000.0)
            for unit in ("gpu", "cpu", "emc"):
                v = views._num(metrics.get(unit + "_percent"))
                if v is not None:
                    load.add_metric([dev, unit], v)
            for kind in ("ram", "swap"):
                v = views._num(metrics.get(kind + "_fraction"))
                if v is not None:
                    mem.add_metric([dev, kind], v)
            for prefix, family in ((CLIP_PREFIX, clip), (DRIFT_PREFIX, drift)):
                per_name = {k[len(prefix):]: v for k, v in metrics.items()
                            if k.startswith(prefix) and views._num(v) is not None}
                for name, v in sorted(bounds.first(per_name).items()):
                    family.add_metric([dev, _label(name)], float(v))
        devices = gauge("devices", "devices by state and board", ["state", "board"])
        for (state, board), n in sorted(by_state.items()):
            devices.add_metric([state, board], n)
        health = gauge("devices_by_health", "devices by health (ok, failing, hot, stale, "
                       "offline)", ["health"])
        for word, n in sorted(by_health.items()):
            health.add_metric([word], n)
        yield devices
        yield health
        yield online
        yield seen
        yield from self._rollouts(gauge)
        yield from self._deployments(gauge)
        yield info
        yield healthy
        yield tput
        yield lat
        yield acc
        yield temp
        yield power
        yield load
        yield mem
        yield clip
        yield drift

    def _deployments(self, gauge: Any) -> Iterator[Any]:
        """Live deployments (at most MAX_DEPLOYMENTS, newest first): devices per convergence
        state, failures per reason (at most MAX_REASONS per deployment), and info."""
        from agent.fleet.deployments import deployments

        live = deployments.rows(self.store, deployments.LIVE)[-MAX_DEPLOYMENTS:]
        sums = deployments.summary(self.store, [d["deployment_id"] for d in live])
        info = gauge("deployment_info", "1 per live deployment (model name@version, selector, "
                     "state)", ["deployment", "model", "version", "selector", "state"])
        per_state = gauge("deployment_devices", "devices a deployment governs, by state "
                          "(converged, in_progress, retrying, failed, waiting; offline and "
                          "pinned: waiting for that reason)", ["deployment", "state"])
        failed = gauge("deployment_failed_devices", "failed devices of a deployment by reason",
                       ["deployment", "reason"])
        ratio = gauge("deployment_converged_ratio", "converged / desired devices",
                      ["deployment"])
        for d in live:
            did = _label(d["deployment_id"])
            info.add_metric([did, _label(d["name"]), _label(d["version"]),
                             _label(d["selector"]), d["state"]], 1)
            s = sums.get(d["deployment_id"]) or {}
            for state in deployments.STATES + ("offline", "pinned"):
                per_state.add_metric([did, state], s.get(state, 0))
            for reason, n in sorted(s.get("failed_by", {}).items())[:MAX_REASONS]:
                failed.add_metric([did, _label(reason)], n)
            ratio.add_metric([did], s.get("converged", 0) / float(s["desired"])
                             if s.get("desired") else 0.0)
        yield info
        yield per_state
        yield failed
        yield ratio

    def _rollouts(self, gauge: Any) -> Iterator[Any]:
        per_state = gauge("rollout_devices", "devices of a rollout by job state",
                          ["rollout", "state"])
        progress = gauge("rollout_progress_ratio", "finished devices / targeted devices",
                         ["rollout"])
        stage = gauge("rollout_stage", "current stage (1-based; 0 before the first)",
                      ["rollout"])
        stages = gauge("rollout_stages", "stages of the rollout", ["rollout"])
        info = gauge("rollout_active", "1 while the rollout runs or is paused",
                     ["rollout", "state"])
        for rid, state, current, counts, n_stages in rollout_gauges(
                self.store, time.time() - FINISHED_KEPT_S):
            rid = _label(rid)
            total = sum(counts.values())  # one job per device of every stage
            done = sum(n for s, n in counts.items()
                       if s in views.FAILED_STATES + ("SUCCEEDED",))
            for job_state, n in sorted(counts.items()):
                per_state.add_metric([rid, _label(job_state)], n)
            progress.add_metric([rid], done / float(total) if total else 1.0)
            stage.add_metric([rid], max(0, int(current or 0) + 1))
            stages.add_metric([rid], n_stages)
            info.add_metric([rid, _label(state)], 1.0 if state in ACTIVE else 0.0)
        yield per_state
        yield progress
        yield stage
        yield stages
        yield info


def engine_model(models: List[Dict[str, Any]], job: Dict[str, Any]) -> str:
    """The name of the model whose engine ``job`` measured: the model the job activated, else
    the device's only model, else ""."""
    for m in models:
        if m.get("job_id") and m["job_id"] == job.get("job_id"):
            return str(m["name"])
    return str(models[0]["name"]) if len(models) == 1 else ""


def rollout_gauges(store: Store, since: float
                   ) -> List[Tuple[str, str, Optional[int], Dict[str, int], int]]:
    """(rollout, state, current stage, job state -> devices, stages) of the running and paused
    rollouts and those finished since ``since``, newest first: three grouped queries, however
    many rollouts the database keeps (finished long ago: their series end)."""
    where = ("r.state IN ('running', 'paused') OR "
             "COALESCE(NULLIF(r.finished, 0), NULLIF(r.updated, 0), 0) >= ?")
    rows = store.db.query("SELECT r.rollout_id, r.state, r.current_stage FROM rollouts r WHERE "
                          + where + " ORDER BY r.created DESC, r.rollout_id", (since,))
    counts: Dict[str, Dict[str, int]] = {r[0]: {} for r in rows}
    for rid, state, n in store.db.query(
            "SELECT j.rollout_id, j.state, COUNT(*) FROM jobs j JOIN rollouts r ON "
            "r.rollout_id = j.rollout_id WHERE " + where + " GROUP BY j.rollout_id, j.state",
            (since,)):
        counts.setdefault(rid, {})[state] = int(n)
    stages = dict(store.db.query(
        "SELECT s.rollout_id, COUNT(*) FROM stages s JOIN rollouts r ON r.rollout_id = "
        "s.rollout_id WHERE " + where + " GROUP BY s.rollout_id", (since,)))
    return [(rid, state, current, counts[rid], int(stages.get(rid, 0)))
            for rid, state, current in rows]


ACCURACY_KEYS = ("label_accuracy", "golden_label_accuracy", "top1_agreement",
                 "max_abs_error", "max_rel_error", "mean_abs_error", "sqnr_db", "cosine")


def exposition(store: Store, registry: Optional[Any] = None) -> Tuple[bytes, str]:
    """(body, content type) of one scrape."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    if registry is None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(FleetCollector(store))
    return generate_latest(registry), CONTENT_TYPE_LATEST
