"""Controller side of the block transfer (docs/protocol.md): ``BlockServer`` answers a device's
artifact requests with the blocks it asks for, on the device's own block topic or, for a device
that listens there, once per window on the artifact's shared (fan-out) topic. Also the hashing
helpers the controller builds job documents with (``sha256_file``, ``block_digests``)."""

import hashlib
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from agent.errors import AgentError
from agent.fsio import sha256_file
from agent.wire import protocol
from agent.wire.fanout_rounds import Rounds
from agent.wire.topics import Topics

Publish = Callable[..., Any]  # publish(topic: str, payload: bytes, qos: int, retain: bool)


def block_digests(path: str, block_size: int) -> bytes:
    """The per-block hash list of a file: each block's 32-byte sha256 digest, in order (what
    a job document's ``artifacts.ROLE.blocks.sha256`` is the sha256 of)."""
    out = []
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(block_size), b""):
            out.append(hashlib.sha256(block).digest())
    return b"".join(out)


class BlockServer(object):
    """Controller side: serves the blocks of local files, known by sha256.

    Each request is answered with at most ``max_blocks_per_request`` blocks (the lowest indices
    asked for), read one at a time with a seek, so memory is bounded by the block size times
    what the MQTT client buffers; the device paces the stream with its request window."""

    def __init__(self, publish: Publish, topics: Topics,
                 max_blocks_per_request: int = 64, fanout_window_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._publish = publish
        self._topics = topics
        self.max_blocks_per_request = max(1, int(max_blocks_per_request))
        self._files: Dict[str, Tuple[str, int]] = {}
        self._lock = threading.Lock()
        self.blocks_sent = 0
        # Fan-out: a block asked for by a device that listens on the artifact's shared topic
        # is published there at most once per window, whatever the number of devices asking;
        # one asked for again within the window goes out in the next round (``poll``).
        self.fanout_window_s = float(fanout_window_s)
        self._clock = clock
        self.rounds = Rounds(self.fanout_window_s, clock)

    @property
    def blocks_deduped(self) -> int:
        """Blocks asked for on the shared topic and not published at once for that request."""
        return self.rounds.deduped

    def expect(self, sha256: str, device: str) -> None:
        """``device`` was just sent a job naming ``sha256``: a large artifact's first round
        waits a moment for it (agent.wire.fanout_rounds)."""
        with self._lock:
            self.rounds.expect(sha256, device)

    def next_due(self) -> Optional[float]:
        """When ``poll`` has a round to publish (the clock's time), or None."""
        with self._lock:
            return self.rounds.next_due()

    def poll(self) -> int:
        """Publish the rounds that came; returns the number of blocks published."""
        with self._lock:
            due = self.rounds.due()
        sent = 0
        for key, indices in due.items():
            sha, block_size = key.rsplit(":", 1)
            with self._lock:
                entry = self._files.get(sha)
            if entry is None:
                continue
            try:
                sent += self._send(entry[0], entry[1], sha, int(block_size), indices, None)
            except AgentError:
                continue  # the file went: the devices ask again, and are told
        return sent

    def add_file(self, path: str, sha256: Optional[str] = None) -> str:
        """Serve ``path``; its sha256 is computed when not given. Returns the sha256."""
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise AgentError("file_not_found", "cannot read {}: {}".format(path, exc.strerror))
        sha = protocol.check_sha256(sha256) if sha256 is not None else sha256_file(path)
        with self._lock:
            self._files[sha] = (os.path.abspath(path), size)
        return sha

    def remove(self, sha256: str) -> None:
        with self._lock:
            self._files.pop(sha256, None)

    def files(self) -> Dict[str, Tuple[str, int]]:
        """sha256 -> (path, size) of what is served."""
        with self._lock:
            return dict(self._files)

    def handle_request(self, topic: str, payload: bytes) -> int:
        """Answer one request message; returns the number of blocks published.
        AgentError bad_message, message_too_large, unknown_artifact (not answered)."""
        info = self._topics.parse(topic)
        if info.kind != "artifact_request":
            raise AgentError("bad_message", "expected an artifact request topic, found {}"
                             .format(topic))
        msg = protocol.decode("artifact_request", payload)
        if msg["sha256"] != info.sha256:
            raise AgentError("bad_message", "request on the topic of artifact {} names {}"
                             .format(info.sha256, msg["sha256"]))
        want = protocol.check_request(msg)
        with self._lock:
            entry = self._files.get(msg["sha256"])
        if entry is None:
            raise AgentError("unknown_artifact", "device {} asks for artifact {}, which this "
                             "controller does not serve".format(info.device, msg["sha256"]))
        path, size = entry
        if msg["size"] != size:
            raise AgentError("unknown_artifact", "device {} asks for {} bytes of artifact {}, "
                             "found a file of {} bytes".format(info.device, msg["size"],
                                                               msg["sha256"], size))
        block_size = msg["block_size"]
        indices = protocol.bitmap_indices(want, msg["blocks"], self.max_blocks_per_request)
        fanout = msg.get("fanout") is True
        if fanout:
            with self._lock:
                indices = self.rounds.request(msg["sha256"], block_size, size,
                                              str(info.device), indices)
        return self._send(path, size, msg["sha256"], block_size, indices,
                          None if fanout else info.device)

    def _send(self, path: str, size: int, sha256: str, block_size: int, indices: List[int],
              device: Optional[str]) -> int:
        """Publish blocks of a file: on ``device``'s own topic, or (None) the shared one."""
        try:
            with open(path, "rb") as f:
                for index in indices:
                    length = protocol.block_length(size, block_size, index)
                    f.seek(index * block_size)
                    data = f.read(length)
                    if len(data) != length:
                        raise AgentError("unknown_artifact", "{} changed size while being "
                                         "served (block {} is short)".format(path, index))
                    topic = self._topics.fanout_block(sha256, index) if device is None else \
                        self._topics.block(device, sha256, index)
                    self._publish(topic, data, 1, False)
                    self.blocks_sent += 1
        except OSError as exc:
            raise AgentError("file_not_found", "cannot read {}: {}".format(path, exc.strerror))
        return len(indices)
