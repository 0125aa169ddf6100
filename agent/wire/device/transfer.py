"""Artifact transfer over MQTT in blocks, resumable (after AWS IoT MQTT file delivery).

``BlockServer`` (controller side, ``agent.wire.block_server``) answers a device's request with the
blocks it asks for; ``BlockFetcher`` (device side) asks for the blocks it misses, a window at
a time, writes them through the artifact store and re-asks for what a timeout, a disconnect or
a restart lost; with per-block hashes it checks each block as it arrives, with a URL it fetches
over HTTP (``agent.wire.device.http_fetch``), and it listens on the artifact's shared
(fan-out) block topic while it fetches. Both are free of paho: they publish through a
``publish(topic, payload, qos, retain)`` callable and are fed the messages the MQTT layer
receives.
"""

import hashlib
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from agent.errors import AgentError
from agent.wire import protocol
from agent.wire.block_server import BlockServer, Publish, block_digests, sha256_file
from agent.wire.device.artifacts import ArtifactStore
from agent.wire.device.block_assembly import Transfer
from agent.wire.topics import Topics

log = logging.getLogger("agent.wire.device.transfer")

__all__ = ["BlockFetcher", "BlockServer", "block_digests", "sha256_file"]


FANOUT_FIRST_TIMEOUT_S = 3.0  # just over BlockServer's 2 s fan-out window
MAX_LIST_TRIES = 5  # a hash list the trusted source (HTTP) keeps failing ends the transfer
# ... from the broker, where anyone may answer (an open broker): junk costs a try only here
MAX_MQTT_LIST_TRIES = 100
MAX_BACKOFF_S = 8.0  # the re-request timeout's ceiling: an interrupted download resumes soon
PER_REQUEST = 64  # blocks per request message (what a BlockServer answers at most)


class _Fetch(object):
    def __init__(self, transfer: Transfer, job_id: Optional[str], now: float,
                 timeout: float, digests: Optional[bytes] = None) -> None:
        self.transfer = transfer
        self.job_id = job_id
        self.in_flight: Dict[int, float] = {}  # block index -> when it was requested
        self.last_block = now
        self.timeout = timeout
        self.requests = 0
        self.digests = digests  # per-block sha256 digests from the signed hash list
        self.bad_blocks = 0
        self.http = False  # an HTTP thread fetches it (agent.wire.device.http_fetch); MQTT waits
        self.fanout = False  # subscribed to the artifact's shared block topic
        self.shared_blocks = 0  # blocks that came on it
        self.url: Optional[str] = None  # the trusted source (the service's HTTP), if any
        self.mqtt_blocks = 0  # blocks that came over MQTT (anyone may send those)
        self.refetched = False  # fetched again from the trusted source after a mismatch
        # ... from it only (no MQTT blocks taken; HTTP retried every MAX_BACKOFF_S)
        self.trusted_only = False
        self.retry_at = 0.0
        self.injected: Optional[int] = None  # the HTTP thread's last block, sent as MQTT's


class _ListFor(NamedTuple):
    """A hash list being fetched, and the artifact it is for."""

    sha256: str
    size: int
    block_size: int
    job_id: Optional[str]
    tries: int  # failed fetches from the trusted source (HTTP)
    url: Optional[str]
    mqtt_tries: int = 0  # failed fetches over MQTT


class BlockFetcher(object):
    """Device side: fetches artifacts block by block into an ArtifactStore.

    At most ``window`` blocks are requested and unanswered at a time; each time an eighth of
    them has arrived the next missing ones are requested. Blocks requested more than the
    current timeout ago are requested again (only if still missing); while nothing arrives the
    timeout doubles up to ``max_timeout_s``. Thread-safe: blocks may arrive on the MQTT thread
    (or an HTTP thread) while ``tick`` runs on another."""

    def __init__(
        self,
        store: ArtifactStore,
        publish: Publish,
        topics: Topics,
        device: str,
        block_size: int = protocol.DEFAULT_BLOCK_SIZE,
        window: int = 64,
        timeout_s: float = 10.0,
        max_timeout_s: float = MAX_BACKOFF_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self._publish = publish
        self._topics = topics
        self.device = protocol.check_id("device id", device)
        self.block_size = block_size
        self.window = max(1, int(window))
        self.timeout_s = timeout_s
        self.max_timeout_s = max(timeout_s, max_timeout_s)
        self._clock = clock
        self._fetches: Dict[str, _Fetch] = {}
        self._lists: Dict[str, _ListFor] = {}  # hash list sha256 -> the artifact it is for
        # The daemon's way to receive a block as if from MQTT (HTTP completions), and what
        # completed over HTTP without it (tests).
        self.inject: Optional[Callable[[str, bytes], None]] = None
        # subscribe(topic, qos) / unsubscribe(topic) of the daemon's MQTT client: with them,
        # each fetch listens on the artifact's shared (fan-out) block topic.
        self.subscribe: Optional[Callable[..., Any]] = None
        self.unsubscribe: Optional[Callable[[str], Any]] = None
        self.http_completed: List[Tuple[str, str]] = []
        # The CA file https:// artifact URLs are verified with (None: the system's CAs).
        self.http_ca_file: Optional[str] = None
        self._lock = threading.RLock()
        self.bad_blocks = 0  # blocks dropped because they did not match their hash

    def want(self, sha256: str, size: int, job_id: Optional[str] = None,
             blocks: Optional[Mapping[str, Any]] = None, url: Optional[str] = None
             ) -> Optional[str]:
        """The stored path when the artifact is already here (nothing is requested), else
        start or resume fetching it and return None (``on_block`` returns the path later).
        ``blocks``: the job document's per-block hash reference (``{"block_size", "sha256"}``):
        its hash list is fetched first, then every block is checked against it as it arrives.
        ``url``: fetch the artifact over HTTP(S) with Range requests
        (agent.wire.device.http_fetch), MQTT blocks when that fails. AgentError bad_message,
        bad_argument, disk_full, hash_mismatch."""
        protocol.check_sha256(sha256)
        with self._lock:
            if sha256 not in self._fetches and self.store.has(sha256):
                self.store.touch(sha256)
                return self.store.path(sha256)
            if sha256 in self._fetches or any(w.sha256 == sha256
                                               for w in self._lists.values()):
                return None
            if blocks is not None:
                list_sha = protocol.check_sha256(blocks.get("sha256"))
                block_size = int(blocks.get("block_size") or 0)
                count = protocol.block_count(size, block_size) if block_size > 0 else 0
                if not protocol.MIN_BLOCK_SIZE <= block_size <= protocol.MAX_BLOCK_SIZE or \
                        count > protocol.MAX_BLOCKS:
                    raise AgentError("bad_message", "artifact {}: per-block hashes need a block "
                                     "size of {}..{} bytes and at most {} blocks, found {}"
                                     .format(sha256, protocol.MIN_BLOCK_SIZE,
                                             protocol.MAX_BLOCK_SIZE, protocol.MAX_BLOCKS,
                                             block_size))
                digests = self._stored_list(list_sha, count)
                if digests is None:
                    self._lists[list_sha] = _ListFor(sha256, size, block_size, job_id, 0, url)
                    self._start(list_sha, 32 * count, job_id, None, None,
                                sibling_url(url, sha256, list_sha))
                    return None
                return self._start(sha256, size, job_id, digests, block_size, url)
            return self._start(sha256, size, job_id, None, None, url)

    def _stored_list(self, list_sha: str, count: int) -> Optional[bytes]:
        if not self.store.has(list_sha):
            return None
        with open(self.store.path(list_sha), "rb") as f:
            data = f.read(32 * count + 1)
        if len(data) != 32 * count:
            raise AgentError("hash_mismatch", "the per-block hash list {} holds {} bytes; {} "
                             "blocks need {}".format(list_sha, len(data), count, 32 * count))
        return data

    def _start(self, sha256: str, size: int, job_id: Optional[str],
               digests: Optional[bytes], block_size: Optional[int],
               url: Optional[str] = None) -> Optional[str]:
        transfer = self.store.begin(sha256, size, block_size or self.block_size)
        if block_size and transfer.block_size != block_size:
            transfer.abort()  # a partial in other blocks cannot be checked block by block
            transfer = self.store.begin(sha256, size, block_size)
        if transfer.complete():  # every block arrived before a restart
            return transfer.finish()
        fetch = _Fetch(transfer, job_id, self._clock(), self.timeout_s, digests)
        fetch.url = url if url and url.startswith(("http://", "https://")) else None
        self._fetches[sha256] = fetch
        if self.subscribe is not None:
            self.subscribe(self._topics.fanout_blocks(sha256), 1)
            fetch.fanout = True
            # Blocks fanned out just before this device listened are not sent again within
            # the server's window: if none come, fall back to this device's own topic soon
            # (see ``tick``) rather than after a full request timeout.
            fetch.timeout = min(self.timeout_s, FANOUT_FIRST_TIMEOUT_S)
        if url and url.startswith(("http://", "https://")):
            from agent.wire.device import http_fetch

            fetch.http = True
            threading.Thread(target=http_fetch.run, args=(self, sha256, fetch, url),
                             name="http-fetch", daemon=True).start()
        else:
            self._request(sha256, fetch)
        return None

    def _http_failed(self, sha256: str, fetch: _Fetch) -> None:
        with self._lock:
            if self._fetches.get(sha256) is fetch and fetch.http:
                fetch.http = False
                if fetch.trusted_only:  # the trusted source again, later (see tick)
                    fetch.retry_at = self._clock() + MAX_BACKOFF_S
                    return
                self._request(sha256, fetch)

    def _http_start(self, sha256: str, fetch: _Fetch) -> None:
        from agent.wire.device import http_fetch

        fetch.http = True
        threading.Thread(target=http_fetch.run, args=(self, sha256, fetch, fetch.url),
                         name="http-fetch", daemon=True).start()

    def _list_done(self, list_sha: str, path: Optional[str],
                   mqtt: bool = True) -> Optional[str]:
        """A hash list completed (``path``) or failed its sha256 (None): start the artifact,
        or fetch the list again, from the trusted source (the service's HTTP) when the job
        named one (a poisoned answer must not end the job: junk from the broker counts only
        against MAX_MQTT_LIST_TRIES, the trusted source's own failures against
        MAX_LIST_TRIES)."""
        wanted = self._lists.pop(list_sha)
        if path is None:
            list_url = sibling_url(wanted.url, wanted.sha256, list_sha)
            trusted = not mqtt and list_url is not None
            wanted = wanted._replace(tries=wanted.tries + trusted,
                                     mqtt_tries=wanted.mqtt_tries + (not trusted))
            if wanted.tries >= MAX_LIST_TRIES or wanted.mqtt_tries >= MAX_MQTT_LIST_TRIES:
                raise AgentError("hash_mismatch", "the per-block hash list {} of artifact {} "
                                 "failed its sha256 {} times from {} and {} times over MQTT"
                                 .format(list_sha, wanted.sha256, wanted.tries,
                                         list_url or "no HTTP source", wanted.mqtt_tries))
            self._lists[list_sha] = wanted
            self._start(list_sha, 32 * protocol.block_count(wanted.size, wanted.block_size),
                        wanted.job_id, None, None, list_url)
            return None
        digests = self._stored_list(list_sha, protocol.block_count(wanted.size,
                                                                    wanted.block_size))
        return self._start(wanted.sha256, wanted.size, wanted.job_id, digests,
                           wanted.block_size, wanted.url)

    def _request(self, sha256: str, fetch: _Fetch) -> None:
        if fetch.http or fetch.trusted_only:
            return
        free = self.window - len(fetch.in_flight)
        if free <= 0:
            return
        transfer = fetch.transfer
        candidates = transfer.missing_indices(len(fetch.in_flight) + free)
        indices = [i for i in candidates if i not in fetch.in_flight][:free]
        if not indices:
            return
        now = self._clock()
        for i in indices:
            fetch.in_flight[i] = now
        # A server answers at most PER_REQUEST blocks of one request (BlockServer's default):
        # a larger window goes out as several requests, or its tail would wait for a timeout.
        for start in range(0, len(indices), PER_REQUEST):
            want = protocol.bitmap_from_indices(indices[start:start + PER_REQUEST],
                                                transfer.blocks)
            msg = protocol.request_message(sha256, transfer.size, transfer.block_size, want,
                                           fetch.job_id, fetch.fanout)
            fetch.requests += 1
            self._publish(self._topics.artifact_request(self.device, sha256),
                          protocol.encode(msg), 1, False)

    def on_block(self, sha256: str, index: int, data: bytes) -> Optional[str]:
        """Accept one block; returns the stored path when it completed the artifact. A block
        of an artifact already stored (a late duplicate) is ignored. AgentError
        unknown_artifact (the block is dropped, the transfer goes on), hash_mismatch or
        disk_full (the transfer is dropped; after a mismatch its partial file too)."""
        with self._lock:
            fetch = self._fetches.get(sha256)
            if fetch is None:
                if protocol.valid_sha256(sha256) and self.store.has(sha256):
                    return None
                raise AgentError("unknown_artifact", "block {} of artifact {}, which is not "
                                 "being fetched".format(index, sha256))
            transfer = fetch.transfer
            digests = fetch.digests
            if digests is not None and not transfer.has_block(index) and 0 <= index < \
                    transfer.blocks and hashlib.sha256(data).digest() != \
                    digests[32 * index:32 * index + 32]:
                # Junk (or a forged answer): dropped and asked again, the file stays clean.
                fetch.in_flight.pop(index, None)
                fetch.bad_blocks += 1
                self.bad_blocks += 1
                raise AgentError("unknown_artifact", "block {} of artifact {} does not match its "
                                 "sha256 in the signed hash list; dropped, asked again".format(
                                     index, sha256))
            try:
                if not transfer.write_block(index, data):
                    raise AgentError(
                        "unknown_artifact",
                        "block {} of artifact {} must have index 0..{} and {} bytes, found {} "
                        "bytes".format(index, sha256, transfer.blocks - 1,
                                       protocol.block_length(transfer.size, transfer.block_size,
                                                             index), len(data)))
                fetch.in_flight.pop(index, None)
                fetch.last_block = self._clock()
                fetch.timeout = self.timeout_s
                if transfer.complete():
                    del self._fetches[sha256]
                    self._stop_listening(sha256, fetch)
                    try:
                        path = transfer.finish()
                    except AgentError as exc:
                        if sha256 in self._lists and exc.code == "hash_mismatch":
                            return self._list_done(sha256, None, fetch.mqtt_blocks > 0)
                        if exc.code == "hash_mismatch" and fetch.url and fetch.mqtt_blocks \
                                and not fetch.refetched:
                            # Blocks from the broker (anyone's, without per-block hashes):
                            # the whole artifact again from the trusted source, once.
                            log.warning("artifact %s failed its sha256 after blocks from the "
                                        "broker (junk from another client?): fetching it again "
                                        "from %s only", sha256, fetch.url)
                            self._start(sha256, transfer.size, fetch.job_id, None, None,
                                        fetch.url)
                            again = self._fetches[sha256]
                            again.refetched = again.trusted_only = True
                            return None
                        raise
                    if sha256 in self._lists:
                        return self._list_done(sha256, path)
                    return path
            except AgentError as exc:
                if exc.code != "unknown_artifact":
                    if self._fetches.pop(sha256, None) is not None:
                        self._stop_listening(sha256, fetch)
                    transfer.close()
                raise
            # Keep the window nearly full (ask again each 1/8 of it): deeper pipelining, at
            # the cost of more, smaller requests.
            if len(fetch.in_flight) <= self.window - max(1, self.window // 8):
                self._request(sha256, fetch)
            return None

    def handle_block(self, topic: str, payload: bytes) -> Optional[Tuple[str, str]]:
        """``on_block`` for a received message: (sha256, path) when an artifact completed.
        AgentError bad_message (not a block topic of this device), message_too_large, and
        those of ``on_block``."""
        info = self._topics.parse(topic)
        if info.kind != "block" or info.device not in (self.device, ""):
            raise AgentError("bad_message", "expected a block topic of device {}, found {}"
                             .format(self.device, topic))
        if len(payload) > protocol.MAX_BLOCK_SIZE:
            raise AgentError("message_too_large", "a block may be at most {} bytes, found {}"
                             .format(protocol.MAX_BLOCK_SIZE, len(payload)))
        assert info.sha256 is not None and info.block is not None
        with self._lock:
            fetch = self._fetches.get(info.sha256)
            if fetch is not None:
                if fetch.injected == info.block:
                    fetch.injected = None  # HTTP's last block, handed over by the daemon
                elif fetch.trusted_only:
                    raise AgentError("unknown_artifact", "block {} of artifact {} from the "
                                     "broker: it is fetched from its trusted source only"
                                     .format(info.block, info.sha256))
                else:
                    fetch.mqtt_blocks += 1
                if not info.device:
                    fetch.shared_blocks += 1
        path = self.on_block(info.sha256, info.block, bytes(payload))
        if path is None:
            return None
        # A hash list's last block may complete the artifact it is for (resumed): name that.
        name = os.path.basename(path)
        return (name if protocol.valid_sha256(name) else info.sha256, path)

    def tick(self) -> None:
        """Call about once a second: persists received-block bitmaps and re-requests blocks
        whose request timed out (backing off while nothing arrives)."""
        with self._lock:
            now = self._clock()
            for sha, fetch in list(self._fetches.items()):
                fetch.transfer.flush()
                if fetch.trusted_only and not fetch.http and now >= fetch.retry_at:
                    self._http_start(sha, fetch)
                expired = [i for i, t in fetch.in_flight.items() if now - t >= fetch.timeout]
                if expired:
                    if fetch.fanout and not fetch.shared_blocks:
                        # Nothing ever came on the shared topic (a broker ACL without it):
                        # ask for blocks on this device's own topic from now on.
                        self._stop_listening(sha, fetch)
                    if now - fetch.last_block >= fetch.timeout:
                        fetch.timeout = min(fetch.timeout * 2, self.max_timeout_s)
                    for i in expired:
                        del fetch.in_flight[i]
                if expired or not fetch.in_flight:
                    self._request(sha, fetch)

    def on_reconnect(self) -> None:
        """After a (re)connection: whatever was in flight may be lost, ask again."""
        with self._lock:
            for sha, fetch in list(self._fetches.items()):
                fetch.transfer.flush()
                fetch.in_flight.clear()
                fetch.timeout = self.timeout_s
                self._request(sha, fetch)

    def cancel(self, sha256: str) -> None:
        """Stop fetching; what was received stays on disk and resumes with the next want()."""
        with self._lock:
            for list_sha, wanted in list(self._lists.items()):
                if wanted.sha256 == sha256:
                    del self._lists[list_sha]
                    self.cancel(list_sha)
            fetch = self._fetches.pop(sha256, None)
            if fetch is not None:
                self._stop_listening(sha256, fetch)
                fetch.transfer.close()

    def _stop_listening(self, sha256: str, fetch: _Fetch) -> None:
        if fetch.fanout and self.unsubscribe is not None:
            fetch.fanout = False
            try:
                self.unsubscribe(self._topics.fanout_blocks(sha256))
            except Exception:  # noqa: BLE001 - a lost subscription only costs traffic
                pass

    def close(self) -> None:
        """Persist and release every transfer (at shutdown)."""
        with self._lock:
            self._lists.clear()
            for sha in list(self._fetches):
                self.cancel(sha)

    def progress(self, sha256: str) -> Optional[Tuple[int, int]]:
        """(blocks received, blocks) of an artifact being fetched, else None."""
        with self._lock:
            fetch = self._fetches.get(sha256)
            if fetch is None:
                return None
            return fetch.transfer.received(), fetch.transfer.blocks

    def active(self) -> List[str]:
        with self._lock:
            return sorted(self._fetches)


def sibling_url(url: Optional[str], sha256: str, other: str) -> Optional[str]:
    """The URL of artifact ``other`` on the server that serves ``sha256`` at ``url`` (the
    service's ``/artifacts/<sha256>``); None when ``url`` is not such a URL."""
    if not url or not url.startswith(("http://", "https://")):
        return None
    base, sep, last = url.rpartition("/")
    return base + sep + other if sep and last == sha256 else None
