"""Named models on the wire: names and versions validated where they enter, the schemas of the
job fields, the rollback command's name form, the models message, the status's features."""

import json

import pytest

from agent.errors import AgentError
from agent.wire import protocol
from agent.wire.model_names import (
    default_version,
    derived_name,
    label,
    validate_name,
    validate_version,
)
from agent.wire.topics import Topics, models_topic

SHA = "3f1c0b5e9a7d2c4e6f8a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e"


@pytest.mark.parametrize("name", ["detector", "a", "resnet18", "yolo_v8.n-int8", "0" * 64])
def test_good_names(name):
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", "Detector", "-x", ".x", "_x", "a/b", "a b", "..", ".",
                                  "a" * 65, "naïve", None, 3, "a\x00"])
def test_bad_names(name):
    with pytest.raises(AgentError) as e:
        validate_name(name)
    assert e.value.code == "bad_model_name"
    assert "expected" in e.value.message and "found" in e.value.message


@pytest.mark.parametrize("version", ["v1", "1.2.3", "2024.06+cuda12", "V_2-rc1", "a" * 64,
                                     "3f1c0b5e9a7d"])
def test_good_versions(version):
    assert validate_version(version) == version


@pytest.mark.parametrize("version", ["", ".", "..", ".hidden", "-1", "+1", "v/1", "v 1",
                                     "a" * 65, None, 2])
def test_bad_versions(version):
    with pytest.raises(AgentError) as e:
        validate_version(version)
    assert e.value.code == "bad_model_version"


def test_defaults_from_the_sha():
    assert default_version(SHA) == SHA[:12]
    assert derived_name(SHA) == "sha-" + SHA[:12]
    assert validate_name(derived_name(SHA)) and validate_version(default_version(SHA))
    assert label("det", "v1") == "det@v1"
    with pytest.raises(ValueError):
        default_version("xyz")


def test_schema_patterns_are_the_validators():
    job = protocol.schema("job")["$defs"]
    models = protocol.schema("models")["$defs"]
    from agent.wire import model_names
    assert job["model_name"]["pattern"] == "^" + model_names.NAME_PATTERN + "$"
    assert job["model_version"]["pattern"] == "^" + model_names.JOB_VERSION_PATTERN + "$"
    assert models["name"] == job["model_name"]
    assert models["version"]["pattern"] == "^" + model_names.VERSION_PATTERN + "$"


def test_reserved_words_are_the_models_layouts():
    from agent.device.models import directory as models_dir
    from agent.wire import model_names

    assert models_dir.CURRENT in model_names.RESERVED_VERSIONS
    assert models_dir.TMP_PREFIX.startswith(".")  # no name or version starts with "."


@pytest.mark.parametrize("version", ["current"])
def test_versions_the_models_layout_uses_are_refused(version):
    with pytest.raises(AgentError) as e:
        validate_version(version)
    assert e.value.code == "bad_argument" and "link to the active version" in e.value.message
    assert validate_version("current2") == "current2" and validate_version("v-current")
    with pytest.raises(AgentError) as e:
        protocol.validate("job", _job(model_name="det", model_version=version))
    assert e.value.code == "bad_message" and "model_version" in e.value.message
    protocol.validate("job", _job(model_name="det", model_version="currently"))


def _job(**extra):
    doc = {"protocol": 1, "job_id": "j1", "kind": "deploy", "device": "d1",
           "artifacts": {"model": {"sha256": SHA, "size": 10}}}
    doc.update(extra)
    return doc


def test_job_document_fields():
    protocol.validate("job", _job(model_name="detector", model_version="v2"))
    protocol.validate("job", _job())  # both optional: older controllers send neither
    for bad in ({"model_name": "Detector"}, {"model_version": ".."}, {"model_name": ""}):
        with pytest.raises(AgentError) as e:
            protocol.validate("job", _job(**bad))
        assert e.value.code == "bad_message"


def test_rollback_command_takes_a_model_or_a_name():
    cmd = {"protocol": 1, "command": "rollback", "request_id": "r1"}
    protocol.validate("command", dict(cmd, model=SHA))
    protocol.validate("command", dict(cmd, name="detector"))
    protocol.validate("command", dict(cmd, name="detector", version="v1"))
    for bad in (cmd, dict(cmd, version="v1"), dict(cmd, name="Bad"),
                dict(cmd, name="det", version="..")):
        with pytest.raises(AgentError):
            protocol.validate("command", bad)


def _models(n=1, **entry):
    item = {"name": "detector", "version": "v2", "state": "committed", "previous": "v1",
            "precision": "int8", "engine_key": "k", "job_id": "det-v2", "activated": 1.0,
            "health": "ok", "rejected": []}
    item.update(entry)
    return {"protocol": 1, "device": "d1", "boot": 3, "ts": 2.0,
            "models": [dict(item, name="m{}".format(i)) if n > 1 else item for i in range(n)]}


def test_models_message():
    msg = _models()
    assert protocol.decode("models", protocol.encode(msg)) == msg
    protocol.validate("models", _models(previous=None, state="pending", future_key=1))
    for bad in (_models(state="active"), _models(name="A"), _models(version="."),
                _models(health=""), _models(rejected=["ok", "../x"])):
        with pytest.raises(AgentError):
            protocol.validate("models", bad)
    with pytest.raises(AgentError):  # at most 256 names
        protocol.validate("models", _models(257))
    protocol.validate("models", _models(256))
    big = _models(health="x" * 1000)
    big["models"] *= 80
    with pytest.raises(AgentError) as e:
        protocol.decode("models", json.dumps(big).encode())
    assert e.value.code == "message_too_large"


def test_job_status_result_names_the_model():
    st = {"protocol": 1, "job_id": "j1", "device": "d1", "kind": "deploy",
          "state": "SUCCEEDED", "version": 4, "statusDetails": {},
          "result": {"model": {"name": "detector", "version": "v2", "previous": "v1",
                               "state": "pending"}}}
    protocol.validate("job_status", st)
    st["result"]["model"]["name"] = "../etc"
    with pytest.raises(AgentError):
        protocol.validate("job_status", st)


def test_status_platform_accepts_features_and_more_keys():
    """The previous release's controller validates statuses with this same schema shape:
    ``platform`` has no additionalProperties, so a new daemon's features pass."""
    sch = protocol.schema("status")
    assert "additionalProperties" not in sch["properties"]["platform"]
    protocol.validate("status", {"device": "d1", "online": True, "boot": 1, "platform": {
        "board": "x", "features": ["named_models"], "anything": {"new": 1}}})


def test_models_topic():
    t = Topics("fleet/a")
    assert t.models("d1") == "fleet/a/devices/d1/models" == models_topic("fleet/a", "d1")
    info = t.parse("fleet/a/devices/d1/models")
    assert (info.kind, info.device) == ("models", "d1")
    assert ("fleet/a/devices/+/models", 1) in t.controller_subscriptions()
    with pytest.raises(AgentError):
        t.models("bad/id")
