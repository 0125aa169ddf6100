import pytest

from agent.engines.backends import base
from agent.errors import AgentError
from agent.wire.device import job_semantics
from tests.unit.wire_samples import job_doc


def test_job_must_match_its_topic():
    doc = job_doc()
    job_semantics.check_job_topic(doc, "nano-07", "deploy-42")
    for device, job_id in (("other", "deploy-42"), ("nano-07", "other")):
        with pytest.raises(AgentError) as info:
            job_semantics.check_job_topic(doc, device, job_id)
        assert info.value.code == "bad_message"


def test_plan_dict_builds_a_buildplan():
    plan = base.BuildPlan.from_dict(job_semantics.plan_dict(job_doc()))
    assert plan.precision == "int8"
    assert plan.layer_precisions == {"Softmax:0": "float32"}
    assert plan.calibration is not None and plan.calibration.algorithm == "minmax"
    assert plan.calibration.data is None
    assert plan.shapes == {"x": ((1, 3), (4, 3), (8, 3))}
    # int8 without calibration settings gets the defaults; fp16 gets none
    plan = base.BuildPlan.from_dict(job_semantics.plan_dict(job_doc(plan={"precision": "int8"})))
    assert plan.calibration is not None and plan.calibration.algorithm == "entropy2"
    assert job_semantics.plan_dict(job_doc(plan={"precision": "fp16"}))["calibration"] is None
