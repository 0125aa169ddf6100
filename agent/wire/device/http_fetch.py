"""Device side: fetch an artifact over HTTP(S) with Range requests, into the same transfer
(and bitmap) the MQTT block path uses, so either resumes what the other received.

A thread per artifact asks for the missing blocks a run of up to RUN_BLOCKS at a time,
checks each block against the signed per-block hashes (when the job carries them) and writes
it through ``BlockFetcher.on_block``. The artifact's last block goes through the daemon's own
event queue (``fetcher.inject``) so that completion is handled on its main loop like any
block. Any failure (unreachable, a wrong length, junk) hands the artifact back to MQTT blocks.

An ``https://`` URL is verified with the fetcher's ``http_ca_file`` (the daemon's
``transfer.http_ca_file``, else ``broker.tls.ca_file``, else the system's CAs): a server whose
certificate does not verify is refused (``server_untrusted`` in the log, with the CA file and
what to check) and the artifact comes over MQTT blocks.
"""

import hashlib
import http.client
import logging
import random
import ssl
import time
import urllib.error
import urllib.request
from typing import Any, Optional

from agent.errors import AgentError
from agent.wire import protocol

log = logging.getLogger("agent.wire.device.transfer")
RUN_BLOCKS = 64
TIMEOUT_S = 30.0
MAX_BAD_BLOCKS = 16
# A busy server (503: its connections from this address are all taken, as when many devices
# share one NAT address; under HTTPS the connection is only closed) is asked again this many
# times, Retry-After apart (1..5 s, with jitter), before the blocks come over MQTT instead.
BUSY_TRIES = 12


def tls_context(url: str, ca_file: Optional[str]) -> Optional[ssl.SSLContext]:
    """The client context an ``https://`` URL is fetched with (None for ``http://``)."""
    if not url.startswith("https://"):
        return None
    return ssl.create_default_context(cafile=ca_file)


def untrusted(exc: BaseException) -> bool:
    """Whether ``exc`` (maybe a URLError around it) is a server certificate that did not
    verify (an unknown CA, an expired certificate, another host name)."""
    reason = getattr(exc, "reason", exc)
    return isinstance(reason, ssl.CertificateError) or (
        isinstance(reason, ssl.SSLError) and "CERTIFICATE_VERIFY_FAILED" in str(reason))


def untrusted_message(url: str, ca_file: Optional[str], exc: BaseException) -> str:
    return ("[server_untrusted] the HTTPS server of {} presented a certificate that does not "
            "verify with {}: {} (expected a certificate signed by that CA for this host: set "
            "transfer.http_ca_file, or broker.tls.ca_file, to the CA of the fleet service's "
            "--http-tls-cert)".format(url, "CA file " + ca_file if ca_file else
                                      "the system's CAs (no transfer.http_ca_file or "
                                      "broker.tls.ca_file)", getattr(exc, "reason", exc)))


def _get_range(url: str, start: int, end: int, size: int,
               context: Optional[ssl.SSLContext] = None) -> bytes:
    req = urllib.request.Request(url, headers={"Range": "bytes={}-{}".format(start, end),
                                               "User-Agent": "jetson-agent"})
    want = end - start + 1
    with urllib.request.urlopen(req, timeout=TIMEOUT_S,  # noqa: S310 - http(s) only
                                context=context) as resp:
        status = resp.status
        if status != 206 and not (status == 200 and start == 0 and want == size):
            raise ValueError("expected 206 Partial Content for bytes {}-{}, found {}".format(
                start, end, status))
        data = resp.read(want + 1)
    if len(data) != want:
        raise ValueError("expected {} bytes for bytes {}-{}, found {}".format(
            want, start, end, len(data)))
    return data


def run(fetcher: Any, sha256: str, fetch: Any, url: str) -> None:
    """The body of one artifact's HTTP thread."""
    ca_file = getattr(fetcher, "http_ca_file", None)
    try:
        _run(fetcher, sha256, fetch, url, tls_context(url, ca_file))
    except (OSError, ValueError, AgentError, urllib.error.URLError) as exc:
        if untrusted(exc):
            log.warning("HTTPS fetch of artifact %s refused: %s; fetching its blocks over MQTT",
                        sha256, untrusted_message(url, ca_file, exc))
            fetcher._http_failed(sha256, fetch)
            return
        log.warning("HTTP fetch of artifact %s from %s failed (%s); fetching its blocks over "
                    "MQTT", sha256, url, exc)
        fetcher._http_failed(sha256, fetch)


def _run(fetcher: Any, sha256: str, fetch: Any, url: str,
         context: Optional[ssl.SSLContext] = None) -> None:
    transfer = fetch.transfer
    bs, size = transfer.block_size, transfer.size
    while True:
        with fetcher._lock:
            if fetcher._fetches.get(sha256) is not fetch or not fetch.http:
                return  # cancelled, completed, or handed to MQTT
            missing = transfer.missing_indices(RUN_BLOCKS)
        if not missing:
            return
        if fetch.bad_blocks == 0 and transfer.received() == 0:
            log.info("fetching artifact %s over HTTP from %s", sha256, url)
        first = last = missing[0]
        for i in missing[1:]:
            if i != last + 1:
                break
            last = i
        data = _busy_retry(fetcher, sha256, fetch, _get_range, url, first * bs,
                           min(size, (last + 1) * bs) - 1, size, context)
        if data is None:
            return  # cancelled or completed while waiting
        for i in range(first, last + 1):
            off = (i - first) * bs
            block = data[off:off + protocol.block_length(size, bs, i)]
            digests = fetch.digests
            if digests is not None and hashlib.sha256(block).digest() != \
                    digests[32 * i:32 * i + 32]:
                fetch.bad_blocks += 1
                if fetch.bad_blocks > MAX_BAD_BLOCKS:
                    raise ValueError("{} blocks did not match their hashes".format(
                        fetch.bad_blocks))
                continue
            with fetcher._lock:
                final = transfer.received() == transfer.blocks - 1 and \
                    not transfer.has_block(i)
            if final and fetcher.inject is not None:
                # Completion belongs to the daemon's loop: hand it the last block (MQTT takes
                # over again should it be lost on the way).
                with fetcher._lock:
                    fetch.http = False
                    fetch.injected = i  # not a block from the broker (transfer.BlockFetcher)
                fetcher.inject(fetcher._topics.block(fetcher.device, sha256, i), block)
                return
            path = fetcher.on_block(sha256, i, block)
            if path is not None:
                fetcher.http_completed.append((sha256, path))
                return


def _busy(exc: BaseException) -> Optional[float]:
    """Seconds to wait when ``exc`` says the server is busy, else None."""
    if isinstance(exc, urllib.error.HTTPError) and exc.code == 503:
        try:
            return min(5.0, max(1.0, float(exc.headers.get("Retry-After") or 1)))
        except ValueError:
            return 1.0
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, (ConnectionResetError, http.client.RemoteDisconnected,
                           ssl.SSLEOFError)) or isinstance(exc, (
                               ConnectionResetError, http.client.RemoteDisconnected,
                               ssl.SSLEOFError)):
        return 1.0  # an HTTPS server closes a connection past its bounds without an answer
    return None


def _busy_retry(fetcher: Any, sha256: str, fetch: Any, get: Any, *args: Any
                ) -> Optional[bytes]:
    """``get(*args)``, asked again while the server is busy (see BUSY_TRIES); None when the
    fetch was cancelled or handed over meanwhile."""
    for attempt in range(BUSY_TRIES + 1):
        try:
            return bytes(get(*args))
        except (OSError, urllib.error.URLError, http.client.HTTPException) as exc:
            wait = _busy(exc)
            if wait is None or attempt == BUSY_TRIES:
                raise
            log.info("HTTP server busy for artifact %s (%s): asking again in %.1f s", sha256,
                     exc, wait)
            time.sleep(wait * (1.0 + random.random() / 2))  # noqa: S311 - jitter only
            with fetcher._lock:
                if fetcher._fetches.get(sha256) is not fetch or not fetch.http:
                    return None
    return None
