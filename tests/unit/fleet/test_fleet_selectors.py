"""Label selectors (agent.fleet.deployments.selectors) against the examples of Kubernetes' own
documentation (Labels and Selectors: equality-based and set-based requirements, the kubectl
examples), the issue's selectors, and what must be refused; device labels' syntax and caps
(agent.wire.device_labels) and what a selector sees of a device (agent.fleet.deployments.labels)."""

import pytest

from agent.errors import AgentError
from agent.fleet.deployments import labels
from agent.fleet.deployments.selectors import parse
from agent.wire import device_labels

PROD_FRONT = {"environment": "production", "tier": "frontend"}
QA_BACK = {"environment": "qa", "tier": "backend", "partition": "customerA"}
DEV = {"environment": "dev", "partition": "customerB"}
NONE = {}
ALL = [PROD_FRONT, QA_BACK, DEV, NONE]


@pytest.mark.parametrize("text,selected", [
    # Equality-based requirements (Kubernetes docs)
    ("environment = production", [PROD_FRONT]),
    ("tier != frontend", [QA_BACK, DEV, NONE]),  # also those without the key
    ("environment=production,tier!=frontend", []),
    ("environment==production", [PROD_FRONT]),
    # Set-based requirements (Kubernetes docs)
    ("environment in (production, qa)", [PROD_FRONT, QA_BACK]),
    ("tier notin (frontend, backend)", [DEV, NONE]),
    ("partition", [QA_BACK, DEV]),
    ("!partition", [PROD_FRONT, NONE]),
    ("partition,environment notin (qa)", [DEV]),
    # kubectl examples (Kubernetes docs, LIST and WATCH filtering)
    ("environment=production,tier=frontend", [PROD_FRONT]),
    ("environment in (production),tier in (frontend)", [PROD_FRONT]),
    ("environment in (production, qa)", [PROD_FRONT, QA_BACK]),
    ("environment,environment notin (frontend)", [PROD_FRONT, QA_BACK, DEV]),
    # the empty selector selects everything
    ("", ALL),
])
def test_kubernetes_documented_examples(text, selected):
    sel = parse(text)
    assert [lab for lab in ALL if sel.matches(lab)] == selected


def test_the_issues_selectors_and_canonical_text():
    dev = {"site": "warehouse-3", "board": "orin-nano", "camera": "dock"}
    assert parse("site=warehouse-3,board=orin-nano").matches(dev)
    assert not parse("site!=warehouse-3").matches(dev)
    assert parse("site!=lab").matches(dev)
    assert parse("camera in (dock,gate)").matches(dev)
    assert parse("!key").matches(dev) and not parse("key").matches(dev)
    # the same requirements in another order and spacing: the same group
    assert parse("board=orin-nano, site = warehouse-3").text == \
        parse("site=warehouse-3,board=orin-nano").text
    assert parse("camera in (gate, dock)").text == "camera in (dock,gate)"
    assert parse("fleet/site=a").matches({"fleet/site": "a"})


@pytest.mark.parametrize("text", [
    "a=b=c", "in (", "a in b", "a,", ",a", "=x", "a in (x y)", "a b", "a in (x", "a notin x",
    "a=(x)", "-a=x", "a=x-", "a;b", "a=" + "x" * 64, "a" * 64, "!", "a!b", "x/=1",
])
def test_bad_selectors_are_refused_with_the_position(text):
    with pytest.raises(AgentError) as exc:
        parse(text)
    assert exc.value.code == "bad_selector"
    assert "expected" in exc.value.message


def test_bounds():
    with pytest.raises(AgentError):
        parse("a=b," * 600 + "a=b")
    with pytest.raises(AgentError):
        parse(",".join("k{}".format(i) for i in range(33)))
    with pytest.raises(AgentError):
        parse(123)  # type: ignore[arg-type]


def test_device_labels_checked_and_capped():
    assert device_labels.check_labels({"site": "warehouse-3", "floor": 3}) == {
        "site": "warehouse-3", "floor": "3"}
    for bad in ({"board": "x"}, {"device/site": "x"}, {"fleet/site": "x"}, {"-a": "x"},
                {"a": "x y"}, {"a": "x" * 64}, {"k{}".format(i): "v" for i in range(33)},
                ["site"]):
        with pytest.raises(AgentError) as exc:
            device_labels.check_labels(bad)
        assert exc.value.code == "bad_label"
    kept, dropped = device_labels.lenient(dict({"board": "fake", "ok": "1", "bad": "a b"},
                                               **{"k{:02d}".format(i): "v" for i in range(40)}))
    assert "board" not in kept and "bad" not in kept and len(kept) == 32 and dropped == 11


def test_what_a_selector_sees_of_a_device():
    status = {"platform": {"board": "NVIDIA Jetson Orin Nano 8GB Developer Kit",
                           "jetpack": "6.0", "tensorrt": "8.6.2", "backend": "tensorrt",
                           "labels": {"site": "warehouse-3", "camera": "dock",
                                      "board": "agx-thor", "jetpack": "9"}}}
    seen = labels.selectable(status, {"site": "warehouse-4"})
    # derived from the platform only: the claim of board and jetpack was dropped
    assert seen["board"] == "orin-nano" and seen["jetpack"] == "6.0"
    assert seen["tensorrt"] == "8.6.2" and seen["class"].startswith("c")
    # the operator's word wins on the plain key; both stay apart under their prefixes
    assert seen["site"] == "warehouse-4"
    assert seen["fleet/site"] == "warehouse-4" and seen["device/site"] == "warehouse-3"
    assert seen["camera"] == "dock" and "fleet/camera" not in seen
    assert parse("board=orin-nano,site=warehouse-4").matches(seen)
    assert not parse("fleet/camera=dock").matches(seen)
    assert labels.selectable(None, None) == {}


def test_the_birth_status_carries_the_labels_where_the_previous_controller_accepts_them():
    """platform.labels is an extra key of platform: the schema of the previous release (no
    labels property; platform open to extra keys) accepts the status as it is."""
    import copy

    from agent.device.status_publisher import status_platform
    from agent.platform.info import PlatformInfo
    from agent.platform.matrix import load_matrix
    from agent.wire import protocol, status_messages
    from agent.wire.json_schema import Validator

    info = PlatformInfo(load_matrix())
    plat = status_platform(info, "onnxruntime", None, {"site": "warehouse-3"})
    msg = status_messages.status_message("dev-1", True, 3, "x", plat, [], ts=1.0)
    protocol.validate("status", msg)
    previous = copy.deepcopy(protocol.schema("status"))
    del previous["properties"]["platform"]["properties"]["labels"]
    assert "additionalProperties" not in previous["properties"]["platform"]
    assert Validator(previous, "status").first_violation(msg, "status") is None
    assert labels.reported(msg) == {"site": "warehouse-3"}
    assert "labels" not in status_platform(info, "onnxruntime", None)


def test_config_labels_are_checked_on_the_daemon(tmp_path):
    from agent.device import config

    path = tmp_path / "agent.yaml"
    path.write_text("device_id: d1\nlabels:\n  site: warehouse-3\n  floor: 2\n")
    assert config.load(str(path), env={}).labels == {"site": "warehouse-3", "floor": "2"}
    for body in ("labels:\n  board: orin\n", "labels:\n  site: two words\n",
                 "labels: [a]\n"):
        path.write_text("device_id: d1\n" + body)
        with pytest.raises(AgentError) as exc:
            config.load(str(path), env={})
        assert exc.value.code == "bad_config"
