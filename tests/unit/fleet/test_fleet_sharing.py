"""The engine-sharing policy inside the pure ``Rollout``: the first device of each class builds
and is asked to offer, the others wait, then get the engine in their job document; a builder
that fails or a wait that times out sends them without one (they build)."""

from agent.fleet.rollouts.policy import Policy
from agent.fleet.rollouts.rollout import Rollout
from agent.fleet.transfer.sharing import SharePolicy, device_class, share_summary

REF = {"sha256": "e" * 64, "size": 10, "blocks": {"block_size": 1024, "sha256": "b" * 64}}


class Clock:
    now = 1000.0

    def __call__(self):
        return self.now


def docs(device, job_id, kind, layers, share=None):
    return {"job_id": job_id, "device": device, "kind": kind, "share": share}


def rollout(classes, wait_s=60.0):
    clock = Clock()
    ro = Rollout("ro", [list(classes)], docs, Policy(0.5, None, 1), clock=clock)
    ro.sharing = SharePolicy(classes, wait_s)
    return ro, clock


def status(ro, device, state, version=1, result=None):
    if result is None and state == "SUCCEEDED":  # a builder's signed report names its upload
        result = {"share": {"mode": "built", "offered": True, "sha256": REF["sha256"]}}
    return ro.on_job_status(device, {"job_id": "ro", "device": device, "kind": "deploy",
                                     "state": state, "version": version,
                                     "result": result or {}})


def sent(actions):
    return {a.device: a.doc["share"] for a in actions if a.kind == "publish"}


def test_one_builder_per_class_the_rest_adopt_its_engine():
    ro, _ = rollout({"a": "orin", "b": "orin", "c": "nano", "d": "orin"})
    first = sent(ro.start())
    assert first == {"a": {"offer": True}, "c": {"offer": True}}
    assert ro.runs["b"].state == "PENDING" and ro.runs["b"].note == \
        "waiting for the engine of a"
    ro.engine_offered("a", REF)
    released = sent(status(ro, "a", "SUCCEEDED"))
    assert released == {"b": {"engine": REF}, "d": {"engine": REF}}
    assert share_summary(ro.runs["b"].share, {"mode": "adopted"})["mode"] == "adopted"


def test_a_failed_builder_or_a_timeout_lets_the_others_build():
    ro, clock = rollout({"a": "orin", "b": "orin", "c": "nano", "d": "nano"}, wait_s=60)
    ro.start()
    assert sent(status(ro, "a", "FAILED")) == {"b": None}
    assert "offered no engine" in ro.runs["b"].note
    assert ro.release_waiting() == []
    clock.now += 61
    assert sent(ro.release_waiting()) == {"d": None}
    assert share_summary(ro.runs["d"].share, None) == {
        "mode": "built", "role": "building", "reason": "built: no engine after waiting 60 s"}


def test_an_unknown_class_builds_alone():
    ro, _ = rollout({"a": None, "b": None})
    assert sent(ro.start()) == {"a": None, "b": None}
    assert device_class({"platform": {"board": "Orin", "jetpack": "6.0"}}) == "v1|Orin|6.0|-|-"
    assert device_class({}) is None


def test_only_designated_builders_offer():
    clock = Clock()
    classes = {"a": "orin", "b": "orin", "c": "nano"}
    ro = Rollout("ro", [list(classes)], docs, Policy(0.5, None, 1), clock=clock)
    ro.sharing = SharePolicy(classes, 60.0, builders={"b"})
    first = sent(ro.start())
    # b (designated) builds and offers, though a comes first; c's class has no builder.
    assert first == {"b": {"offer": True}, "c": None}
    assert ro.runs["a"].note == "waiting for the engine of b"
    assert "no designated builder" in ro.runs["c"].share["note"]
    ro.engine_offered("b", REF)
    assert sent(status(ro, "b", "SUCCEEDED")) == {"a": {"engine": REF}}


def test_an_upload_the_builder_did_not_report_is_refused():
    ro, _ = rollout({"a": "orin", "b": "orin"})
    ro.start()
    trojan = dict(REF, sha256="7" * 64)
    ro.engine_offered("a", trojan)  # a stolen key raced the builder's own upload
    ro.engine_offered("a", REF)
    assert sent(status(ro, "a", "SUCCEEDED")) == {"b": {"engine": REF}}
    refused = ro.runs["a"].share["refused"]
    assert [r["sha256"] for r in refused] == ["7" * 64], refused
    assert ro.sharing.refused == 1
    shown = share_summary(ro.runs["a"].share, {"mode": "built", "offered": True})
    assert shown["refused"] == [{"sha256": "7" * 64, "why": "its builder a reported engine " +
                                 REF["sha256"][:16]}], shown


def test_an_upload_of_a_builder_that_reported_no_offer_is_refused():
    ro, _ = rollout({"a": "orin", "b": "orin"})
    ro.start()
    ro.engine_offered("a", dict(REF, sha256="7" * 64))
    out = sent(status(ro, "a", "SUCCEEDED", result={"share": {
        "mode": "built", "offered": False, "reason": "offer failed: HTTP Error 404"}}))
    assert out == {"b": None}
    assert "its upload was refused" in ro.runs["b"].share["note"]
    assert "offer failed: HTTP Error 404" in ro.runs["a"].share["refused"][0]["why"]


def test_a_revoked_engine_is_not_handed_out():
    ro, _ = rollout({"a": "orin", "b": "orin"})
    ro.sharing.revoked = lambda sha: sha == REF["sha256"]
    ro.start()
    ro.engine_offered("a", REF)
    assert sent(status(ro, "a", "SUCCEEDED")) == {"b": None}


def quorum_rollout():
    clock = Clock()
    classes = {"a": "orin", "b": "orin", "c": "orin"}
    ro = Rollout("ro", [list(classes)], docs, Policy(0.5, None, 1), clock=clock)
    ro.sharing = SharePolicy(classes, 60.0, builders={"a", "b"}, quorum=2)
    return ro


def built(sha, digest):
    return {"share": {"mode": "built", "offered": True, "sha256": sha,
                      "outputs_sha256": digest}}


def test_a_quorum_of_builders_must_agree_on_the_outputs():
    ro = quorum_rollout()
    assert sent(ro.start()) == {"a": {"offer": True}, "b": {"offer": True}}
    other = dict(REF, sha256="f" * 64)
    ro.engine_offered("a", REF)
    ro.engine_offered("b", other)
    assert sent(status(ro, "a", "SUCCEEDED", result=built(REF["sha256"], "1" * 64))) == {}
    assert ro.runs["c"].state == "PENDING"  # one report is not a quorum
    assert sent(status(ro, "b", "SUCCEEDED", result=built(other["sha256"], "1" * 64))) == {
        "c": {"engine": REF}}


def test_builders_that_disagree_leave_each_device_to_build():
    ro = quorum_rollout()
    ro.start()
    other = dict(REF, sha256="f" * 64)
    ro.engine_offered("a", REF)
    ro.engine_offered("b", other)
    status(ro, "a", "SUCCEEDED", result=built(REF["sha256"], "1" * 64))
    assert sent(status(ro, "b", "SUCCEEDED", result=built(other["sha256"], "2" * 64))) == {
        "c": None}
    assert "fewer than 2 of the class's builders" in ro.runs["c"].share["note"]
