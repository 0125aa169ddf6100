"""``python -m agent.worker.live``: the daemon's work on the app's donated inputs, in a child
process (``agent.device.models.live_check``), so the daemon never loads a runtime or a model and
gets its memory back after each run. One JSON request on stdin, one JSON line on stdout:
``{"ok": true, "figures": {...}}`` or ``{"ok": false, "error": {"code", "message"}}``.

    {"op": "check", "new", "running", "backend", "samples": [npz, newest first], "keep",
     "batch", "min_agreement", "max_error", "error_stat"}       the live check before commit
    {"op": "field", "onnx", "cache", "samples", "keep", "batch", "max_clip_rate",
     "reference", "max_drift"}                                    INT8 ranges in the field
    {"op": "calibration", "path"}                                 a calibration set's statistics

Worker side: Python 3.6.
"""

import json
import sys
from typing import Any, Dict

from agent.errors import AgentError

MAX_REQUEST = 4 << 20


def run(req: Dict[str, Any]) -> Any:
    from agent.precision import live

    op = req.get("op")
    if op == "calibration":
        return live.calibration_inputs(req["path"])
    samples = live.load_rows(req["samples"], int(req["keep"]))
    if not samples:
        raise AgentError("no_samples", "expected donated inputs, found none readable")
    if op == "field":
        return live.field_check(req["onnx"], req["cache"], samples, req.get("batch"),
                                float(req["max_clip_rate"]), req.get("reference"),
                                float(req.get("max_drift") or 0.0))
    if op != "check":
        raise AgentError("bad_argument", "expected op check | field | calibration, found "
                         "{!r}".format(op))
    from agent.engines.backends.base import get_backend

    backend = get_backend(req["backend"])
    with backend.open(req["new"]) as new, backend.open(req["running"]) as old:
        return live.live_check(new, old, samples, req.get("batch"),
                               float(req["min_agreement"]), float(req["max_error"]),
                               req["error_stat"])


def main() -> int:
    try:
        line = json.dumps({"ok": True, "figures": run(json.loads(sys.stdin.read(MAX_REQUEST)))},
                          allow_nan=False, default=str)
    except AgentError as exc:
        line = json.dumps({"ok": False, "error": exc.to_dict()})
    except Exception as exc:  # noqa: BLE001 - the daemon gets the reason in one line
        line = json.dumps({"ok": False, "error": {"code": "internal_error",
                                                  "message": repr(exc)[:500]}})
    sys.stdout.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
