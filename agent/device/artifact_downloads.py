"""Downloaded: a job's artifacts asked of the block fetcher (MQTT blocks, or HTTP), blocks in,
download progress out, the worker launched once every artifact is in the store; partial downloads
nobody needs any more reclaimed."""

import logging
import time
from typing import Any, Callable, Optional, Tuple

from agent.device.daemon_state import DaemonState
from agent.device.jobs.run import PROGRESS_EVERY_S, Run
from agent.device.status_publisher import StatusPublisher
from agent.errors import AgentError
from agent.wire import protocol
from agent.wire.device.artifacts import ArtifactStore
from agent.wire.device.transfer import BlockFetcher
from agent.wire.topics import Topics

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon


def reclaim_partials(store: ArtifactStore, max_partial_age_s: float, why: str,
                     need_bytes: Optional[int] = None) -> None:
    """Drop the partial downloads no unfinished job names (and those idle past
    ``max_partial_age_s``, limits.max_partial_age_s): a job naming artifacts nobody serves must
    not leave pre-allocated files that make every later job fail disk_full."""
    store.max_partial_age_s = max_partial_age_s
    try:
        removed = store.reclaim_partials(need_bytes=need_bytes)
    except OSError as exc:
        log.warning("cannot reclaim partial downloads (%s): %s", why, exc)
        return
    if removed:
        log.info("reclaimed %d partial download(s) at %s: %s", len(removed), why,
                 ", ".join(sha[:12] for sha in removed))


class ArtifactDownloads:
    """The job in hand's artifacts. ``launch(run)`` starts its worker once all are in;
    ``fail(run, error)`` ends it (job_end)."""

    def __init__(self, fetcher: BlockFetcher, mqtt: Any, topics: Topics,
                 shared: DaemonState, publisher: StatusPublisher,
                 launch: Callable[[Run], None], fail: Callable[[Run, AgentError], None]
                 ) -> None:
        self.fetcher, self.mqtt, self.topics = fetcher, mqtt, topics
        self.shared, self.publisher = shared, publisher
        self.launch, self.fail = launch, fail  # the next stage, or the job's end

    def start(self, run: Run) -> None:
        run.download_started = time.monotonic()
        self.fetcher.inject = self._inject_block
        self.fetcher.subscribe, self.fetcher.unsubscribe = self.mqtt.subscribe, \
            self.mqtt.unsubscribe  # shared (fan-out) block topics while fetching
        for role, (sha, size) in sorted(run.needed.items()):
            ref = (run.doc.get("artifacts") or {}).get(role) or {}
            path = self.fetcher.want(sha, size, run.job_id, blocks=ref.get("blocks"),
                                     url=ref.get("url"))
            if path is not None:
                run.paths[role] = path
        if run.downloading:
            run.stage = "downloading"
            self._report_download(run, force=True)
        else:
            self.launch(run)

    def _inject_block(self, topic: str, payload: bytes) -> None:
        """An artifact's last block fetched over HTTP (agent.wire.device.http_fetch), handed to
        the main loop as if it came over MQTT: completion happens in one place."""
        from agent.wire.mqtt import MESSAGE
        from agent.wire.mqtt_types import Event

        self.mqtt.events.put(Event(MESSAGE, topic=topic, payload=payload))

    def _download_progress(self, run: Run) -> Tuple[int, int]:
        done = total = 0
        for role, (sha, size) in run.needed.items():
            got = None if role in run.paths else self.fetcher.progress(sha)
            if got is None:
                blocks = protocol.block_count(size, self.fetcher.block_size)
                got = (blocks, blocks) if role in run.paths else (0, blocks)
            done += got[0]
            total += got[1]
        return done, total

    def _report_download(self, run: Run, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - run.last_progress < PROGRESS_EVERY_S:
            return
        run.last_progress = now
        done, total = self._download_progress(run)
        self.publisher.set_state(run, "IN_PROGRESS", stage="downloading",
                                 progress={"done": done, "of": total})

    def on_block(self, topic: str, payload: bytes) -> None:
        self.shared.counters["blocks"] += 1
        try:
            completed = self.fetcher.handle_block(topic, payload)
        except AgentError as exc:
            if exc.code == "hash_mismatch":
                self._on_bad_artifact(topic, exc)
            else:
                log.debug("dropped block %s: %s", topic, exc)
            return
        run = self.shared.run
        if run is None or run.proc is not None:
            return
        if completed is not None:
            sha, path = completed
            for role, (need_sha, _) in run.needed.items():
                if need_sha == sha:
                    run.paths[role] = path
            if not run.downloading:
                self._log_downloaded(run)
                self._report_download(run, force=True)
                try:
                    self.launch(run)
                except AgentError as exc:
                    self.fail(run, exc)
                return
        if run.downloading:
            self._report_download(run)

    def _log_downloaded(self, run: Run) -> None:
        """The device's own transfer time (download start to the last artifact verified in
        the store), which scripts/benchmarks/daemon.py reads."""
        if run.download_started is None:
            return
        seconds = time.monotonic() - run.download_started
        size = sum(size for _, size in run.needed.values())
        log.info("job %s: downloaded and verified %d bytes in %.6f s (%.1f MB/s)", run.job_id,
                 size, seconds, size / max(seconds, 1e-9) / 1e6)

    def _on_bad_artifact(self, topic: str, exc: AgentError) -> None:
        run = self.shared.run
        try:
            sha = self.topics.parse(topic).sha256
        except AgentError:
            sha = None
        log.error("%s", exc)
        if run is not None and run.proc is None and any(
                s == sha for s, _ in run.needed.values()):
            self.fail(run, exc)
