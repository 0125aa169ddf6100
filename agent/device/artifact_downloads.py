"""A job's artifacts: ask the block fetcher for them, report download progress, and launch the
worker once every artifact is in the store."""

import logging
import time
from typing import Any, Dict, Optional, Tuple

from agent.device.job_run import PROGRESS_EVERY_S, Run
from agent.device.worker_supervisor import WorkerSupervisor
from agent.errors import AgentError
from agent.wire import message_caps, protocol

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

MAX_LOGGED_ERROR_BYTES = 16 * 1024  # a job error as the log line and the journal keep it


class ArtifactDownloads(WorkerSupervisor):
    """Daemon layer: artifact blocks in, download progress out, partial downloads reclaimed."""

    def _set_state(self, run_or_id: Any, state: str, **kwargs: Any) -> None:
        super()._set_state(run_or_id, state, **kwargs)
        if protocol.is_terminal(state):
            self._reclaim_partials("job end")

    def _end(self, run: Run, state: str, error: Optional[Dict[str, Any]] = None,
             result: Optional[Dict[str, Any]] = None) -> None:
        # A worker's error may be megabytes (an output name, 30,000 output names): it is cut
        # here, before the log line and the journal, as it is in the status.
        if error is not None:
            error = message_caps.fit_error(error, MAX_LOGGED_ERROR_BYTES)
        super()._end(run, state, error=error, result=result)

    def _reclaim_partials(self, why: str, need_bytes: Optional[int] = None) -> None:
        """Drop the partial downloads no unfinished job names (and those idle past
        limits.max_partial_age_s): a job naming artifacts nobody serves must not leave
        pre-allocated files that make every later job fail disk_full."""
        self.store.max_partial_age_s = self.cfg.limits.max_partial_age_s
        try:
            removed = self.store.reclaim_partials(need_bytes=need_bytes)
        except OSError as exc:
            log.warning("cannot reclaim partial downloads (%s): %s", why, exc)
            return
        if removed:
            log.info("reclaimed %d partial download(s) at %s: %s", len(removed), why,
                     ", ".join(sha[:12] for sha in removed))

    def _start_downloads(self, run: Run) -> None:
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
            self._launch(run)

    def _inject_block(self, topic: str, payload: bytes) -> None:
        """An artifact's last block fetched over HTTP (agent.wire.http_fetch), handed to the main
        loop as if it came over MQTT: completion happens in one place."""
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
        self._set_state(run, "IN_PROGRESS", stage="downloading",
                        progress={"done": done, "of": total})

    def _on_block(self, topic: str, payload: bytes) -> None:
        self.counters["blocks"] += 1
        try:
            completed = self.fetcher.handle_block(topic, payload)
        except AgentError as exc:
            if exc.code == "hash_mismatch":
                self._on_bad_artifact(topic, exc)
            else:
                log.debug("dropped block %s: %s", topic, exc)
            return
        run = self.run_
        if run is None or run.proc is not None:
            return
        if completed is not None:
            sha, path = completed
            for role, (need_sha, _) in run.needed.items():
                if need_sha == sha:
                    run.paths[role] = path
            if not run.downloading:
                self._report_download(run, force=True)
                try:
                    self._launch(run)
                except AgentError as exc:
                    self._fail(run, exc)
                return
        if run.downloading:
            self._report_download(run)

    def _on_bad_artifact(self, topic: str, exc: AgentError) -> None:
        run = self.run_
        try:
            sha = self.topics.parse(topic).sha256
        except AgentError:
            sha = None
        log.error("%s", exc)
        if run is not None and run.proc is None and any(
                s == sha for s, _ in run.needed.values()):
            self._fail(run, exc)
