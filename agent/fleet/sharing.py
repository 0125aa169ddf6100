"""Fleet engine sharing, controller side (docs/fleet.md, "Engine sharing").

``SharePolicy`` decides, inside the pure ``Rollout``, who builds: the first device of each
device class whose stage starts builds, with a one-time offer URL in its job document; the
others of its class wait (PENDING, with a note) until its engine arrives, then get a job
document whose ``engine`` artifact is that engine (so its sha256 and per-block hashes are
signed with the rest of the document), or, when the builder fails, sends nothing or the wait
times out, a document without one: they build themselves. A device's class is what makes an
engine portable and the service can see in its status: board, JetPack, TensorRT and backend
(the device checks the exact engine cache key anyway, and builds on a mismatch).

``ShareBoard`` is the service's side of the uploads: one-time tokens, the ``PUT
/shares/<token>`` handler ``HttpSource`` calls, and the content-addressed store the engines
land in (served like any artifact).
"""

import hashlib
import logging
import os
import secrets
import threading
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from agent.wire import protocol
from agent.wire.block_server import block_digests

log = logging.getLogger("agent.fleet")

DEFAULT_WAIT_S = 900.0
MAX_ENGINE_BYTES = 4 << 30


# The fields of a device's ``platform.engine_class`` (``PlatformInfo.engine_class``), in order.
CLASS_FIELDS = ("version", "board", "module", "gpu", "compute_capability", "dla_cores",
                "jetpack", "cuda", "tensorrt", "backend")


def device_class(status: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The class of a device from its retained status, or None (unknown: it builds alone).

    A device of this release sends ``platform.engine_class``: the class is its fields, version
    first (``v2|...``), so module, GPU, DLA cores and CUDA separate devices whose engines do
    not run on each other. A device of an earlier release sends none: its class is the old one
    (``v1|board|jetpack|tensorrt|backend``), which never equals a new class, so daemons of the
    two releases never share engines (their engine keys differ as well)."""
    platform = (status or {}).get("platform") or {}
    cls = platform.get("engine_class")
    if isinstance(cls, Mapping) and cls.get("version"):
        return "v" + "|".join(str(cls.get(k) or "-")[:64] for k in CLASS_FIELDS)
    parts = [platform.get(k) for k in ("board", "jetpack", "tensorrt", "backend")]
    if not any(parts):
        return None
    return "v1|" + "|".join(str(p or "-")[:64] for p in parts)


class SharePolicy(object):
    """Who builds and who waits, per class; the state lives in each ``DeviceRun.share``
    (persisted with the run): role builder | waiting | adopting | building, class, since,
    and on a builder the engine reference once it arrived."""

    def __init__(self, classes: Mapping[str, Optional[str]], wait_s: float = DEFAULT_WAIT_S
                 ) -> None:
        self.classes = dict(classes)
        self.wait_s = float(wait_s)

    def engine_of(self, runs: Any, cls: str) -> Optional[Dict[str, Any]]:
        for run in runs:
            share = run.share or {}
            if share.get("class") == cls and share.get("role") == "builder" and \
                    share.get("engine") and run.state == "SUCCEEDED":
                return dict(share["engine"])
        return None

    def builder_of(self, runs: Any, cls: str) -> Optional[Any]:
        for run in runs:
            share = run.share or {}
            if share.get("class") == cls and share.get("role") == "builder" and \
                    not run.terminal:
                return run
        return None

    def decide(self, run: Any, runs: Any, now: float) -> Tuple[str, Optional[Dict[str, Any]]]:
        """For a device whose stage starts: ("offer", None) it builds and offers,
        ("engine", ref) it adopts ref, ("wait", None) it waits, ("build", None) alone."""
        cls = self.classes.get(run.device)
        if not cls:
            run.share = {"role": "building", "note": "built: its class is unknown"}
            return "build", None
        ref = self.engine_of(runs, cls)
        if ref is not None:
            run.share = {"role": "adopting", "class": cls, "engine": ref["sha256"]}
            return "engine", ref
        builder = self.builder_of(runs, cls)
        if builder is not None:
            run.share = {"role": "waiting", "class": cls, "since": now}
            run.note = "waiting for the engine of {}".format(builder.device)
            return "wait", None
        if any((r.share or {}).get("class") == cls and (r.share or {}).get("role") == "builder"
               for r in runs):
            # The class had its builder and got no engine from it: each builds alone.
            run.share = {"role": "building", "class": cls,
                         "note": "built: the class's builder offered no engine"}
            return "build", None
        run.share = {"role": "builder", "class": cls, "since": now}
        return "offer", None

    def released(self, runs: Any, now: float) -> List[Tuple[Any, Optional[Dict[str, Any]], str]]:
        """Waiting devices to send now: (run, engine ref or None, note)."""
        out: List[Tuple[Any, Optional[Dict[str, Any]], str]] = []
        # Per class, looked up once: this loop changes waiting devices only, never a builder.
        seen: Dict[str, Tuple[Optional[Dict[str, Any]], Optional[Any]]] = {}
        for run in runs:
            share = run.share or {}
            if share.get("role") != "waiting" or run.state != "PENDING":
                continue
            cls = str(share.get("class") or "")
            if cls not in seen:
                seen[cls] = (self.engine_of(runs, cls), self.builder_of(runs, cls))
            engine, builder = seen[cls]
            ref = dict(engine) if engine is not None else None
            if ref is not None:
                run.share = {"role": "adopting", "class": cls, "engine": ref["sha256"]}
                out.append((run, ref, ""))
            elif builder is None:
                run.share = {"role": "building", "class": cls,
                             "note": "built: the class's builder offered no engine"}
                out.append((run, None, run.share["note"]))
            elif now - float(share.get("since") or now) >= self.wait_s:
                run.share = {"role": "building", "class": cls,
                             "note": "built: no engine after waiting {:.0f} s".format(
                                 self.wait_s)}
                out.append((run, None, run.share["note"]))
        return out


class ShareBoard(object):
    """Service side of the uploads. ``token(rollout, device, cls)`` makes the one-time URL
    path of a builder; ``receive`` (HTTP thread) checks and stores the container; the service
    thread takes the arrivals with ``arrived()``."""

    def __init__(self, store: Any, directory: str, add_file: Callable[[str, str], Any],
                 max_bytes: int = MAX_ENGINE_BYTES) -> None:
        self.store = store
        self.directory = os.path.abspath(directory)
        self.add_file = add_file
        self.max_bytes = int(max_bytes)
        self._tokens: Dict[str, Tuple[str, str, str]] = {}
        self._arrived: List[Tuple[str, str, Dict[str, Any]]] = []
        self._lock = threading.Lock()
        self.received = 0

    def token(self, rollout_id: str, device: str) -> str:
        tok = secrets.token_hex(16)
        with self._lock:
            self._tokens[tok] = (rollout_id, device, "")
        return tok

    def expects(self, token: str) -> bool:
        with self._lock:
            return token in self._tokens

    def receive(self, token: str, body: Any, length: int) -> Tuple[int, str]:
        """The PUT of a builder's engine: (HTTP status, message). The body is hashed as it is
        written; it lands in the content-addressed store under its sha256."""
        with self._lock:
            owner = self._tokens.pop(token, None)
        if owner is None:
            return 404, "no such share upload (unknown or used token)"
        if length <= 0 or length > self.max_bytes:
            return 413, "an engine of 1 to {} bytes is expected, found {}".format(
                self.max_bytes, length)
        os.makedirs(os.path.join(self.directory, "tmp"), exist_ok=True)
        tmp = os.path.join(self.directory, "tmp", "share-" + token)
        digest = hashlib.sha256()
        left = length
        try:
            with open(tmp, "wb") as out:
                while left > 0:
                    data = body.read(min(1 << 16, left))
                    if not data:
                        break
                    digest.update(data)
                    out.write(data)
                    left -= len(data)
                out.flush()
                os.fsync(out.fileno())
        except BaseException:  # a reset or timed-out upload leaves no file behind
            os.unlink(tmp)
            raise
        if left:
            os.unlink(tmp)
            return 400, "the body ended {} bytes early".format(left)
        sha = digest.hexdigest()
        ref = self._store(tmp, sha, length, owner[1])
        with self._lock:
            self._arrived.append((owner[0], owner[1], ref))
            self.received += 1
        log.info("engine %s (%d bytes) offered by %s for rollout %s", sha[:16], length,
                 owner[1], owner[0])
        return 201, sha

    def _place(self, src: str, sha: str) -> str:
        path = os.path.join(self.directory, sha[:2], sha)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.replace(src, path)
        return path

    def _store(self, tmp: str, sha: str, size: int, device: str) -> Dict[str, Any]:
        path = self._place(tmp, sha)
        block_size = protocol.manifest_block_size(size)
        digests = block_digests(path, block_size)
        bsha = hashlib.sha256(digests).hexdigest()
        btmp = path + ".blocks.tmp"
        with open(btmp, "wb") as f:
            f.write(digests)
        bpath = self._place(btmp, bsha)
        name = "engine-from-{}".format(device)[:255]
        return {"sha256": sha, "size": size, "name": name, "path": path, "blocks_path": bpath,
                "blocks_size": len(digests),
                "blocks": {"block_size": block_size, "sha256": bsha}}

    def arrived(self) -> List[Tuple[str, str, Dict[str, Any]]]:
        """(rollout id, device, artifact reference) of the engines uploaded since the last
        call, now in the artifacts table and served (the service's thread: the database)."""
        with self._lock:
            got, self._arrived = self._arrived, []
        out = []
        for rid, device, ref in got:
            sha, bsha = ref["sha256"], ref["blocks"]["sha256"]
            self.store.add_artifact(sha, ref["size"], ref["path"], ref["name"])
            self.store.add_artifact(bsha, ref["blocks_size"], ref["blocks_path"],
                                    ref["name"] + ".blocks")
            self.add_file(ref["path"], sha)
            self.add_file(ref["blocks_path"], bsha)
            out.append((rid, device, {k: ref[k] for k in ("sha256", "size", "name", "blocks")}))
        return out


def share_summary(controller: Mapping[str, Any], reported: Any) -> Optional[Dict[str, Any]]:
    """What a report shows per device: mode (built | adopted | cached | waiting), the role the
    controller gave it, and the reason it built when it was sent an engine or waited for one."""
    if not controller and not isinstance(reported, dict):
        return None
    rep = reported if isinstance(reported, dict) else {}
    role = str(controller.get("role") or "")
    mode = str(rep.get("mode") or {"waiting": "waiting", "building": "built"}.get(role, ""))
    reason = str(rep.get("reason") or controller.get("note") or "")
    out: Dict[str, Any] = {"mode": mode or None, "role": role or None, "reason": reason or None}
    if rep.get("offered") is not None:
        out["offered"] = bool(rep.get("offered"))
    return out

