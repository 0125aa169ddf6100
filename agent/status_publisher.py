"""What the daemon publishes: job states through the journal's outbox (deleted on PUBACK, so
nothing is lost on a disconnect or a crash), the retained birth status, and telemetry."""

import logging
import time
from typing import Any, Dict

from agent import __version__, protocol
from agent.daemon_state import DaemonState
from agent.job_run import Run
from agent.mqtt import Event

log = logging.getLogger("agent.daemon")  # one logger name for the whole daemon

OUTBOX_BATCH = 200
MAX_PUBLISH_REFUSALS = 3
MAX_RESULT_BYTES = 48 * 1024  # job status <= 64 KiB (protocol.MAX_BYTES) with room to spare


class StatusPublisher(DaemonState):
    """Daemon layer: status, outbox and telemetry publication."""

    def _publish_request(self, topic: str, payload: bytes, qos: int = 1,
                         retain: bool = False) -> None:
        self.mqtt.publish(topic, payload, qos=qos, retain=retain)

    def _status_platform(self) -> Dict[str, Any]:
        p = self.platform
        out = {"board": p.board, "jetpack": p.jetpack, "tensorrt": p.tensorrt,
               "backend": self.backend, "precisions": p.supported_precisions, "kind": p.kind,
               "l4t": p.l4t, "soc": p.soc}
        if self.backend_problem:  # the truth: no backend that runs here
            out["backend"] = None
            out["backend_problem"] = self.backend_problem[:512]
        return out

    def _birth(self) -> Dict[str, Any]:
        return protocol.status_message(
            self.device, True, self.boot, agent_version=__version__,
            platform=self._status_platform(),
            active_engines=list(self.journal.active_engines()),  # type: ignore[arg-type]
            ts=time.time())

    def _publish_birth(self) -> None:
        self.mqtt.publish(self.topics.status(self.device), protocol.encode(self._birth()),
                          qos=1, retain=True)

    # ------------------------------------------------------------------------- outbox

    def _emit(self, row: Dict[str, Any]) -> protocol.Publication:
        return protocol.job_status_publication(self.topics, self.device, row)

    def _set_state(self, run_or_id: Any, state: str, **kwargs: Any) -> None:
        job_id = run_or_id.job_id if isinstance(run_or_id, Run) else run_or_id
        if isinstance(run_or_id, Run) and "details" not in kwargs:
            kwargs["details"] = run_or_id.details
        self.journal.set_state(job_id, state, emit=self._emit, **kwargs)
        self.outbox_dirty = True

    def _republish(self, row: Dict[str, Any]) -> None:
        pub = self._emit(row)
        self.journal.outbox_put(pub.topic, pub.payload, pub.qos, pub.retain, coalesce=True)
        self.outbox_dirty = True

    def _flush_outbox(self) -> None:
        now = time.monotonic()
        if not self.mqtt.connected:
            return
        if not self.outbox_dirty and now - self.last_outbox_scan < 5.0:
            return
        self.outbox_dirty = False
        self.last_outbox_scan = now
        for item in self.journal.outbox_pending(limit=OUTBOX_BATCH + len(self.inflight)):
            if item.seq in self.inflight:
                continue
            if len(self.inflight) >= OUTBOX_BATCH:
                self.outbox_dirty = True
                break
            self.inflight[item.seq] = self.mqtt.publish(item.topic, item.payload, qos=item.qos,
                                                        retain=item.retain,
                                                        token=("outbox", item.seq))

    def _on_published(self, ev: Event) -> None:
        token = ev.token
        if not (isinstance(token, tuple) and token[0] == "outbox"):
            return
        seq = int(token[1])
        self.inflight.pop(seq, None)
        if ev.ok:
            self.journal.outbox_ack(seq)
            self.refusals.pop(seq, None)
            return
        count = self.refusals.get(seq, 0) + 1
        self.refusals[seq] = count
        if count >= MAX_PUBLISH_REFUSALS:
            log.error("broker refused outbox message %d %d times (%s); dropping it", seq, count,
                      ev.reason)
            self.journal.outbox_ack(seq)
            self.refusals.pop(seq, None)
        else:
            self.outbox_dirty = True

    # ------------------------------------------------------------------------- telemetry

    def _telemetry_tick(self) -> None:
        now = time.monotonic()
        if self.telemetry is None or now < self.next_telemetry:
            return
        self.next_telemetry = now + self.cfg.telemetry_interval
        sample = dict(self.telemetry.sample())
        source = sample.pop("source", getattr(self.telemetry, "kind", "host"))
        self.last_telemetry = sample
        if not self.mqtt.connected:
            return
        msg = {"protocol": protocol.PROTOCOL_VERSION, "device": self.device, "boot": self.boot,
               "ts": time.time(), "source": source, "metrics": sample}
        self.mqtt.publish(self.topics.telemetry(self.device), protocol.encode(msg), qos=0)


def fit_result(result: Dict[str, Any], limit: int = MAX_RESULT_BYTES) -> Dict[str, Any]:
    """Drop the largest entries of a result until its JSON fits ``limit`` bytes; the names of
    the dropped entries are listed under ``truncated`` (the worker's log has everything)."""
    result = dict(result)
    dropped = []
    while len(protocol.encode(result)) > limit and result:
        sizes = {k: len(protocol.encode({k: v})) for k, v in result.items() if k != "truncated"}
        if not sizes:
            break
        biggest = max(sizes, key=lambda k: sizes[k])
        del result[biggest]
        dropped.append(biggest)
        result["truncated"] = sorted(dropped)
    return result
