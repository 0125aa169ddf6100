"""Where a streamed job document's cost goes in the service, step by step, in CPU time (not
wall time: the figures hold on a shared host): building it (the rollout's document factory:
schema check and size once per shape), signing it (the canonical manifest, then Ed25519),
sharing its parts, encoding it for MQTT, saving a batch of them (``Store.save_rollout``: the
jobs and outbox rows, SQLite), and the three signed job statuses each device answers with
(decoding and checking each signature).
MQTT publishing is left out (the paho client's cost: see fleet_stream's service CPU).

    python scripts/benchmarks/stream_per_doc.py      (PER_DOC_N=5000)
"""

import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

N = int(os.environ.get("PER_DOC_N", "5000"))


def _cpu(fn, n):
    t0 = time.process_time()
    out = fn()
    return out, (time.process_time() - t0) / n * 1e6


def measure(n=N):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from agent.fleet.database.store import Store
    from agent.fleet.rollouts.doc_parts import Parts
    from agent.fleet.rollouts.spec import doc_factory
    from agent.wire import device_identity, job_signer, protocol, signing, status_messages
    from agent.wire.topics import Topics

    topics = Topics()
    devices = ["sim-{:05d}".format(i) for i in range(n)]
    art = {"model": {"sha256": "ab" * 32, "size": 1234567, "name": "model.onnx"}}
    key = Ed25519PrivateKey.generate()
    kid = signing.key_id(job_signer.raw_public(key))
    now = time.time()
    row = {}
    # As the service builds them: the rollout's document factory (one full check per shape).
    factory = doc_factory({"precision": "fp16", "artifacts": art, "atol": 0.001, "rtol": 0.001,
                           "model_name": "det", "model_version": "3"})
    docs, row["build"] = _cpu(lambda: [factory(d, "job-stream", "deploy", None)
                                       for d in devices], n)
    _, row["manifest (canonical JSON)"] = _cpu(lambda: [signing.manifest(dict(
        d, signature={"alg": "ed25519", "key_id": kid, "seq": 1, "not_before": 1,
                      "expires": 2})) for d in docs], n)
    signed, row["sign (manifest + Ed25519)"] = _cpu(lambda: [job_signer.sign_document(
        d, key, 1 + i, now, now + 3600, kid=kid, shallow=True) for i, d in enumerate(docs)], n)
    parts = Parts()
    shared, row["share parts"] = _cpu(lambda: [parts.share(d) for d in signed], n)
    out, row["encode for MQTT"] = _cpu(lambda: [(topics.job(d["device"], d["job_id"]),
                                                protocol.encode(d), True) for d in shared], n)
    work = tempfile.mkdtemp(prefix="per-doc-")
    store = Store("sqlite:///" + os.path.join(work, "fleet.db"))
    store.insert_rollout("per-doc", {}, [devices], now + 3600)

    def save():
        for i in range(0, n, 500):  # the service's batches
            jobs = {d["device"]: (0, "QUEUED", {"job_id": d["job_id"], "docs": {}})
                    for d in shared[i:i + 500]}
            store.save_rollout("per-doc", {"state": "running"}, jobs, (), out[i:i + 500])
    _, row["save (SQLite: job rows + outbox)"] = _cpu(save, n)
    # The statuses: QUEUED, IN_PROGRESS, SUCCEEDED, each signed by its device.
    dkey = device_identity.DeviceKey(Ed25519PrivateKey.generate())
    raw = dkey.raw_public
    signer = device_identity.ReportSigner(dkey, "sim-00000", 1)
    msgs = []
    for i, state in enumerate(("QUEUED", "IN_PROGRESS", "SUCCEEDED") * (n // 3 + 1)):
        if len(msgs) >= 3 * n:
            break
        pub = status_messages.job_status_publication(topics, "sim-00000", {
            "job_id": "job-stream", "kind": "deploy", "state": state, "version": i + 1,
            "updated": now, "stage": None, "result": None})
        msgs.append((pub.topic, pub.payload, signer.properties(pub.topic, pub.payload)))
    _, row["3 statuses: decode"] = _cpu(lambda: [protocol.decode("job_status", p)
                                                 for _t, p, _u in msgs], n)
    _, row["3 statuses: check signatures"] = _cpu(lambda: [device_identity.verify_report(
        raw, "sim-00000", t, p, u) for t, p, u in msgs], n)
    store.close()
    row["total"] = sum(v for k, v in row.items() if k != "manifest (canonical JSON)")
    return {k: round(v, 1) for k, v in row.items()}


if __name__ == "__main__":
    import json

    print(json.dumps(measure(), indent=1))
