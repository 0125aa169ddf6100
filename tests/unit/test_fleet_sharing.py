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
