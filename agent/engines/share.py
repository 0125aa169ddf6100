"""Fleet engine sharing, device side (docs/fleet.md, "Engine sharing"): the shared-engine
container, offering one to the fleet service, and adopting one a job document carries.

A device that built an engine offers it as a *container*: ``MAGIC``, one line of JSON (the
engine cache key it was built under, the cache entry's info: plan, build result, fingerprints;
the offering device; the sizes of the parts), the engine bytes and, for a plan that
calibrates, the calibration cache the build wrote (part of the engine cache key: a device
installs it before computing its key, so INT8 engines are shared too). The engine cache key
is the share key: it hashes the model, the plan (precision, layer precisions, DLA core, ...),
the calibration inputs, the backend and its version (TensorRT) and the platform fingerprint
(compute capability, CUDA, cuDNN: the JetPack), so two devices compute the same key exactly
when one's engine is valid on the other. TensorRT's timing cache is not carried: an adopted
engine needs no build, and a fallback build should not take tactic timings from the fleet.
The small files a backend keeps beside an engine travel in the header (``sidecars``): the DLA
core a DLA engine was built for (``.dla-core``; without it the adopter's runtime would open the
engine on its default core) and the platform it was built on (``.platform.json``: TensorRT,
GPU, SM count, CUDA, DLA core). The adopter writes them beside the engine before opening it,
so ``backend.open`` refuses an engine of another platform by name (and a DLA core the device
lacks), and stores them in its cache entry with the engine.

A container reaches another device only as the ``engine`` artifact of a controller-signed job
document (its sha256 and per-block hashes are signed, and checked by the artifact store),
with its builder's signature over {device, job_id, sha256, size, engine_class} and the
builder's public key (``builder``: the daemon verifies it and the class before the worker
sees the container; docs/security.md, "A shared engine's trust chain"). The worker adopts it
only if the job has goldens, its key equals the key it computed itself, the engine
deserializes (``backend.open``) and the job's full gate passes on every golden; anything else
and it builds as before, saying why in the result's ``share`` field. The builder signs its
offer through the daemon's interpreter (the key never enters the worker). An ``https://``
upload URL is verified with the CA the daemon gives in the job spec (``share.ca_file``: its
``transfer.http_ca_file`` or ``broker.tls.ca_file``); a server that does not verify gets
nothing (``server_untrusted`` in the result's reason). Worker side: Python >= 3.6.
"""

import json
import logging
import os
import shutil
import ssl
import subprocess
import tempfile
from typing import Any, Dict, List, Optional, Tuple

from agent.errors import AgentError

log = logging.getLogger(__name__)

MAGIC = b"JAENGINE1\n"
MAX_HEADER = 256 * 1024
# Files kept beside an engine (``<engine><suffix>``) that travel with it.
SIDECARS = (".dla-core", ".platform.json", ".plugins.json")
MAX_SIDECAR = 16 * 1024


def read_sidecars(engine_path: str) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for suffix in SIDECARS:
        try:
            with open(engine_path + suffix, "rb") as f:
                out[suffix] = f.read(MAX_SIDECAR).decode("utf-8", "replace")
        except OSError:
            continue
    return out


def write_sidecars(engine_path: str, sidecars: Any) -> None:
    """Write the header's sidecars beside ``engine_path`` (known names only, bounded)."""
    if not isinstance(sidecars, dict):
        return
    for suffix, text in sorted(sidecars.items()):
        if suffix in SIDECARS and isinstance(text, str) and len(text) <= MAX_SIDECAR:
            with open(engine_path + suffix, "wb") as f:
                f.write(text.encode("utf-8"))
QUICK_CHECK_INPUTS = 8
OFFER_TIMEOUT_S = 300.0


def write_container(out_path: str, engine_key: str, engine_path: str,
                    info: Dict[str, Any], device: str,
                    calibration_cache: Optional[str] = None) -> None:
    calib = calibration_cache if calibration_cache and os.path.isfile(calibration_cache) \
        else None
    header = json.dumps({"engine_key": engine_key, "info": info, "device": device,
                         "sidecars": read_sidecars(engine_path),
                         "engine_size": os.path.getsize(engine_path),
                         "calibration_size": os.path.getsize(calib) if calib else 0},
                        sort_keys=True, default=str).encode("utf-8")
    if len(header) > MAX_HEADER:
        raise AgentError("bad_argument", "engine info is {} bytes; a shared engine's header "
                         "holds at most {}".format(len(header), MAX_HEADER))
    tmp = out_path + ".tmp"
    with open(tmp, "wb") as out:
        out.write(MAGIC + header + b"\n")
        for part in (engine_path, calib):
            if part:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 20)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, out_path)


def read_header(path: str) -> Dict[str, Any]:
    """The container's header; AgentError shared_engine_rejected when it is not one."""
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise AgentError("shared_engine_rejected", "{} is not a shared engine (expected "
                             "the {!r} header)".format(os.path.basename(path), MAGIC.strip()))
        line = f.readline(MAX_HEADER + 1)
    if len(line) > MAX_HEADER or not line.endswith(b"\n"):
        raise AgentError("shared_engine_rejected", "shared engine header longer than {} "
                         "bytes".format(MAX_HEADER))
    try:
        header = json.loads(line.decode("utf-8"))
    except ValueError as exc:
        raise AgentError("shared_engine_rejected", "shared engine header is not JSON: {}"
                         .format(exc))
    if not isinstance(header, dict) or not isinstance(header.get("engine_key"), str):
        raise AgentError("shared_engine_rejected", "shared engine header has no engine_key")
    sizes = [header.get("engine_size"), header.get("calibration_size")]
    body = os.path.getsize(path) - len(MAGIC) - len(line)
    if not all(isinstance(n, int) and n >= 0 for n in sizes) or \
            sum(int(n or 0) for n in sizes) != body:
        raise AgentError("shared_engine_rejected", "shared engine parts of {} bytes expected "
                         "(engine_size + calibration_size), found {}".format(sizes, body))
    return header


def _copy_part(path: str, offset: int, size: int, out_path: str) -> None:
    with open(path, "rb") as f, open(out_path, "wb") as out:
        f.seek(offset)
        left = size
        while left > 0:
            data = f.read(min(1 << 20, left))
            if not data:
                break
            out.write(data)
            left -= len(data)


def _body_offset(path: str) -> int:
    with open(path, "rb") as f:
        f.read(len(MAGIC))
        return len(MAGIC) + len(f.readline(MAX_HEADER + 1))


def install_calibration(container: str, cache_path: Optional[str]) -> Optional[str]:
    """Write the container's calibration cache to ``cache_path`` (the plan's calibration
    cache, which enters the engine cache key) when this device has none yet: the path written,
    to be removed again if the engine is not adopted; None when nothing was written."""
    if not cache_path or os.path.exists(cache_path):
        return None
    try:
        header = read_header(container)
    except (AgentError, OSError):
        return None
    size = int(header.get("calibration_size") or 0)
    if not size:
        return None
    os.makedirs(os.path.dirname(os.path.abspath(cache_path)), exist_ok=True)
    tmp = cache_path + ".shared.tmp"
    _copy_part(container, _body_offset(container) + int(header["engine_size"]), size, tmp)
    os.replace(tmp, cache_path)
    return cache_path


def _extract(path: str, out_path: str) -> None:
    header = read_header(path)
    _copy_part(path, _body_offset(path), int(header["engine_size"]), out_path)


def adopt(container: str, key: str, cache: Any, backend: Any) -> Tuple[Optional[Any], str]:
    """Put the shared engine into ``cache`` under ``key`` if it is this device's engine and
    deserializes: (the cache entry, "") or (None, why not: the caller builds). The caller
    holds the key's build lock."""
    try:
        header = read_header(container)
    except (AgentError, OSError) as exc:
        return None, str(getattr(exc, "message", exc))
    if header["engine_key"] != key:
        return None, ("the shared engine was built as {}, this device needs {} (another plan "
                      "or platform)".format(header["engine_key"][:16], key[:16]))
    tmpdir = tempfile.mkdtemp(prefix="shared-", dir=os.path.dirname(os.path.abspath(container)))
    try:
        engine = os.path.join(tmpdir, "engine")
        _extract(container, engine)
        write_sidecars(engine, header.get("sidecars"))
        try:
            with backend.open(engine):
                pass  # deserializes on the recorded DLA core, after the platform check
        except Exception as exc:  # noqa: BLE001 - any failure means: build it here
            code = getattr(exc, "code", None)
            return None, "the shared engine does not load here: {}{}".format(
                "[{}] ".format(code) if code else "", str(exc)[:300])
        info = dict(header.get("info") or {})
        info["shared_from"] = str(header.get("device") or "")[:64]
        with cache.staging(key) as stage:
            shutil.copyfile(engine, stage.engine_path)  # maybe another file system
            write_sidecars(stage.engine_path, header.get("sidecars"))
            entry = cache.publish(stage, info)
    except (AgentError, OSError) as exc:
        return None, "the shared engine could not be stored: {}".format(
            str(getattr(exc, "message", exc))[:200])
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
    log.info("engine %s taken from the fleet (built by %s)", key[:16], info["shared_from"])
    return entry, ""


def _untrusted(exc: BaseException) -> bool:
    """A server certificate that did not verify (maybe inside a URLError); Python 3.6 has no
    SSLCertVerificationError."""
    reason = getattr(exc, "reason", exc)
    return isinstance(reason, ssl.CertificateError) or (
        isinstance(reason, ssl.SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(reason))


def offer(url: str, engine_key: str, engine_path: str, info: Dict[str, Any], device: str,
          work_dir: str, calibration_cache: Optional[str] = None,
          timeout: float = OFFER_TIMEOUT_S, signer: Optional[List[str]] = None,
          job_id: str = "", engine_class: Any = None,
          ca_file: Optional[str] = None) -> Dict[str, Any]:
    """Upload this device's engine to the fleet service (HTTP PUT of the container to the
    upload ``url`` its job document gave), signed with the device key: ``signer`` is the
    command (the daemon's interpreter, ``agent.wire.device_identity sign-engine KEY``) that
    signs the statement {device, job_id, sha256, size, engine_class} given on its stdin; the
    service stores only the engine that statement names. ``ca_file``: the CA an ``https://``
    ``url`` is verified with (None: the system's CAs). What the job result says about it.
    Never fails the job: an offer that does not arrive only means the others build."""
    from urllib.request import Request, urlopen

    from agent.fsio import sha256_file

    path = os.path.join(work_dir, "engine.share")
    try:
        if not signer:
            raise AgentError("upload_refused", "no device key to sign the engine with "
                             "(security.device_key): a fleet takes only signed engines")
        write_container(path, engine_key, engine_path, info, device, calibration_cache)
        sha = sha256_file(path)
        size = os.path.getsize(path)
        statement = {"device": device, "job_id": job_id, "sha256": sha, "size": size,
                     "engine_class": engine_class}
        signed = subprocess.run(  # noqa: UP022 - capture_output is 3.7+; the worker is 3.6
            list(signer), input=json.dumps(statement).encode("utf-8"), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, timeout=60)
        if signed.returncode != 0:
            raise AgentError("upload_refused", "signing the engine failed: {}".format(
                signed.stderr.decode("utf-8", "replace").strip()[:200]))
        with open(path, "rb") as body:
            req = Request(url, data=body, method="PUT", headers={
                "Content-Length": str(size), "Content-Type": "application/octet-stream",
                "X-Content-Sha256": sha,
                "X-Engine-Signature": signed.stdout.decode("ascii").strip()})
            context = ssl.create_default_context(cafile=ca_file) \
                if url.startswith("https://") else None
            with urlopen(req, timeout=timeout,  # noqa: S310 - url is signed
                         context=context) as resp:
                resp.read(4096)
        return {"offered": True, "sha256": sha, "size": size}
    except Exception as exc:  # noqa: BLE001 - the job succeeded anyway
        if _untrusted(exc):
            reason = ("[server_untrusted] the fleet service's HTTPS certificate does not verify "
                      "with {}: {} (set transfer.http_ca_file, or broker.tls.ca_file, to the CA "
                      "of its --http-tls-cert)".format(
                          "CA file " + ca_file if ca_file else "the system's CAs",
                          getattr(exc, "reason", exc)))
            log.warning("engine %s not offered to the fleet: %s", engine_key[:16], reason)
            return {"offered": False, "code": "server_untrusted",
                    "reason": "offer failed: {}".format(reason[:400])}
        log.warning("engine %s not offered to the fleet: %s", engine_key[:16], exc)
        return {"offered": False, "reason": "offer failed: {}".format(str(exc)[:200])}
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
