"""The controller's side of named models, pure parts: the job documents carry the model's name
and version only to devices whose status lists ``named_models`` (an older daemon refuses keys
it does not know), ``--name``/``--version`` are checked where they enter, a rollback goes by
name to new devices and by sha256 to old ones, and the views name every model a device holds
(from its models message, or from an older daemon's active engines)."""


import pytest

from agent.errors import AgentError
from agent.fleet.commands.rollback import Request, targets
from agent.fleet.database import device_models
from agent.fleet.rollouts.documents import new_rollout_id
from agent.fleet.rollouts.rollback import command, plan_one
from agent.fleet.rollouts.spec import doc_factory, model_name_version
from agent.fleet.web import views
from agent.wire import protocol

SHA = "ab" * 32
OTHER = "cd" * 32
NEW = {"device": "new-1", "online": True, "boot": 1,
       "platform": {"board": "b", "features": ["named_models", "later_feature"]}}
OLD = {"device": "old-1", "online": True, "boot": 1, "platform": {"board": "b"},
       "active_engines": [{"model": SHA, "engine_key": "k1", "precision": "fp16",
                           "job_id": "ro-1", "activated": 5.0}]}


def _spec(**extra):
    spec = {"precision": "fp16", "artifacts": {"model": {"sha256": SHA, "size": 10,
                                                         "name": "model.onnx"}}}
    spec.update(extra)
    return spec


def test_names_go_only_to_devices_that_list_the_feature():
    spec = _spec(model_name="detector", model_version="v2")
    feats = {"new-1": device_models.features(NEW), "old-1": device_models.features(OLD)}
    docs = doc_factory(spec, features=lambda d: feats.get(d, frozenset()))
    new, old = docs("new-1", "j1", "deploy", None), docs("old-1", "j1", "deploy", None)
    assert (new["model_name"], new["model_version"]) == ("detector", "v2")
    assert "model_name" not in old and "model_version" not in old
    assert "model_name" not in docs("unknown", "j1", "deploy", None)  # never heard of
    for doc in (new, old):
        protocol.validate("job", doc)
    # The check documents (no features lookup) carry them: their shape is checked too.
    assert doc_factory(spec)("check", "j1", "deploy", None)["model_name"] == "detector"
    # A rollout without a name sends no new field to anyone.
    assert "model_name" not in doc_factory(_spec(), features=lambda d: feats["new-1"])(
        "new-1", "j1", "deploy", None)


def test_name_and_version_checked_where_they_enter():
    assert model_name_version("detector", None, SHA) == ("detector", SHA[:12])
    assert model_name_version("detector", "2.0+cu12", SHA) == ("detector", "2.0+cu12")
    assert model_name_version(None, None, SHA) == (None, None)
    for args, code in ((("Detector", None), "bad_model_name"),
                       (("det", ".."), "bad_model_version"),
                       (("det", "v/1"), "bad_model_version"),
                       (("det", "current"), "bad_argument"),
                       ((None, "v1"), "bad_argument")):
        with pytest.raises(AgentError) as e:
            model_name_version(args[0], args[1], SHA)
        assert e.value.code == code and "expected" in e.value.message
    assert new_rollout_id("/x/model.onnx", base="detector").startswith("detector-")


def test_rollback_by_name_or_by_sha_per_device():
    models = {"device": "new-1", "boot": 1, "models": [
        {"name": "detector", "version": "v2", "state": "committed", "previous": "v1",
         "model": OTHER}]}
    assert plan_one("new-1", NEW, models, name="detector")["name"] == "detector"
    assert plan_one("new-1", NEW, models)["name"] == "detector"  # its only model
    assert plan_one("new-1", NEW, models, model=OTHER)["name"] == "detector"
    assert plan_one("new-1", NEW, models, name="detector", version="v1")["version"] == "v1"
    # An older daemon: the sha256 form, from its one active engine (or the rollout's model).
    assert plan_one("old-1", OLD, None) == {
        "device": "old-1", "name": None, "version": None, "model": SHA}
    assert plan_one("old-1", OLD, None, name="sha-" + SHA[:12])["model"] == SHA
    with pytest.raises(AgentError) as e:  # it knows no names: which sha256 is not guessed
        plan_one("old-1", OLD, None, name="detector")
    assert "--model SHA256" in e.value.message
    assert plan_one("old-1", OLD, None, rollout_sha=OTHER)["model"] == OTHER
    with pytest.raises(AgentError) as e:
        plan_one("old-1", OLD, None, name="detector", version="v1")
    assert "named_models" in e.value.message
    two = dict(models, models=models["models"] + [dict(models["models"][0], name="cls")])
    with pytest.raises(AgentError) as e:
        plan_one("new-1", NEW, two)
    assert "--name" in e.value.message and "cls, detector" in e.value.message
    with pytest.raises(AgentError):
        plan_one("old-1", None, None)  # no status: a sha256 is needed
    assert command(name="detector", version="v1", request_id="r1") == {
        "protocol": 1, "command": "rollback", "request_id": "r1", "name": "detector",
        "version": "v1"}
    protocol.validate("command", command(model=SHA))
    with pytest.raises(AgentError) as e:
        command(name="Bad")
    assert e.value.code == "bad_model_name"


def test_rollback_targets_check_the_flags():
    args = Request(devices=["new-1"], version="v1")
    with pytest.raises(AgentError) as e:
        targets(args, {"new-1": NEW})
    assert "--name" in e.value.message
    args.name, args.version = "detector", ".."
    with pytest.raises(AgentError) as e:
        targets(args, {"new-1": NEW})
    assert e.value.code == "bad_model_version"
    args.version = None
    assert targets(args, {"new-1": NEW}) == [{"device": "new-1", "name": "detector",
                                              "version": None, "model": None,
                                              "rollout_id": None}]


def test_every_model_a_device_holds_is_shown():
    models = {"device": "new-1", "boot": 2, "models": [
        {"name": "detector", "version": "v2", "state": "pending", "previous": "v1",
         "health": "ok"},
        {"name": "classifier", "version": "c7", "state": "committed",
         "health": "engine file missing", "future": 1}]}
    items = device_models.entries(NEW, models)
    assert device_models.text(items) == "classifier@c7 (committed), detector@v2 (pending)"
    assert device_models.problems(items) == ["classifier@c7: engine file missing"]
    old = device_models.entries(OLD, None)
    assert device_models.text(old) == "sha-{0}@{0} (active)".format(SHA[:12])
    assert old[0]["legacy"] and old[0]["model"] == SHA
    assert device_models.text([]) == "-"
    word, why = views.health(NEW, None, 0.0, items)
    assert word == "unhealthy" and "classifier@c7: engine file missing" in why
    assert views.health(NEW, None, 0.0, items[1:])[0] == "ok"
    # Features: strings only, bounded; an older status lists none.
    assert device_models.features(OLD) == frozenset()
    assert device_models.features({"platform": {"features": "named_models"}}) == frozenset()
    assert device_models.named(NEW) and not device_models.named(None)
    # A models message of an older boot does not replace a newer one.
    assert not device_models.newer({"boot": 3}, {"boot": 2})
    assert device_models.newer({"boot": 3}, {"boot": 3}) and device_models.newer(None, {"boot": 0})


def test_rollouts_are_named_by_name_and_version():
    assert views.model_label(_spec(model_name="detector", model_version="v2")) == "detector@v2"
    assert views.model_label(_spec()) == "sha-{0}@{0}".format(SHA[:12])
    assert views.model_label({}) is None
    row = {"rollout_id": "ro", "state": "succeeded", "spec": _spec(model_name="det"),
           "stages": [["a", "b"]], "counts": {"SUCCEEDED": 2}}
    rollbacks = [{"device": "a", "ok": True, "replied": 1.0},
                 {"device": "b", "ok": None, "replied": None},
                 {"device": "b", "ok": False, "replied": 2.0}]
    s = views.rollout_summary(row, [], rollbacks)
    assert s["model_name"] == "det@" + SHA[:12] and s["model_file"] == "model.onnx"
    assert s["rolled_back"] == ["a"] and s["rollback_refused"] == ["b"]
    assert s["state_text"] == "succeeded, rolled back on 1 device"
    assert views.rollout_summary(row, [])["state_text"] == "succeeded"


def test_a_stage_s_documents_are_checked_once_per_shape_and_each_is_what_a_full_check_builds():
    spec = _spec(model_name="detector", model_version="v2")
    feats = {"new-1": device_models.features(NEW)}
    docs = doc_factory(spec, features=lambda d: feats.get(d, frozenset()))
    for device in ("old-1", "new-1", "old-2", "new-1"):
        feats.setdefault(device, device_models.features(OLD))
        a = docs(device, "j1", "deploy", {"conv1": "float32"})
        b = doc_factory(spec, features=lambda d: feats.get(d, frozenset()))(  # checked in full
            device, "j1", "deploy", {"conv1": "float32"})
        assert dict(a, created=0) == dict(b, created=0) and a["device"] == device
        protocol.validate("job", a)
    # What a caller adds to its document stays its own; a bad id still gets the full check.
    docs("old-1", "j1", "deploy", None)["share"] = {"offer": "http://x/old-1"}
    assert "share" not in docs("old-2", "j1", "deploy", None)
    with pytest.raises(AgentError):
        docs("bad/id", "j1", "deploy", None)
