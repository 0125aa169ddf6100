"""Fleet engine sharing, controller side (docs/fleet.md, "Engine sharing").

``SharePolicy`` decides, inside the pure ``Rollout``, who builds: the first designated builder
of each device class whose stage starts builds, with an offer URL (two uploads at most) in its
job document; the
others of its class wait (PENDING, with a note) until its engine arrives, then get a job
document whose ``engine`` artifact is that engine (so its sha256 and per-block hashes are
signed with the rest of the document), or, when the builder fails, sends nothing or the wait
times out, a document without one: they build themselves. A device's class is what makes an
engine portable and the service can see in its status: board, JetPack, TensorRT and backend
(the device checks the exact engine cache key anyway, and builds on a mismatch).

Only *designated builders* offer (``fleet serve --builders ID,...`` or the operator's label
``role=builder``, never a device's own claim), and their class is the service's record of
their admitted, signed status. An engine a builder uploaded is handed to its class only when
the builder's own signed SUCCEEDED report names that upload's sha256 (``result.share.sha256``):
an upload the builder did not report (its key stolen, its token raced) is refused, and said
so. A revoked engine (``fleet engines revoke SHA``) is never handed out again. With a quorum
of K (``fleet serve --share-quorum K``), K designated builders of a class build, and the
engine is handed out only once K of them reported the same digest of their outputs on the
rollout's inputs (``result.share.outputs_sha256``): one compromised builder is not enough.

``ShareBoard`` is the service's side of the uploads: upload tokens, the ``PUT
/shares/<token>`` handler ``HttpSource`` calls, and the content-addressed store the engines
land in (served like any artifact).
"""

import base64
import hashlib
import logging
import os
import secrets
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from agent.engines.share import MAGIC
from agent.wire import protocol
from agent.wire.block_server import block_digests

log = logging.getLogger("agent.fleet")

DEFAULT_WAIT_S = 900.0
MAX_ENGINE_BYTES = 4 << 30
MAX_OFFERS = 2  # uploads kept per builder run: its own, and one a stolen key raced in
BUILDER_LABEL = ("role", "builder")
LOG_EVERY_S = 10.0  # the operator's label that designates a builder


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


def designated_builders(devices: Any, listed: Any, assigned: Mapping[str, Mapping[str, str]]
                        ) -> frozenset:
    """The designated builders among ``devices``: those ``fleet serve --builders`` lists and
    those an operator labelled ``role=builder`` (``assigned``: the operator's labels, ``fleet
    label``; a device's own claim of the label counts for nothing)."""
    key, value = BUILDER_LABEL
    listed = set(listed)
    return frozenset(d for d in devices
                     if d in listed or (assigned.get(d) or {}).get(key) == value)


class SharePolicy(object):
    """Who builds and who waits, per class; the state lives in each ``DeviceRun.share``
    (persisted with the run): role builder | waiting | adopting | building, class, since,
    and on a builder the engine reference once it arrived."""

    def __init__(self, classes: Mapping[str, Optional[str]], wait_s: float = DEFAULT_WAIT_S,
                 builders: Optional[Any] = None,
                 revoked: Optional[Callable[[str], bool]] = None, quorum: int = 1) -> None:
        self.classes = dict(classes)
        self.wait_s = float(wait_s)
        # Designated builders (None: every device may build for its class, the old rule;
        # the service always passes a set).
        self.builders = None if builders is None else frozenset(builders)
        self.revoked = revoked or (lambda sha: False)
        self.refused = 0  # uploads refused because the builder's report did not name them
        # fleet serve --share-quorum K: K builders of a class build, and their reported
        # outputs on the rollout's inputs must agree before anyone adopts.
        self.quorum = max(1, int(quorum))

    def designated(self, device: str) -> bool:
        return self.builders is None or device in self.builders

    def order(self, devices: Any) -> List[str]:
        """A stage's devices, designated builders first (their classes' waits follow)."""
        return sorted(devices, key=lambda d: 0 if self.designated(d) else 1)

    def reported(self, run: Any) -> Optional[Dict[str, Any]]:
        """The upload a SUCCEEDED builder's own signed report names, or None. Judged once:
        uploads it did not report are refused (``share.refused``, counted, logged)."""
        share = run.share or {}
        rep = (run.result or {}).get("share") if isinstance(run.result, dict) else None
        rep = rep if isinstance(rep, dict) else {}
        sha = str(rep.get("sha256") or "") if rep.get("offered") else ""
        # A run saved by the previous release holds its one upload as "engine".
        offers = [o for o in (share.get("offers") or
                              ([share["engine"]] if share.get("engine") else []))
                  if isinstance(o, dict)]
        chosen = next((o for o in offers if o.get("sha256") == sha), None)
        if not share.get("judged"):
            share["judged"] = True
            refused = [{"sha256": str(o.get("sha256")),
                        "why": "its builder {} reported {}".format(
                            run.device, "engine " + sha[:16] if sha else
                            "no engine offered ({})".format(
                                str(rep.get("reason") or "no offer")[:120]))}
                       for o in offers if o is not chosen]
            if refused:
                share["refused"] = refused
                self.refused += len(refused)
                log.warning("rollout engine upload(s) %s of builder %s refused: %s",
                            ", ".join(r["sha256"][:16] for r in refused), run.device,
                            refused[0]["why"])
        if chosen is not None and self.revoked(str(chosen.get("sha256"))):
            return None
        return dict(chosen) if chosen is not None else None

    def engine_of(self, runs: Any, cls: str) -> Optional[Dict[str, Any]]:
        """The class's engine: its builder's reported upload; with a quorum of K, the first
        of K builders whose reported output digests agree (None until they do)."""
        agreeing: Dict[str, List[Dict[str, Any]]] = {}
        for run in runs:
            share = run.share or {}
            if share.get("class") == cls and share.get("role") == "builder" and \
                    run.state == "SUCCEEDED":
                ref = self.reported(run)
                if ref is None:
                    continue
                if self.quorum == 1:
                    return ref
                rep = (run.result or {}).get("share") or {}
                digest = str(rep.get("outputs_sha256") or "")
                if digest:
                    agreeing.setdefault(digest, []).append(ref)
                    if len(agreeing[digest]) >= self.quorum:
                        return agreeing[digest][0]
        return None

    def builders_of(self, runs: Any, cls: str) -> int:
        return sum(1 for r in runs if (r.share or {}).get("class") == cls and
                   (r.share or {}).get("role") == "builder")

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
        if self.quorum > 1 and self.designated(run.device) and \
                self.builders_of(runs, cls) < self.quorum:
            run.share = {"role": "builder", "class": cls, "since": now}  # one of the quorum
            return "offer", None
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
        if not self.designated(run.device):
            run.share = {"role": "building", "class": cls,
                         "note": "built: no designated builder of its class in the rollout "
                                 "(fleet serve --builders, or the label role=builder)"}
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
                refused = any((r.share or {}).get("refused") for r in runs
                              if (r.share or {}).get("class") == cls)
                note = "built: the class's builder offered no engine" + (
                    " it reported (its upload was refused)" if refused else "")
                if self.quorum > 1:
                    note = ("built: fewer than {} of the class's builders reported the same "
                            "outputs on the rollout's inputs".format(self.quorum))
                run.share = {"role": "building", "class": cls, "note": note}
                out.append((run, None, run.share["note"]))
            elif now - float(share.get("since") or now) >= self.wait_s:
                run.share = {"role": "building", "class": cls,
                             "note": "built: no engine after waiting {:.0f} s".format(
                                 self.wait_s)}
                out.append((run, None, run.share["note"]))
        return out


class ShareBoard(object):
    """Service side of the uploads. ``token(rollout, device, job_id)`` makes a builder's
    upload URL path, bound to that builder and rollout (``revoke(rollout)`` when it ends or
    is cancelled); ``receive`` (HTTP thread) takes the container only when it is the engine
    the builder signed (``X-Engine-Signature`` over {device, job_id, sha256, size,
    engine_class}, checked with the builder's pinned key from ``builder_key(device)`` ->
    (raw key, engine_class) or None), before and after anything is stored. A refused
    request never uses the token up. The service thread takes the arrivals with
    ``arrived()``."""

    def __init__(self, store: Any, directory: str, add_file: Callable[[str, str], Any],
                 max_bytes: int = MAX_ENGINE_BYTES,
                 builder_key: Optional[Callable[[str], Optional[Tuple[bytes, Any]]]] = None,
                 designated: Optional[Callable[[str], bool]] = None) -> None:
        self.store = store
        self.directory = os.path.abspath(directory)
        self.add_file = add_file
        self.max_bytes = int(max_bytes)
        self.builder_key = builder_key or (lambda device: None)
        self.designated = designated or (lambda device: True)
        self._uses: Dict[str, int] = {}  # token -> uploads taken (at most MAX_OFFERS)
        self._tokens: Dict[str, Tuple[str, str, str]] = {}  # token -> rollout, device, job
        self._arrived: List[Tuple[str, str, Dict[str, Any]]] = []
        self._lock = threading.Lock()
        self.received = 0
        self.refused = 0
        self._logged = -LOG_EVERY_S

    def token(self, rollout_id: str, device: str, job_id: str = "") -> str:
        with self._lock:
            for tok, owner in self._tokens.items():  # a document sent again: the same URL
                if owner[:2] == (rollout_id, device):
                    return tok
            tok = secrets.token_hex(16)
            self._tokens[tok] = (rollout_id, device, job_id or rollout_id)
        return tok

    def revoke(self, rollout_id: str) -> None:
        """The rollout ended (finished, cancelled, timed out): its upload URLs die with it."""
        with self._lock:
            for tok in [t for t, o in self._tokens.items() if o[0] == rollout_id]:
                del self._tokens[tok]
                self._uses.pop(tok, None)

    def expects(self, token: str) -> bool:
        with self._lock:
            return token in self._tokens

    def _refuse(self, status: int, why: str) -> Tuple[int, str]:
        self.refused += 1
        # Logged at most once every LOG_EVERY_S (a hostile client's refusals do not fill the
        # log); the count says how many were not.
        now = time.monotonic()
        if now - self._logged >= LOG_EVERY_S:
            log.warning("engine upload refused (%d): %s (%d refused in all)", status, why,
                        self.refused)
            self._logged = now
        return status, "[upload_refused] " + why

    def receive(self, token: str, body: Any, length: int,
                headers: Optional[Mapping[str, str]] = None) -> Tuple[int, str]:
        """The PUT of a builder's engine: (HTTP status, message). Checked in this order,
        none of it using the token up: the token, the size, the builder's signature over
        the claimed sha256 and size, the container's magic; then the body is hashed as it is
        written and must be what was signed."""
        from agent.wire import device_identity

        headers = headers or {}
        with self._lock:
            owner = self._tokens.get(token)
        if owner is None:
            return self._refuse(404, "no such share upload (unknown, used, or its rollout "
                                     "ended)")
        rollout_id, device, job_id = owner
        if not self.designated(device):
            return self._refuse(403, "expected an engine from a designated builder (fleet "
                                     "serve --builders, or the label role=builder), found one "
                                     "from {}, which is not".format(device))
        if length <= 0 or length > self.max_bytes:
            return self._refuse(413, "an engine of 1 to {} bytes is expected, found {}".format(
                self.max_bytes, length))
        claimed = str(headers.get("X-Content-Sha256") or "").lower()
        pinned = self.builder_key(device)
        if pinned is None:
            return self._refuse(403, "builder {} has no pinned key: its engines are not "
                                     "taken".format(device))
        raw, engine_class = pinned
        statement = device_identity.engine_statement(device, job_id, claimed, length,
                                                     engine_class)
        sig = str(headers.get("X-Engine-Signature") or "")
        if len(claimed) != 64 or not device_identity.verify_engine(raw, statement, sig):
            return self._refuse(403, "expected the engine signed by builder {} (X-Engine-"
                                     "Signature over its sha256 and size), found {}".format(
                                         device, "no signature" if not sig else
                                         "a signature that does not verify"))
        head = body.read(len(MAGIC))
        if head != MAGIC:
            return self._refuse(400, "expected a shared-engine container ({!r}), found {!r}"
                                .format(MAGIC.strip(), head[:16]))
        os.makedirs(os.path.join(self.directory, "tmp"), exist_ok=True)
        tmp = os.path.join(self.directory, "tmp", "share-" + token)
        digest = hashlib.sha256(head)
        left = length - len(head)
        try:
            with open(tmp, "wb") as out:
                out.write(head)
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
        sha = digest.hexdigest()
        if left or sha != claimed:
            os.unlink(tmp)
            return self._refuse(400, "the body ended {} bytes early".format(left) if left else
                                "the body's sha256 is {}, the builder signed {}".format(
                                    sha, claimed))
        with self._lock:
            if token not in self._tokens:  # revoked while it was written
                os.unlink(tmp)
                return self._refuse(404, "the rollout ended during the upload")
            # A second upload stays possible (a stolen key racing the builder must not use
            # its URL up): which one is the engine, the builder's signed report decides.
            self._uses[token] = self._uses.get(token, 0) + 1
            if self._uses[token] >= MAX_OFFERS:
                self._tokens.pop(token, None)
                self._uses.pop(token, None)
        ref = self._store(tmp, sha, length, device)
        ref["builder"] = {"device": device, "job_id": job_id, "sig": sig,
                          "public_key": base64.b64encode(raw).decode("ascii"),
                          "engine_class": engine_class}
        with self._lock:
            self._arrived.append((rollout_id, device, ref))
            self.received += 1
        log.info("engine %s (%d bytes) offered by %s for rollout %s (signed by its key)",
                 sha[:16], length, device, rollout_id)
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
            out.append((rid, device, {k: ref[k] for k in ("sha256", "size", "name", "blocks",
                                                          "builder")}))
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
    if controller.get("refused"):  # uploads its own signed report did not name
        out["refused"] = [{"sha256": str(r.get("sha256")), "why": str(r.get("why"))}
                          for r in controller["refused"] if isinstance(r, dict)]
    return out

