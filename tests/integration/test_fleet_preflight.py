"""``fleet rollout --search ... --preflight`` through the real CLI with a real agent (onnxruntime
backend) over a real Mosquitto: the host emulation predicts the set, the device verifies it
with one build; without pre-flight the device searches (more evaluations), same answer. The
job document's ``search.predicted`` is bounded by the schema the device validates with."""

import json
import os

import pytest

from agent import fleet
from agent.errors import AgentError
from agent.wire import protocol
from tests.integration.test_fleet_cli import fp16_args, run_cli
from tests.integration.test_fleet_rollout import FP16, wait_status

SEARCH = ["--search", "minimal", "--check-error-stat", "median", "--timeout", "120"]


def test_preflight_device_verifies_the_host_prediction_with_one_build(mosquitto, agent_factory,
                                                                       capsys):
    agent = agent_factory("pf-1").start()
    wait_status(mosquitto, ["pf-1"], agents=[agent])
    broker = ["--broker", mosquitto.url]

    rc, out, err = run_cli(capsys, *fp16_args(*SEARCH), "--preflight", "--devices", "pf-1",
                           "--rollout-id", "ro-pf", "-q", *broker)
    assert rc == 0, err
    assert "pre-flight on the host emulation (onnxruntime): " in out
    assert "predicted 2 layer(s): Add, Sub" in out, out
    assert "pf-1: verified with one build; 1 device evaluation(s)" in out, out
    assert "Add,Sub:fp32" in out  # the deploy job kept the verified set

    rc, out, err = run_cli(capsys, *fp16_args(*SEARCH), "--devices", "pf-1",
                           "--rollout-id", "ro-nopf", "--json", "-q", *broker)
    assert rc == 0, err
    report = json.loads(out)
    row = report["devices"][0]
    assert report["preflight"] is None and row["search"]["prediction_passed"] is None
    assert row["search"]["evaluations"] > 1 and set(row["layers_kept"]) == {"Add", "Sub"}
    assert sorted(row["search"]["keep"]) == ["Add", "Sub"]


def test_preflight_needs_a_search_and_the_predicted_set_is_bounded(capsys):
    rc, _, err = run_cli(capsys, *fp16_args("--preflight", "--devices", "d1", "--broker",
                                            "mqtt://127.0.0.1:1"))
    assert rc == 2 and "bad_argument" in err and "--search" in err
    spec = {"precision": "fp16", "search": "minimal", "predicted": ["Add", "Sub"],
            "artifacts": {"model": {"sha256": "0" * 64, "size": 1}}}
    doc = fleet.doc_factory(spec)("d1", "ro-x.search", "search", None)
    assert doc["search"]["predicted"] == ["Add", "Sub"]
    protocol.validate("job", doc)
    for bad in (["L"] * 4097, ["x" * 257], [""], [1]):
        broken = dict(doc, search=dict(doc["search"], predicted=bad))
        with pytest.raises(AgentError) as exc:
            protocol.validate("job", broken)
        assert exc.value.code == "bad_message" and "predicted" in exc.value.message


def test_host_search_command_mirrors_the_device_job():
    from argparse import Namespace

    from agent.cli.fleet_preflight import search_argv

    args = Namespace(model="m.onnx", precision="int8", search="bisect",
                     search_direction="reverse", max_evaluations=7, atol=0.5, rtol=None,
                     check_error_stat="median", layer_precisions=["A:float32"], calib="c",
                     calib_algorithm="minmax", calib_batch_size=4)
    argv = search_argv(args, {"inputs": "i.json", "goldens": os.path.join(FP16, "g.json")})
    line = " ".join(argv[1:])
    for part in ("-m agent search m.onnx --int8 --backend onnxruntime --mode bisect",
                 "--direction reverse", "--max-evaluations 7", "--atol 0.5",
                 "--check-error-stat median", "--layer-precisions A:float32", "--calib c",
                 "--calib-algo minmax", "--calib-batch-size 4", "--load-inputs i.json"):
        assert part in line, line
    assert "--rtol" not in line
