"""``fleet models push --server URL``'s other end: the registry's upload endpoint on the
service's HTTP(S) server (``fleet serve --http``, agent.fleet.transfer.http_source), so an
operator pushes from a laptop into the store the service owns.

- ``HEAD /registry/blobs/<sha256>``: 200 when the blob is in the store and sound (the client
  skips its upload), else 404;
- ``PUT /registry/blobs/<sha256>``: the bytes, streamed to a temporary file in the store,
  hashed, fsynced and renamed (at most ``MAX_BLOB_BYTES``);
- ``POST /registry/models``: ``{"name", "version", "record"}`` (the version, at most
  ``MAX_RECORD_BYTES``), stored once every blob it names is in the store.

Every request carries ``Authorization: Bearer TOKEN``, the operator's token
(``--dashboard-token-file``), compared in constant time; without a configured token the
endpoint refuses everything (403). Answers are JSON: ``{"ok": ...}`` or ``{"error": {code,
message}}``. Each request opens its own database connection (one thread per request).
"""

import hmac
import json
import logging
import re
from typing import IO, Any, Dict, Mapping, Optional, Tuple

from agent.errors import AgentError
from agent.fleet.database import blobs
from agent.wire import model_names

log = logging.getLogger("agent.fleet")

MAX_BLOB_BYTES = blobs.MAX_BLOB_BYTES
MAX_RECORD_BYTES = 1 << 20
MAX_ROLES = 32  # files per version (model, calibration, goldens, labels and their lists)

_ROLE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
Reply = Tuple[int, Dict[str, Any]]


def _error(status: int, code: str, message: str) -> Reply:
    return status, {"error": {"code": code, "message": message}}


class Uploads(object):
    def __init__(self, store_url: str, root: str, token: Optional[str]) -> None:
        self.store_url = store_url
        self.root = root
        self.token = token or None

    def refused(self, headers: Mapping[str, str]) -> Optional[Reply]:
        """None when the request carries the operator's token; else the answer to give."""
        if self.token is None:
            return _error(403, "unauthorized", "this service takes no pushes: start fleet "
                          "serve with --dashboard-token-file (the operator's token)")
        given = str(headers.get("Authorization") or "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                value.strip().encode("utf-8"), self.token.encode("utf-8")):
            return _error(401, "unauthorized", "expected Authorization: Bearer with the "
                          "service's operator token (--dashboard-token-file), found {}".format(
                              "none" if not given else "another token"))
        return None

    def _store(self) -> Any:
        from agent.fleet.database.store import Store

        return Store(self.store_url)

    def has_blob(self, sha256: str) -> bool:
        store = self._store()
        try:
            row = blobs.rows(store, [sha256]).get(sha256)
            return row is not None and blobs.check(store, self.root, row) is None
        finally:
            store.close()

    def put_blob(self, sha256: str, body: IO[bytes], length: int) -> Reply:
        if length > MAX_BLOB_BYTES:
            return _error(413, "blob_too_large", "a blob is at most {} bytes, found "
                          "Content-Length {}".format(MAX_BLOB_BYTES, length))
        try:
            blobs.receive(self.root, body, length, sha256)
        except AgentError as exc:
            return _error(400, exc.code, exc.message)
        log.info("registry: blob %s received (%d bytes)", sha256[:16], length)
        return 201, {"ok": True, "sha256": sha256, "size": length}

    def put_version(self, body: IO[bytes], length: int) -> Reply:
        if length > MAX_RECORD_BYTES:
            return _error(413, "bad_argument", "a version's record is at most {} bytes, found "
                          "Content-Length {}".format(MAX_RECORD_BYTES, length))
        try:
            doc = json.loads(body.read(length).decode("utf-8"))
            if not isinstance(doc, dict) or not isinstance(doc.get("record"), dict):
                raise ValueError("expected an object with name, version and record")
            name = model_names.validate_name(str(doc.get("name")))
            version = model_names.validate_version(str(doc.get("version")))
            record = check_record(doc["record"])
        except AgentError as exc:
            return _error(400, exc.code, exc.message)
        except ValueError as exc:
            return _error(400, "bad_argument", "the version's record: {}".format(exc))
        from agent.fleet.deployments import registry

        store = self._store()
        try:
            added = registry.push(store, self.root, name, version, record)
        except AgentError as exc:
            return _error(409 if exc.code == "model_version_exists" else 400, exc.code,
                          exc.message)
        finally:
            store.close()
        log.info("registry: %s@%s %s through the upload endpoint", name, version,
                 "stored" if added else "already stored")
        return 201 if added else 200, {"ok": True, "name": name, "version": version,
                                       "added": added}


def check_record(record: Mapping[str, Any]) -> Dict[str, Any]:
    """A version's record as a client sent it, bounded: artifacts (role -> sha256, size, name,
    blocks), defaults, notes, source."""
    from agent.wire import protocol

    arts = record.get("artifacts")
    if not isinstance(arts, dict) or "model" not in arts or len(arts) > MAX_ROLES:
        raise ValueError("expected artifacts with a model (at most {} roles)".format(MAX_ROLES))
    for role, ref in arts.items():
        if not _ROLE.match(str(role)):
            raise ValueError("expected a role of at most 64 letters, digits, '_', '.', '-', "
                             "found {!r}".format(str(role)[:80]))
        if not isinstance(ref, dict) or not protocol.valid_sha256(ref.get("sha256")) or \
                not isinstance(ref.get("size"), int) or not 0 <= ref["size"] <= MAX_BLOB_BYTES:
            raise ValueError("artifact {!r}: expected sha256 (64 hex digits) and a size".format(
                str(role)[:40]))
        blocks = ref.get("blocks")
        if blocks is not None and (not isinstance(blocks, dict) or not protocol.valid_sha256(
                blocks.get("sha256")) or not isinstance(blocks.get("block_size"), int) or
                blocks["block_size"] < 1):
            raise ValueError("artifact {!r}: bad blocks".format(str(role)[:40]))
    if not isinstance(record.get("defaults") or {}, dict):
        raise ValueError("defaults: expected an object")
    return {"artifacts": arts, "defaults": dict(record.get("defaults") or {}),
            "notes": str(record.get("notes") or "")[:4096],
            "source": str(record.get("source") or "")[:255]}
