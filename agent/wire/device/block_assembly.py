"""One artifact assembled from blocks: the partial file written at each block's offset, the
bitmap of blocks received (made durable in the journal after every fsync'd batch), and the
final check of size and sha256 before the store takes the file (Python >= 3.8). The sha256 is
computed as the blocks arrive (in order, from the bytes in hand; blocks that came early are
read back once the gap before them fills), so completing a download does not read the whole
file again.

The store (``artifacts.ArtifactStore``) owns the paths, the budget and the journal; a
``Transfer`` is what ``ArtifactStore.begin`` hands out for one download. Memory stays bounded by
one block (writes) or one hashing chunk (verification).
"""

import errno
import hashlib
import os
from typing import TYPE_CHECKING, List, Optional

from agent.errors import AgentError
from agent.wire import protocol

if TYPE_CHECKING:  # the store hands itself in
    from agent.wire.device.artifacts import ArtifactStore

HASH_CHUNK = 1 << 20


def disk_full(what: str, needed: int, free: int) -> AgentError:
    """The ``disk_full`` error of the store and its transfers: what needed how much."""
    return AgentError(
        "disk_full",
        "{} needs {} bytes, found {} bytes free".format(what, needed, free),
        {"needed": needed, "free": free},
    )


class Transfer(object):
    """One artifact being assembled from blocks (see ``ArtifactStore.begin``)."""

    def __init__(self, store: "ArtifactStore", sha256: str, size: int, block_size: int,
                 have: bytearray, done_path: Optional[str] = None) -> None:
        self.sha256 = sha256
        self.size = size
        self.block_size = block_size
        self.blocks = protocol.block_count(size, block_size)
        self._store = store
        self._have = have
        self._count = protocol.bitmap_count(have, self.blocks)
        self._scan_from = 0  # every block below this byte of the bitmap has arrived
        self._dirty = 0  # blocks written since the last flush
        self._dirty_bytes = 0
        self._digest = hashlib.sha256()  # over blocks 0.._hashed-1
        self._hashed = 0
        self._done_path = done_path
        self._fd: Optional[int] = None
        if done_path is None:
            self._fd = os.open(store.partial_path(sha256), os.O_RDWR | os.O_CREAT, 0o600)

    def missing_indices(self, limit: Optional[int] = None) -> List[int]:
        """The blocks still missing, lowest first, at most ``limit``. Blocks are only ever
        added, so the scan starts past the bitmap's leading full bytes (remembered): asking
        for the next window costs about the window, not the whole bitmap."""
        if self._done_path is not None:
            return []
        have, out = self._have, []  # type: bytearray, List[int]
        start = self._scan_from
        while start < len(have) and have[start] == 0xFF:
            start += 1
        self._scan_from = start
        for byte_index in range(start, len(have)):
            byte = have[byte_index]
            if byte == 0xFF:
                continue
            for bit in range(8):
                index = byte_index * 8 + bit
                if index >= self.blocks:
                    return out
                if not byte >> bit & 1:
                    out.append(index)
                    if limit is not None and len(out) >= limit:
                        return out
        return out

    def received(self) -> int:
        return self.blocks if self._done_path is not None else self._count

    def has_block(self, index: int) -> bool:
        return self._done_path is not None or (
            0 <= index < self.blocks and protocol.bitmap_get(self._have, index))

    def write_block(self, index: int, data: bytes) -> bool:
        """Store block ``index``. False (nothing written) for an index out of range or a length
        other than the block's; a block already held is accepted and not rewritten."""
        if not isinstance(index, int) or not 0 <= index < self.blocks:
            return False
        if len(data) != protocol.block_length(self.size, self.block_size, index):
            return False
        if self.has_block(index):
            return True
        assert self._fd is not None
        offset = index * self.block_size
        view = memoryview(data)
        try:
            while view:
                written = os.pwrite(self._fd, view, offset)
                view = view[written:]
                offset += written
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise disk_full("block {} of artifact {}".format(index, self.sha256),
                                len(data), self._store.free_bytes())
            raise
        protocol.bitmap_set(self._have, index)
        self._count += 1
        self._dirty += 1
        self._dirty_bytes += len(data)
        if index == self._hashed:
            self._digest.update(data)
            self._hashed += 1
            self._hash_held()
        every = self._store.flush_every
        if (self._dirty >= every) if every else self._dirty_bytes >= self._store.flush_bytes:
            self.flush()
        return True

    def _hash_held(self) -> None:
        """Extend the running sha256 over the blocks already on disk past ``_hashed`` (blocks
        that arrived out of order, or before a restart)."""
        assert self._fd is not None
        while self._hashed < self.blocks and protocol.bitmap_get(self._have, self._hashed):
            length = protocol.block_length(self.size, self.block_size, self._hashed)
            offset = self._hashed * self.block_size
            while length > 0:
                chunk = os.pread(self._fd, min(length, HASH_CHUNK), offset)
                if not chunk:
                    return  # a short file: finish() reports the mismatch
                self._digest.update(chunk)
                offset += len(chunk)
                length -= len(chunk)
            self._hashed += 1

    def flush(self) -> None:
        """Make received blocks durable: fsync the data first, then record them in the journal
        (the journal never claims a block that is not on disk)."""
        if self._dirty and self._fd is not None:
            os.fsync(self._fd)
            self._store.journal.transfer_update(self.sha256, bytes(self._have))
            self._dirty = self._dirty_bytes = 0

    def complete(self) -> bool:
        return self.received() == self.blocks

    def finish(self) -> str:
        """Verify size and sha256 and move the file into the store; returns its path. A
        mismatch discards the partial file (AgentError hash_mismatch)."""
        if self._done_path is not None:
            return self._done_path
        if not self.complete():
            raise AgentError("internal_error", "artifact {} is missing {} of {} blocks".format(
                self.sha256, self.blocks - self._count, self.blocks))
        assert self._fd is not None
        # Durable before the rename (publish_partial); the journal's record of this transfer
        # goes with it, so it is not updated first.
        os.fsync(self._fd)
        self._dirty = self._dirty_bytes = 0
        self._hash_held()
        size = os.fstat(self._fd).st_size
        found = self._digest.hexdigest() if self._hashed == self.blocks else "(unreadable)"
        if found != self.sha256 or size != self.size:
            self.abort()
            raise AgentError(
                "hash_mismatch",
                "artifact expected sha256 {} and {} bytes, found sha256 {} and {} bytes; the "
                "download was discarded".format(self.sha256, self.size, found, size),
                {"expected": self.sha256, "found": found},
            )
        path = self._store.publish_partial(self.sha256)
        self._close()
        self._done_path = path
        return path

    def abort(self) -> None:
        """Drop the partial file and its journal record."""
        self._close()
        self._store.discard_partial(self.sha256)

    def close(self) -> None:
        """Persist what was received and release the file (the transfer can resume later)."""
        self.flush()
        self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._store.forget(self.sha256, self)
