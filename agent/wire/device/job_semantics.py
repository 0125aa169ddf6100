"""What a received job document means beyond its schema (Python >= 3.8): it must name the
device and job of the topic it came on, and its plan is read into the shape
``BuildPlan.from_dict`` accepts. Pure.
"""

from typing import Any, Dict, Mapping

from agent.errors import AgentError
from agent.wire.json_schema import short


def check_job_topic(doc: Mapping[str, Any], device: str, job_id: str) -> None:
    """A job document must name the device and job id of the topic it came on."""
    if doc.get("job_id") != job_id:
        raise AgentError("bad_message", "job document on the topic of job {!r} names job_id {}"
                         .format(job_id, short(doc.get("job_id"))))
    if doc.get("device") != device:
        raise AgentError("bad_message", "job document for device {!r} names device {}"
                         .format(device, short(doc.get("device"))))


def plan_dict(doc: Mapping[str, Any]) -> Dict[str, Any]:
    """The job's plan in the shape ``BuildPlan.from_dict`` accepts; calibration paths are left
    None for the agent to fill from the ``calibration`` artifact and its own caches."""
    plan = dict(doc.get("plan") or {})
    out: Dict[str, Any] = {
        "precision": plan.get("precision", "fp32"),
        "layer_precisions": dict(plan.get("layer_precisions") or {}),
        "precision_constraints": plan.get("precision_constraints", "none"),
        "calibration": None,
        "shapes": dict(plan.get("shapes") or {}),
        "workspace_bytes": plan.get("workspace_bytes"),
        "dla_core": plan.get("dla_core"),
    }
    # Sent only when asked for, so a plan without them reads (and keys) as before.
    if plan.get("dla_gpu_fallback") is False:
        out["dla_gpu_fallback"] = False
    if plan.get("explicit_int8") is True:
        out["explicit_int8"] = True
    if plan.get("plugins"):
        out["plugins"] = [{"file": p["file"], "sha256": p["sha256"]} for p in plan["plugins"]]
    calib = plan.get("calibration")
    needs = out["precision"] in ("int8", "best") or "int8" in out["layer_precisions"].values()
    if calib or needs:
        calib = dict(calib or {})
        out["calibration"] = {
            "data": None,
            "cache": None,
            "algorithm": calib.get("algorithm", "entropy2"),
            "batch_size": calib.get("batch_size", 8),
            "shuffle_seed": calib.get("shuffle_seed"),
            "max_samples": calib.get("max_samples"),
        }
    return out
