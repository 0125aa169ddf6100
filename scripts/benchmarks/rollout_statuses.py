"""A job status through the rollout (``Rollout.on_job_status``: the answer guards, then its
row of the transition table, agent.fleet.rollouts.transitions), in CPU time (not wall time: the
figure holds on a shared host): one stage of ``ROLLOUT_STATUSES_N`` devices, each answering
IN_PROGRESS then SUCCEEDED, statuses batched as the service feeds them (``evaluate=False``);
the best of 9 rounds. Only public names the parent revisions have too: run it with an older
tree on PYTHONPATH to measure the code before a change.

    python scripts/benchmarks/rollout_statuses.py      (ROLLOUT_STATUSES_N=10000)
"""

import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # (after PYTHONPATH: an older tree there is the one measured)

N = int(os.environ.get("ROLLOUT_STATUSES_N", "10000"))


def _docs(device, job_id, kind, layers, **_):
    return {"job_id": job_id, "device": device, "kind": kind, "plan": {"precision": "int8"}}


def _round(n):
    from agent import fleet

    devices = ["d{:05d}".format(i) for i in range(n)]
    ro = fleet.Rollout("ro-1", [devices], _docs)
    ro.first_batch = n
    ro.start()
    msgs = [(d, {"job_id": "ro-1", "device": d, "kind": "deploy", "state": state,
                 "version": version, "stage": "building", "result": {}})
            for version, state in ((2, "IN_PROGRESS"), (3, "SUCCEEDED")) for d in devices]
    t0 = time.process_time()
    for device, msg in msgs:
        ro.on_job_status(device, msg, evaluate=False)
    took = time.process_time() - t0
    assert ro.done and ro.evaluate() == [] and ro.succeeded
    return took / len(msgs)


def main():
    best = min(_round(N) for _ in range(9))
    print("rollout_statuses: {} devices, 2 statuses each: {:.2f} us of CPU a status".format(
        N, best * 1e6))


if __name__ == "__main__":
    main()
