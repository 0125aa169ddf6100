"""Message validation speed: ``protocol.validate`` on a job document and on a device status.

Ours: microseconds per validate call (the schema compiled beforehand, as a running daemon has
it). Baseline: ``json.loads`` of the same message, the parse every message pays anyway, so the
ratio says what validation adds to reading a message. Uses only ``protocol.validate`` and
``protocol.encode``, so the same file times any revision (docs/benchmarks.md, "Message
validation", ran it on the tree before and after the validator changed).
"""

import json
import os
import sys
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # after PYTHONPATH: PYTHONPATH=<another tree> times that tree

REPEATS = 5
SHA = "0123456789abcdef" * 4

JOB = {
    "protocol": 1, "job_id": "deploy-42", "kind": "deploy", "device": "nano-07",
    "created": 1717171717.5, "timeout_s": 3600,
    "artifacts": {"model": {"sha256": SHA, "size": 1234, "name": "m.onnx"},
                  "calibration": {"sha256": "f" * 64, "size": 99}},
    "plan": {"precision": "int8",
             "layer_precisions": {"layer{}:0".format(i): "float32" for i in range(20)},
             "precision_constraints": "obey",
             "calibration": {"algorithm": "minmax", "batch_size": 4},
             "shapes": {"x": [[1, 3], [4, 3], [8, 3]]}},
    "fallback": ["fp16", "fp32"],
    "gate": {"atol": 0.01, "rtol": 0.001, "check_error_stat": "elemwise", "min_top1": 0.99},
    "bench": {"iterations": 100, "warmup": 10},
}
STATUS = {
    "protocol": 1, "device": "nano-07", "online": True, "boot": 3, "ts": 1717171717.5,
    "agent_version": "1.0.0",
    "platform": {"board": "orin-nano", "jetpack": "6.2", "tensorrt": "10.3", "backend":
                 "tensorrt", "precisions": ["fp32", "fp16", "int8"]},
    "active_engines": [{"model": SHA, "engine_key": "k{}".format(i), "precision": "int8",
                        "activated": 1717171717.5, "job_id": "deploy-{}".format(i)}
                       for i in range(8)],
}


def _per_call_us(fn, number):
    return min(timeit.repeat(fn, number=number, repeat=REPEATS)) / number * 1e6


def run():
    from agent.wire import protocol

    rows = []
    for kind, msg, number in (("job", JOB, 2000), ("status", STATUS, 2000)):
        protocol.validate(kind, msg)  # compiled / loaded before timing
        text = protocol.encode(msg)
        ours = _per_call_us(lambda k=kind, m=msg: protocol.validate(k, m), number)
        parse = _per_call_us(lambda t=text: json.loads(t), number)
        rows.append({"name": "validate a {} ({} bytes) vs json.loads of it".format(
                         kind, len(text)),
                     "ours": ours, "baseline": parse, "unit": "us/message",
                     "goal": "validation no dearer than parsing (<= 1)"})
    return rows


if __name__ == "__main__":
    for row in run():
        print("{name}: {ours:.1f} us (json.loads {baseline:.1f} us)".format(**row))
