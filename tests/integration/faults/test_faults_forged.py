"""The fault suite (``suite.py``): hostile job documents. Replayed, forged, mis-targeted,
expired and unsigned jobs, and a job flood against the rate limit."""

import time

from agent.wire import protocol
from tests.integration.faults.suite import MODEL, _forged, _send_raw_job, audit, fault, started

# ---------------------------------------------------------------------------- forged jobs


def test_replayed_forged_and_mistargeted_jobs(fleet, keys, signer, digits_files):
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent()
    controller.wait_online()
    # Signed early, delivered late: its sequence is below the next one's.
    early = _forged(controller, keys, signer, "signed-early")
    good = _forged(controller, keys, signer, "good")
    _send_raw_job(controller, good)
    assert controller.wait_state("good", protocol.TERMINAL_STATES, 60)["state"] == "SUCCEEDED"
    version = controller.last_status("good")["version"]
    # A code: a signed document for this device and job id, REJECTED with it. None: one
    # that proves no trusted origin for this device and job id, ignored (no journal row, no
    # status: it must not claim the id before the genuine document comes), and counted.
    cases = {
        "signed-early": (early, "job_replayed"),
        "unsigned": (dict(good, job_id="unsigned", signature=None), None),
        "rogue-key": (_forged(controller, keys, signer, "rogue-key", key="rogue"), None),
        "tampered-plan": (_forged(controller, keys, signer, "tampered-plan", tamper=lambda d:
                                  d["plan"].update(precision="int8")), None),
        "tampered-sha": (_forged(controller, keys, signer, "tampered-sha", tamper=lambda d:
                                 d["artifacts"]["model"].update(sha256="ee" * 32)), None),
        "moved-signature": (dict(_forged(controller, keys, signer, "moved-signature"),
                                 signature=good["signature"]), None),
        "expired": (_forged(controller, keys, signer, "expired", not_before=time.time() - 7200,
                            expires=time.time() - 3600), "job_expired"),
        "not-yet": (_forged(controller, keys, signer, "not-yet", not_before=time.time() + 3600,
                            expires=time.time() + 7200), "job_not_yet_valid"),
        "for-dev2": (_forged(controller, keys, signer, "for-dev2", device="dev2"), None),
    }
    recorded = [j for j, (_, code) in cases.items() if code]
    ignored = [j for j, (_, code) in cases.items() if not code]
    for job_id, (doc, _) in cases.items():
        if doc.get("signature") is None:
            doc.pop("signature", None)
        _send_raw_job(controller, doc, job_id=job_id)
    fault("forged_job", len(cases) - 1)
    fault("replayed_job")
    # The genuine document again, as it is (a replay of a job the device ran): ignored.
    _send_raw_job(controller, good)
    fault("replayed_job")
    for job_id in recorded:
        msg = controller.wait_state(job_id, protocol.TERMINAL_STATES, 30)
        assert msg["state"] == "REJECTED" and msg["error"]["code"] == cases[job_id][1], (
            job_id, msg)
    counters = controller.diag()["result"]["counters"]
    assert counters["unauthenticated_jobs"] == len(ignored), counters
    time.sleep(0.5)
    assert controller.last_status("good")["version"] == version
    assert all(controller.last_status(j) is None for j in ignored)
    with agent.journal() as journal:
        assert all(journal.job(j) is None for j in ignored)
    # The last accepted sequence survives a restart: an old document is still a replay.
    agent.kill()
    fault("agent_kill_9")
    started(agent)
    controller.wait_online()
    stale = _forged(controller, keys, signer, "stale", seq=good["signature"]["seq"] - 1)
    _send_raw_job(controller, stale)
    fault("replayed_job")
    msg = controller.wait_state("stale", protocol.TERMINAL_STATES, 30)
    assert msg["state"] == "REJECTED" and msg["error"]["code"] == "job_replayed", msg
    fresh = _forged(controller, keys, signer, "fresh")
    _send_raw_job(controller, fresh)
    assert controller.wait_state("fresh", protocol.TERMINAL_STATES, 60)["state"] == "SUCCEEDED"
    with agent.journal() as journal:
        refused = [journal.job(j) for j in recorded + ["stale"]]
        assert all(journal.job(j) is None for j in ignored)
    assert all(r["attempts"] == 0 for r in refused)  # none of them ever ran
    result = audit(agent, controller, ["good", "fresh", "stale"] + recorded)
    assert not result["lost"] and not result["corrupt"], result


def test_a_job_flood_is_rate_limited(fleet, keys, signer, digits_files):
    controller, make_agent = fleet
    MODEL[:] = [digits_files["model"]]
    agent = make_agent(extra_config="limits:\n  jobs_per_minute: 6\n  job_burst: 3\n")
    controller.wait_online()
    ids = ["flood-{}".format(i) for i in range(8)]
    for job_id in ids:
        _send_raw_job(controller, _forged(controller, keys, signer, job_id, kind="bench"))
    fault("job_flood", len(ids))
    finals = {j: controller.wait_state(j, protocol.TERMINAL_STATES, 90) for j in ids}
    limited = [j for j, m in finals.items() if (m.get("error") or {}).get("code") ==
               "rate_limited"]
    ran = [j for j, m in finals.items() if m["state"] == "SUCCEEDED"]
    assert len(ran) == 3 and len(limited) == 5, finals
    assert all(finals[j]["state"] == "REJECTED" for j in limited)
    assert "retry" in finals[limited[0]]["error"]["message"]
    result = audit(agent, controller, ids)
    assert not result["lost"] and not result["corrupt"], result
