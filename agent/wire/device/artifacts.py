"""Content-addressed artifact store: paths, resumable downloads, the size budget.

Complete artifacts live at ``<state_dir>/artifacts/<sha[:2]>/<sha>`` (read-only); a download in
progress is ``<state_dir>/artifacts/partial/<sha>.part``, assembled block by block by a
``block_assembly.Transfer``. File names are hashes only: no string from the wire ever becomes a
path. Under pressure the store reclaims idle partial downloads, then evicts the least recently
used artifacts nothing references.
"""

import errno
import hashlib
import os
import stat
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Set

from agent.errors import AgentError
from agent.fsio import fsync_dir
from agent.wire import protocol
from agent.wire.device.block_assembly import HASH_CHUNK, Transfer, disk_full

if TYPE_CHECKING:  # the daemon's journal is handed in; wire never imports the device at run time
    from agent.device.journal.store import Journal

DEFAULT_RESERVE = 64 << 20  # keep this much disk free for the journal, logs and engines
FLUSH_BYTES = 32 << 20  # fsync a download and record its blocks at least this often
# A partial download idle this long is reclaimed under store pressure and at start-up even
# when an unfinished job still names it (it downloads again from scratch if that job runs).
DEFAULT_PARTIAL_AGE_S = 24 * 3600.0


class ArtifactStore(object):
    """Artifacts by sha256 under ``<state_dir>/artifacts``, with a size budget."""

    def __init__(
        self,
        state_dir: str,
        journal: "Journal",
        max_bytes: Optional[int] = None,
        reserve_bytes: int = DEFAULT_RESERVE,
        flush_every: Optional[int] = None,
        statvfs: Callable[[str], Any] = os.statvfs,
        max_partial_age_s: float = DEFAULT_PARTIAL_AGE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.root = os.path.join(state_dir, "artifacts")
        self.journal = journal
        self.max_bytes = max_bytes
        self.max_partial_age_s = max_partial_age_s
        self._clock = clock
        self.reserve_bytes = reserve_bytes
        # A transfer's received blocks are fsync'd and recorded in the journal every
        # ``flush_every`` blocks, by default every FLUSH_BYTES (and by the fetcher's tick):
        # a crash re-fetches at most that much, and a fast download is not held up by commits.
        self.flush_every = max(1, int(flush_every)) if flush_every else None
        self.flush_bytes = FLUSH_BYTES
        self._statvfs = statvfs
        self._open: Dict[str, Transfer] = {}
        os.makedirs(os.path.join(self.root, "partial"), exist_ok=True)
        self._recover()

    # ------------------------------------------------------------------------------ paths

    def _final_path(self, sha256: str) -> str:
        protocol.check_sha256(sha256)
        return os.path.join(self.root, sha256[:2], sha256)

    def partial_path(self, sha256: str) -> str:
        protocol.check_sha256(sha256)
        return os.path.join(self.root, "partial", sha256 + ".part")

    def has(self, sha256: str) -> bool:
        return os.path.isfile(self._final_path(sha256))

    def path(self, sha256: str) -> str:
        """Path of a stored artifact; AgentError unknown_artifact when it is not stored."""
        path = self._final_path(sha256)
        if not os.path.isfile(path):
            raise AgentError("unknown_artifact", "artifact {} is not in the store".format(sha256))
        return path

    def touch(self, sha256: str) -> None:
        """Mark an artifact as used now (eviction removes the least recently used first)."""
        try:
            os.utime(self._final_path(sha256), None)
        except OSError:
            pass

    # ------------------------------------------------------------------------------ transfers

    def begin(self, sha256: str, size: int,
              block_size: int = protocol.DEFAULT_BLOCK_SIZE) -> Transfer:
        """Start or resume assembling an artifact. A journal transfer of the same sha256 and
        size resumes with its block size and bitmap; an artifact already stored gives a
        complete Transfer. AgentError bad_argument, disk_full."""
        protocol.check_sha256(sha256)
        if not isinstance(size, int) or not 1 <= size <= 1 << 40:
            raise AgentError("bad_argument", "artifact size must be 1..2**40 bytes, found {!r}"
                             .format(size))
        block_size = self._fit_block_size(size, block_size)
        if self.has(sha256):
            full = protocol.bitmap_new(protocol.block_count(size, block_size), fill=True)
            return Transfer(self, sha256, size, block_size, full, done_path=self.path(sha256))
        current = self._open.get(sha256)
        if current is not None:
            if current.size == size:
                return current
            current.abort()
        row = self.journal.transfer_get(sha256)
        partial = self.partial_path(sha256)
        fresh = not (row is not None and row["size"] == size and os.path.isfile(partial))
        if not fresh:
            assert row is not None
            have = bytearray(row["bitmap"])
            block_size = row["block_size"]
            if len(have) != (protocol.block_count(size, block_size) + 7) // 8:
                have = protocol.bitmap_new(protocol.block_count(size, block_size))
        else:
            if row is not None or os.path.exists(partial):
                self.discard_partial(sha256)
            have = protocol.bitmap_new(protocol.block_count(size, block_size))
        self._ensure_space(sha256, size)
        if fresh:  # the record first: a partial file without one is an orphan to recovery
            self.journal.transfer_put(sha256, size, block_size, bytes(have))
        transfer = Transfer(self, sha256, size, block_size, have)
        self._allocate(transfer)
        self._open[sha256] = transfer
        return transfer

    def transfer(self, sha256: str) -> Optional[Transfer]:
        """A transfer begun in this process and not finished."""
        return self._open.get(sha256)

    def _fit_block_size(self, size: int, block_size: int) -> int:
        if not protocol.MIN_BLOCK_SIZE <= block_size <= protocol.MAX_BLOCK_SIZE:
            raise AgentError("bad_argument", "block size must be {}..{}, found {}".format(
                protocol.MIN_BLOCK_SIZE, protocol.MAX_BLOCK_SIZE, block_size))
        needed = -(-size // protocol.MAX_BLOCKS)  # the smallest size within MAX_BLOCKS blocks
        if needed > block_size:
            block_size = -(-needed // 1024) * 1024
        if block_size > protocol.MAX_BLOCK_SIZE:
            raise AgentError("bad_argument", "artifact of {} bytes is too large for {} blocks of "
                             "at most {} bytes".format(size, protocol.MAX_BLOCKS,
                                                       protocol.MAX_BLOCK_SIZE))
        return block_size

    def _allocate(self, transfer: Transfer) -> None:
        """Reserve the file's space up front so the disk cannot fill mid-download."""
        fd = transfer._fd
        assert fd is not None
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, transfer.size)
            else:
                os.ftruncate(fd, transfer.size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                transfer.abort()
                raise disk_full("artifact {}".format(transfer.sha256), transfer.size,
                                self.free_bytes())
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystems without fallocate
                os.ftruncate(fd, transfer.size)
            else:
                raise

    def publish_partial(self, sha256: str) -> str:
        """Move a verified partial file into place (atomic rename, made durable)."""
        final = self._final_path(sha256)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        partial = self.partial_path(sha256)
        os.chmod(partial, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.replace(partial, final)
        fsync_dir(os.path.dirname(final))
        fsync_dir(os.path.dirname(partial))
        self.journal.transfer_delete(sha256)
        return final

    def discard_partial(self, sha256: str) -> None:
        transfer = self._open.pop(sha256, None)
        if transfer is not None:
            transfer._close()
        try:
            os.unlink(self.partial_path(sha256))
        except FileNotFoundError:
            pass
        self.journal.transfer_delete(sha256)

    def forget(self, sha256: str, transfer: Transfer) -> None:
        if self._open.get(sha256) is transfer:
            del self._open[sha256]

    def _recover(self) -> None:
        """Make files and journal agree after a crash: partial files without a journal record
        (or the reverse) and leftover temporary files are dropped."""
        recorded = {t["sha256"]: t for t in self.journal.transfers()}
        partial_dir = os.path.join(self.root, "partial")
        for name in os.listdir(partial_dir):
            sha = name[:-len(".part")] if name.endswith(".part") else ""
            if not protocol.valid_sha256(sha) or sha not in recorded or self.has(sha):
                _unlink(os.path.join(partial_dir, name))
        for sha in recorded:
            if self.has(sha) or not os.path.isfile(self.partial_path(sha)):
                self.journal.transfer_delete(sha)

    # ------------------------------------------------------------------------------ partials

    def partials(self) -> List[Dict[str, Any]]:
        """Downloads in progress or left behind: sha256, size (what they count against the
        budget), on_disk (bytes allocated), blocks, received (blocks), updated (last
        progress, epoch seconds), open (being fetched by this process)."""
        out = []
        for t in self.journal.transfers():
            try:
                on_disk = os.stat(self.partial_path(t["sha256"])).st_blocks * 512
            except OSError:
                on_disk = 0
            blocks = protocol.block_count(t["size"], t["block_size"])
            out.append({"sha256": t["sha256"], "size": t["size"], "on_disk": on_disk,
                        "blocks": blocks, "received": protocol.bitmap_count(t["bitmap"], blocks),
                        "updated": t["updated"], "open": t["sha256"] in self._open})
        return out

    def reclaim_partials(self, keep: Iterable[str] = (), need_bytes: Optional[int] = None,
                         max_age_s: Optional[float] = None) -> List[str]:
        """Discard partial downloads nothing needs, oldest progress first: every one not being
        fetched here (``open``) that no unfinished job names and is not in ``keep``, and those
        idle longer than ``max_age_s`` (default ``max_partial_age_s``) even if a job names
        them. With ``need_bytes``, stop once that many bytes are freed. Returns the hashes."""
        age = self.max_partial_age_s if max_age_s is None else max_age_s
        keep = set(keep)
        wanted = keep | self.journal.referenced_artifacts()
        now = self._clock()
        removed: List[str] = []
        freed = 0
        for p in sorted(self.partials(), key=lambda p: p["updated"]):
            if need_bytes is not None and freed >= need_bytes:
                break
            if p["open"] or p["sha256"] in keep:
                continue
            if p["sha256"] in wanted and now - p["updated"] <= age:
                continue
            self.discard_partial(p["sha256"])
            removed.append(p["sha256"])
            freed += p["size"]
        return removed

    # ------------------------------------------------------------------------------ import

    def put_file(self, src: str, sha256: Optional[str] = None) -> str:
        """Copy a local file into the store (verifying ``sha256`` when given); returns the
        stored path. AgentError file_not_found, hash_mismatch, disk_full."""
        try:
            size = os.path.getsize(src)
            source = open(src, "rb")
        except OSError as exc:
            raise AgentError("file_not_found", "cannot read {}: {}".format(src, exc.strerror))
        with source:
            if sha256 is not None and self.has(sha256):
                return self.path(sha256)
            self._ensure_space(sha256 or "", size)
            tmp = os.path.join(self.root, "partial", ".import-{}".format(os.getpid()))
            digest = hashlib.sha256()
            try:
                with open(tmp, "wb") as out:
                    for chunk in iter(lambda: source.read(HASH_CHUNK), b""):
                        digest.update(chunk)
                        out.write(chunk)
                    out.flush()
                    os.fsync(out.fileno())
            except OSError as exc:
                _unlink(tmp)
                if exc.errno == errno.ENOSPC:
                    raise disk_full("importing {}".format(src), size, self.free_bytes())
                raise
        found = digest.hexdigest()
        if sha256 is not None and found != sha256:
            _unlink(tmp)
            raise AgentError("hash_mismatch", "{} expected sha256 {}, found {}".format(
                src, sha256, found))
        final = self._final_path(found)
        if os.path.isfile(final):
            _unlink(tmp)
            return final
        os.makedirs(os.path.dirname(final), exist_ok=True)
        os.chmod(tmp, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.replace(tmp, final)
        fsync_dir(os.path.dirname(final))
        return final

    # ------------------------------------------------------------------------------ budget

    def entries(self) -> List[Dict[str, Any]]:
        """Stored artifacts: sha256, size, used (last use, epoch seconds)."""
        out = []
        for shard in sorted(os.listdir(self.root)):
            directory = os.path.join(self.root, shard)
            if len(shard) != 2 or not os.path.isdir(directory):
                continue
            for name in os.listdir(directory):
                if protocol.valid_sha256(name) and name[:2] == shard:
                    try:
                        st = os.stat(os.path.join(directory, name))
                    except OSError:
                        continue
                    out.append({"sha256": name, "size": st.st_size, "used": st.st_mtime})
        return out

    def usage(self) -> int:
        """Bytes held: stored artifacts plus the full size of every transfer in progress."""
        return (sum(e["size"] for e in self.entries())
                + sum(t["size"] for t in self.journal.transfers()))

    def free_bytes(self) -> int:
        st = self._statvfs(self.root)
        return int(st.f_bavail) * int(st.f_frsize)

    def remove(self, sha256: str) -> bool:
        try:
            os.unlink(self._final_path(sha256))
            return True
        except FileNotFoundError:
            return False

    def evict(self, need_bytes: int, keep: Iterable[str] = ()) -> List[str]:
        """Remove least recently used artifacts that nothing references (unfinished jobs,
        active or previous engines, ``keep``) until ``need_bytes`` are freed; returns the
        removed hashes (possibly freeing less than asked)."""
        protected: Set[str] = set(keep) | self.journal.referenced_artifacts() | set(self._open)
        removed: List[str] = []
        freed = 0
        for entry in sorted(self.entries(), key=lambda e: e["used"]):
            if freed >= need_bytes:
                break
            if entry["sha256"] in protected:
                continue
            if self.remove(entry["sha256"]):
                removed.append(entry["sha256"])
                freed += entry["size"]
        return removed

    def _ensure_space(self, sha256: str, size: int) -> None:
        """Room for ``size`` more bytes within the store budget and on the disk (minus the
        reserve), evicting unreferenced artifacts if that makes room. AgentError disk_full."""
        partial = self.partial_path(sha256) if sha256 else ""
        allocated = 0
        if partial and os.path.exists(partial):
            allocated = min(size, os.stat(partial).st_blocks * 512)
        needed = size - allocated
        keep = [sha256] if sha256 else []
        if self.max_bytes is not None:
            in_progress = self.journal.transfer_get(sha256) if sha256 else None

            def over_budget() -> int:
                assert self.max_bytes is not None
                return self.usage() - (in_progress["size"] if in_progress else 0) + size \
                    - self.max_bytes

            over = over_budget()
            if over > 0:  # partial downloads nothing needs first, then unreferenced artifacts
                self.reclaim_partials(keep, need_bytes=over)
                over = over_budget()
            if over > 0:
                self.evict(over, keep)
                over = over_budget()
            if over > 0:
                raise AgentError(
                    "disk_full",
                    "artifact {} needs {} bytes, the store budget of {} bytes has {} left".format(
                        sha256 or "import", size, self.max_bytes, size - over),
                    {"needed": size, "free": size - over},
                )
        free = self.free_bytes()
        if needed + self.reserve_bytes > free:
            self.reclaim_partials(keep, need_bytes=needed + self.reserve_bytes - free)
            free = self.free_bytes()
        if needed + self.reserve_bytes > free:
            self.evict(needed + self.reserve_bytes - free, keep)
            free = self.free_bytes()
        if needed + self.reserve_bytes > free:
            raise disk_full("artifact {} (with a reserve of {} bytes)".format(
                sha256 or "import", self.reserve_bytes), needed + self.reserve_bytes, free)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
