"""A worker's protocol lines stay within one daemon read whatever the model: a gate that fails
on a model with tens of thousands of outputs keeps its code (it was once split into pieces and
reported as ``worker_crashed``)."""

import json

import numpy as np

from agent.worker import MAX_LINE_BYTES, fit_line
from agent.worker.accuracy import MAX_OUTPUTS_LISTED, accuracy_report, gate_failure


def test_a_gate_failure_on_30000_outputs_is_one_short_line_with_its_code():
    names = ["detection_head/branch_{}/logits:0".format(i) for i in range(30000)]
    golden = [{n: np.ones((1, 2), np.float32) for n in names}]
    outputs = [{n: np.full((1, 2), 2.0, np.float32) for n in names}]
    report = accuracy_report(outputs, golden, {"atol": 1e-3, "rtol": 1e-3})
    assert not report["passed"]
    assert report["failed_output_count"] == 30000 and report["output_count"] == 30000
    assert len(report["failed_outputs"]) == MAX_OUTPUTS_LISTED
    assert len(report["outputs"]) == MAX_OUTPUTS_LISTED
    error = gate_failure(report)
    assert "and 29,992 more" in error.message
    line = fit_line({"type": "error", "error": error.to_dict()})
    assert len(line) < 64 << 10
    assert json.loads(line)["error"]["code"] == "accuracy_gate_failed"


def test_an_oversized_error_keeps_its_code_and_any_other_message_says_what_happened():
    huge = "x" * (MAX_LINE_BYTES + 10)
    error = json.loads(fit_line({"type": "error", "error": {"code": "accuracy_gate_failed",
                                                            "message": huge, "details": {}}}))
    assert error["error"]["code"] == "accuracy_gate_failed"
    assert len(error["error"]["message"]) < 9000 and "characters cut" in error["error"]["message"]
    other = json.loads(fit_line({"type": "result", "result": {"blob": huge}}))
    assert other["type"] == "error" and other["error"]["code"] == "internal_error"
    assert "result message" in other["error"]["message"]
    small = {"type": "progress", "stage": "building", "done": 1, "of": 2}
    assert json.loads(fit_line(small)) == small
