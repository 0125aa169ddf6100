"""``fleet models push|ls|show|rm|verify``: the model registry in the fleet database
(agent.fleet.deployments.registry), as data: a version recorded straight into the store the
database names, or uploaded to a service's registry endpoint (``--server``); one version with
its blobs and users; the blob store verified.
"""

import json
import os
from typing import Any, Dict, Optional, Tuple

from agent.errors import AgentError
from agent.fleet.database import blobs
from agent.fleet.database.store import Store
from agent.fleet.deployments import registry


def push_local(url: str, store_dir: Optional[str], name: str, version: str,
               record: Dict[str, Any], files: Dict[str, str]) -> bool:
    """Straight into the store the database names (on the service's host); whether the
    version was added (False: already stored, identical)."""
    store = Store(url)
    try:
        root = blobs.directory(store, store_dir, record=True)
        return bool(registry.push(store, root, name, version, record, files))
    finally:
        store.close()


def push_http(server: str, token_file: Optional[str], ca_file: Optional[str], name: str,
              version: str, record: Dict[str, Any], files: Dict[str, str]) -> bool:
    """Upload the version's blobs (those the service lacks) and then its record to the
    service's registry endpoint (agent.fleet.deployments.uploads)."""
    import http.client
    import ssl
    from urllib.parse import urlsplit

    from agent.fleet import web

    if not token_file:
        raise AgentError("bad_argument", "fleet models push --server: expected --token-file "
                         "(the operator's token), found none")
    token = web.read_token(token_file) or ""
    url = urlsplit(server)
    if url.scheme not in ("http", "https") or not url.hostname:
        raise AgentError("bad_argument", "--server: expected http[s]://HOST:PORT, found "
                         "{!r}".format(server[:200]))

    def request(method: str, path: str, body: Any = None, length: int = 0,
                ctype: str = "application/octet-stream") -> Tuple[int, Dict[str, Any]]:
        if url.scheme == "https":
            ctx = ssl.create_default_context(cafile=ca_file)
            conn: Any = http.client.HTTPSConnection(url.hostname or "", url.port or 443,
                                                    timeout=120, context=ctx)
        else:
            conn = http.client.HTTPConnection(url.hostname or "", url.port or 80, timeout=120)
        try:
            headers = {"Authorization": "Bearer " + token, "Content-Type": ctype}
            if method != "HEAD":
                headers["Content-Length"] = str(length)
            conn.request(method, url.path.rstrip("/") + path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read(1 << 20)
        except (OSError, http.client.HTTPException) as exc:
            raise AgentError("upload_refused", "--server {}: expected the service's HTTP "
                             "endpoint, {} {} failed: {}".format(server, method, path, exc))
        finally:
            conn.close()
        try:
            doc = json.loads(data.decode("utf-8")) if data else {}
        except ValueError:
            doc = {}
        if resp.status >= 400 and method != "HEAD":
            err = (doc.get("error") if isinstance(doc, dict) else None) or {}
            code = str(err.get("code") or "bad_argument")
            from agent.errors import CODES

            raise AgentError(code if code in CODES else "bad_argument", "--server {}: {} {}: "
                             "{} {}".format(server, method, path, resp.status,
                                            err.get("message") or resp.reason))
        return resp.status, doc if isinstance(doc, dict) else {}

    for role, (sha, _size) in sorted(blobs.refs_of(record).items()):
        status, _doc = request("HEAD", "/registry/blobs/" + sha)
        if status == 200:
            continue  # the service has it, sound
        if status in (401, 403):
            request("PUT", "/registry/blobs/" + sha, b"", 0)  # raises with the reason
        with open(files[role], "rb") as f:
            request("PUT", "/registry/blobs/" + sha, f, os.fstat(f.fileno()).st_size)
    body = json.dumps({"name": name, "version": version, "record": record}).encode("utf-8")
    _status, doc = request("POST", "/registry/models", body, len(body), "application/json")
    return bool(doc.get("added"))


def verify(url: str, store_dir: Optional[str]) -> Dict[str, Any]:
    """``fleet models verify``: {store, blobs, references, problems}."""
    store = Store(url)
    try:
        root = blobs.directory(store, store_dir)
        problems = blobs.verify(store, root)
        counts = blobs.refcounts(store)
        n = len(blobs.rows(store))
    finally:
        store.close()
    return {"store": root, "blobs": n, "references": sum(counts.values()),
            "problems": problems}


def show(store: Store, name: str, version: str) -> Dict[str, Any]:
    """``fleet models show NAME@VERSION``: the version with ``used_by`` and its ``blobs``
    (sha256, how many versions use it, its problem)."""
    v = registry.get(store, name, version)
    v["used_by"] = registry.usage(store, name, version)
    known = blobs.rows(store, [sha for sha, _n in blobs.refs_of(v).values()])
    v["blobs"] = {role: {"sha256": sha, "versions": len(blobs.users(store, sha)),
                         "problem": (known.get(sha) or {"problem": "not in the store"}
                                     )["problem"]}
                  for role, (sha, _n) in blobs.refs_of(v).items()}
    return dict(v)
