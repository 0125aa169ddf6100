"""Model sets' decision and record, device pins and health notes, and meta.json against its JSON
Schema (agent/data/schemas/model_meta.json)."""

import json
import os

import pytest

from agent.device.models import meta as model_meta
from agent.device.models import sets as model_sets
from agent.device.models.notes import ModelNotes
from agent.errors import AgentError
from agent.wire.json_schema import Validator

A = "a" * 64


def meta_validator():
    with open(model_meta.SCHEMA) as f:
        return Validator(json.load(f), "meta.json")


def assert_meta_valid(doc):
    problem = meta_validator().first_violation(doc, "meta.json")
    assert problem is None, problem


def test_set_spec_is_checked():
    doc = {"model_name": "det", "model_set": {"id": "s1", "names": ["det", "cls"]}}
    spec = model_sets.parse(doc)
    assert spec == model_sets.Spec("s1", ("det", "cls"), model_sets.DEFAULT_TIMEOUT_S)
    assert model_sets.parse({"model_name": "det"}) is None
    for bad in ({"id": "s1", "names": ["det"]}, {"id": "s1", "names": ["det", "det"]},
                {"id": "s1", "names": ["cls", "seg"]}, {"id": "", "names": ["det", "cls"]},
                {"id": "s1", "names": ["det", "Bad!"]}, {"id": "s1", "names": ["det"] * 9},
                {"id": "s1", "names": ["det", "cls"], "timeout_s": 1}, "s1"):
        with pytest.raises(AgentError) as exc:
            model_sets.parse({"model_name": "det", "model_set": bad})
        assert exc.value.code == "bad_model_set", bad


def test_set_decision():
    rec = {"id": "s", "names": ["det", "cls"], "deadline": 100.0, "timeout_s": 50.0,
           "failed": None, "members": {"det": {"version": "v2", "before": "v1"}}}
    act = {"det": ("v2", "committed"), "cls": ("v1", "committed")}
    assert model_sets.decide(rec, act, 10.0)[0] == model_sets.WAIT
    rec["members"]["cls"] = {"version": "v2", "before": "v1"}
    act["cls"] = ("v2", "pending")
    assert model_sets.decide(rec, act, 10.0)[0] == model_sets.WAIT
    act["cls"] = ("v2", "committed")
    assert model_sets.decide(rec, act, 10.0)[0] == model_sets.COMMITTED
    act["cls"] = ("v1", "committed")  # cls went back: det goes too
    action, reason = model_sets.decide(rec, act, 10.0)
    assert action == model_sets.REVERT and "cls@v2" in reason
    assert model_sets.revert_plan(rec, act) == [("det", "v2", "v1")]
    del rec["members"]["cls"]
    assert model_sets.decide(rec, {"det": ("v2", "committed")}, 100.0) == (
        model_sets.REVERT, "the set was not complete within 50 s (missing cls)")
    rec["failed"] = "det@v2 reported unhealthy: boom"
    assert model_sets.decide(rec, {"det": ("v2", "committed")}, 0.0) == (
        model_sets.REVERT, "det@v2 reported unhealthy: boom")


def test_set_record_survives_and_refuses_mixing(tmp_path):
    sets = model_sets.ModelSets.in_state_dir(str(tmp_path), clock=lambda: 10.0)
    spec = model_sets.Spec("s", ("det", "cls"), 60.0)
    sets.check(spec, "det")
    sets.started(spec, "det", "v2", "v1")
    sets.started(spec, "det", "v3", "v2")  # a name twice in one set: the first before stays
    again = model_sets.ModelSets.in_state_dir(str(tmp_path))  # as after a crash
    assert again.open["members"] == {"det": {"version": "v3", "before": "v1"}}
    assert again.open["deadline"] == 70.0
    with pytest.raises(AgentError, match="open model set s"):
        again.check(None, "cls")
    with pytest.raises(AgentError, match="one set is open at a time"):
        again.check(model_sets.Spec("t", ("seg", "cls"), 60.0), "seg")
    again.check(None, "seg")  # not a name of the set
    again.close(model_sets.COMMITTED)
    assert again.closed == ("s", model_sets.COMMITTED)
    assert not os.path.exists(os.path.join(str(tmp_path), model_sets.FILE))
    (tmp_path / model_sets.FILE).write_text("[1, 2")
    assert model_sets.ModelSets.in_state_dir(str(tmp_path)).open is None  # damaged: ignored


def test_pins_and_health_persist(tmp_path):
    notes = ModelNotes.in_state_dir(str(tmp_path))
    notes.pin("det", "v1")
    notes.check("det", "v1")
    notes.check("cls", "v9")
    with pytest.raises(AgentError) as exc:
        notes.check("det", "v2")
    assert exc.value.code == "model_pinned" and exc.value.details["pinned"] == "v1"
    notes.health["det"] = "rolled back from v2: " + "x" * 500
    again = ModelNotes.in_state_dir(str(tmp_path))
    assert again.pins == {"det": "v1"} and len(again.health["det"]) == 200
    assert again.unpin("det") == "v1" and again.unpin("det") is None
    assert ModelNotes.in_state_dir(str(tmp_path)).pins == {}
    with pytest.raises(AgentError):
        again.pin("det", "../x")
    (tmp_path / "model_notes.json").write_text('{"pins": {"det": "../x", "cls": "v2"}}')
    assert ModelNotes.in_state_dir(str(tmp_path)).pins == {"cls": "v2"}


def test_meta_json_matches_its_schema():
    io = {"inputs": [{"name": "x", "shape": [1, 3, 224, 224], "dtype": "float32"},
                     {"name": "n", "shape": ["batch", 4], "dtype": "int64"}],
          "outputs": [{"name": "y", "shape": [None, 10], "dtype": "float32"}]}
    result = {"engine_key": "k", "precision": "fp16", "io": io, "throughput_qps": 3.0,
              "accuracy": {"passed": True, "max_abs": 0.01}}
    # A Jetson with a DLA engine and a plan profile.
    meta = model_meta.build("det", "v1", A, result, {"board": "orin", "tensorrt": "8.6"},
                            {"gpu": "orin", "sm_count": "16", "compute_capability": "8.7"},
                            "j1", 5.0, "pending", "e" * 64, 10, dla_core=1,
                            shapes={"n": [[1, 4], [8, 4], [16, 4]]})
    assert_meta_valid(meta)
    assert meta["schema_version"] == model_meta.SCHEMA_VERSION
    assert meta["portability"]["sm_count"] == 16 and meta["portability"]["dla_core"] == 1
    assert meta["profiles"] == [{"inputs": {
        "x": {"min": [1, 3, 224, 224], "opt": [1, 3, 224, 224], "max": [1, 3, 224, 224]},
        "n": {"min": [1, 4], "opt": [8, 4], "max": [16, 4]}}}]
    # A host (onnxruntime): no GPU facts, a dynamic input without a profile is left out.
    host = model_meta.build("det", "v1", A, dict(result, accuracy=None), {}, {}, None, 5.0,
                            "committed", "e" * 64, 10)
    assert_meta_valid(host)
    assert host["portability"]["sm_count"] is None and host["portability"]["dla_core"] is None
    assert list(host["profiles"][0]["inputs"]) == ["x"]
    assert_meta_valid(model_meta.build("det", "v1", A, {}, {}, {}, None, 0.0, "committed",
                                       "e" * 64, 0))
    broken = dict(meta, schema_version="1")
    assert meta_validator().first_violation(broken, "meta.json") is not None


def test_rollout_passes_the_set_to_devices_that_know_sets():
    from agent.fleet.rollouts.spec import doc_factory, model_set_spec
    from agent.wire import protocol

    model_set = model_set_spec("cam-2", "det, cls", "det")
    assert model_set == {"id": "cam-2", "names": ["det", "cls"]}
    assert model_set_spec(None, None, "det") is None
    for bad in (("cam-2", "det", "det"), ("cam-2", "cls,seg", "det"), ("cam 2", "det,cls", "det"),
                ("cam-2", "det,det", "det"), (None, "det,cls", "det"), ("cam-2", "det,Cls", "det"),
                ("cam-2", "det,cls", None)):
        with pytest.raises(AgentError) as exc:
            model_set_spec(*bad)
        assert exc.value.code == "bad_argument", bad
    spec = {"precision": "fp16", "model_name": "det", "model_version": "v2",
            "model_set": model_set, "artifacts": {"model": {"sha256": A, "size": 10,
                                                            "name": "model.onnx"}}}
    feats = {"new": {"named_models", "model_sets"}, "named": {"named_models"}}
    docs = doc_factory(spec, features=lambda d: feats.get(d, set()))
    new, named, old = (docs(d, "j1", "deploy", None) for d in ("new", "named", "old"))
    assert new["model_set"] == model_set and new["model_name"] == "det"
    assert "model_set" not in named and "model_set" not in old and "model_name" not in old
    for doc in (new, named, old):
        protocol.validate("job", doc)
    parsed = model_sets.parse(new)  # and the device reads it as sent
    assert parsed is not None and parsed.names == ("det", "cls")


def test_pin_over_the_socket_is_for_root_and_the_service_user():
    from agent.device.app import requests as app_requests

    class Switch(object):
        def pin(self, name, version):
            return {"name": name, "version": version, "pinned": True}

        def unpin(self, name):
            return {"name": name, "pinned": False}

    def ask(request, uid):
        import queue

        req = app_requests.AppRequest(request, {"uid": uid}, queue.Queue(1))
        app_requests.answer(Switch(), req)
        return req.reply.get_nowait()

    assert ask({"op": "pin", "name": "det", "version": "v1"}, os.getuid())["pinned"]
    assert ask({"op": "unpin", "name": "det"}, 0)["ok"]
    refused = ask({"op": "pin", "name": "det", "version": "v1"}, os.getuid() + 4242)
    assert refused["error"]["code"] == "app_not_allowed", refused
