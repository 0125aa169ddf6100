"""The registry's blob store (agent.fleet.database.blobs, docs/fleet.md "The blob store"):
the seconds to push one blob of SIZE MiB (default 256, random bytes) through the service's
upload endpoint (``fleet models push --server``: a real HttpSource with the operator's token
over loopback; the body streamed to a temporary file in the store, hashed, fsynced, renamed)
against copying the same file straight into the store (``--db`` on the service's host,
``blobs.add_file``: the same hash, fsync and rename), and the seconds of the full hash the
service does before it first serves a blob. Medians of REPEAT runs (default 3).

    python scripts/lib/bench.py blob_store         (BLOB_STORE_MIB=256 BLOB_STORE_REPEAT=3)
"""

import http.client
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

MIB = int(os.environ.get("BLOB_STORE_MIB", "256"))
REPEAT = int(os.environ.get("BLOB_STORE_REPEAT", "3"))
TOKEN = "bench-operator-token-0123456789"


def _median(values):
    return sorted(values)[len(values) // 2]


def measure(mib=MIB, repeat=REPEAT):
    from agent.fleet.database import blobs
    from agent.fleet.database.store import Store
    from agent.fleet.deployments.uploads import Uploads
    from agent.fleet.transfer.http_source import HttpSource
    from agent.fsio import sha256_file

    work = tempfile.mkdtemp(prefix="blob-bench-")
    try:
        url = "sqlite:///" + os.path.join(work, "fleet.db")
        Store(url).close()
        src = os.path.join(work, "model.bin")
        with open(src, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
        sha = sha256_file(src)
        root = os.path.join(work, "store")
        http = HttpSource("127.0.0.1", 0, lambda: {}, uploads=Uploads(url, root, TOKEN)).start()
        upload, copy, hashed = [], [], []
        try:
            for _ in range(repeat):
                for kind in ("upload", "copy"):
                    path = blobs.path_of(root, sha)
                    if os.path.exists(path):
                        os.unlink(path)
                    began = time.monotonic()
                    if kind == "copy":
                        blobs.add_file(root, src, sha)
                        copy.append(time.monotonic() - began)
                        continue
                    conn = http_conn(http.port)
                    with open(src, "rb") as f:
                        conn.request("PUT", "/registry/blobs/" + sha, body=f, headers={
                            "Authorization": "Bearer " + TOKEN,
                            "Content-Length": str(mib << 20)})
                        resp = conn.getresponse()
                        resp.read()
                    conn.close()
                    if resp.status != 201:
                        raise RuntimeError("upload refused: {}".format(resp.status))
                    upload.append(time.monotonic() - began)
                began = time.monotonic()
                sha256_file(blobs.path_of(root, sha))
                hashed.append(time.monotonic() - began)
        finally:
            http.stop()
        return {"upload": _median(upload), "copy": _median(copy), "hash": _median(hashed)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def http_conn(port):
    return http.client.HTTPConnection("127.0.0.1", port, timeout=600)


def run():
    m = measure()
    return [{"name": "push of {} MiB through the service (HTTP, token)".format(MIB),
             "ours": m["upload"], "baseline": m["copy"], "unit": "s", "goal": "-"},
            {"name": "full hash before a blob is first served ({} MiB)".format(MIB),
             "ours": m["hash"], "baseline": None, "unit": "s", "goal": "-"}]


if __name__ == "__main__":
    for row in run():
        print("{name}: {ours:.2f} {unit} (baseline {baseline})".format(**row))
