"""Samples the wire protocol's tests share: a valid job document, a sha256, the error a
payload decodes to."""

import pytest

from agent.errors import AgentError
from agent.wire import protocol

SHA = "0123456789abcdef" * 4


def job_doc(**extra):
    doc = {
        "protocol": 1,
        "job_id": "deploy-42",
        "kind": "deploy",
        "device": "nano-07",
        "created": 1717171717.0,
        "timeout_s": 3600,
        "artifacts": {"model": {"sha256": SHA, "size": 1234, "name": "m.onnx"},
                      "calibration": {"sha256": "f" * 64, "size": 99}},
        "plan": {"precision": "int8", "layer_precisions": {"Softmax:0": "float32"},
                 "precision_constraints": "obey",
                 "calibration": {"algorithm": "minmax", "batch_size": 4},
                 "shapes": {"x": [[1, 3], [4, 3], [8, 3]]}},
        "fallback": ["fp16", "fp32"],
        "gate": {"atol": 0.01, "rtol": 0.001, "check_error_stat": "elemwise", "min_top1": 0.99},
        "bench": {"iterations": 100, "warmup": 10},
    }
    doc.update(extra)
    return doc


def code_of(kind, payload, **kw):
    with pytest.raises(AgentError) as info:
        protocol.decode(kind, payload, **kw)
    return info.value
