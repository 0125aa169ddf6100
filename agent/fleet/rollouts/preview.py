"""What a rollout would do, before it does it: the accuracy gate in words (``gate_of``,
``gate_text``), each device's precision decision from its last known platform
(``device_decision``), and ``fleet rollout --dry-run``'s plan (``dry_run_plan``,
``dry_run_text``). Pure: the caller reads the registry; nothing here publishes."""

import time
from typing import Any, Dict, List, Mapping, Optional, Sequence

NOT_GATED = "not gated"


def gate_of(spec: Mapping[str, Any]) -> Dict[str, Any]:
    """The accuracy gate a rollout's devices apply: ``gated`` (goldens were sent) and the
    statistic of ``--check-error-stat`` (the device default, elemwise, when not given)."""
    artifacts = spec.get("artifacts") or {}
    gate: Dict[str, Any] = {"gated": "goldens" in artifacts,
                            "stat": spec.get("check_error_stat") or "elemwise"}
    for key in ("atol", "rtol", "min_top1"):
        if spec.get(key) is not None:
            gate[key] = spec[key]
    gate["labels"] = "labels" in artifacts
    return gate


def gate_text(gate: Mapping[str, Any]) -> str:
    if not gate.get("gated"):
        return NOT_GATED + " (--no-accuracy-gate: no goldens, any output is accepted)"
    parts = ["goldens, check-error-stat {}".format(gate.get("stat"))]
    for key in ("atol", "rtol", "min_top1"):
        if gate.get(key) is not None:
            parts.append("{} {}".format(key.replace("_", "-"), gate[key]))
    if gate.get("labels"):
        parts.append("label accuracy reported")
    return ", ".join(parts)


def device_decision(precision: str, fallback: str, platform: Optional[Mapping[str, Any]]
                    ) -> Dict[str, Any]:
    """The support-matrix decision a device would take for ``precision``, from the platform
    its last status advertised (backend and precisions): the same ``decide()`` it runs."""
    from agent.engines.backends.base import BUILDABLE
    from agent.platform.decision import decide, for_row
    from agent.platform.matrix import PRECISIONS

    plat = dict(platform or {})
    if not plat:
        return {"status": "unknown", "precision": None,
                "reason": "no platform known (the device never sent a full status)"}
    info = for_row("host")
    advertised = [p for p in plat.get("precisions") or [] if p in PRECISIONS]
    # The device advertises its matrix row's usable precisions: decide on exactly those
    # (emulated ones as the host row says when its backend is onnxruntime).
    host = dict(info.matrix_row.get("precisions") or {})
    emulating = plat.get("backend") == "onnxruntime"
    row = dict(info.matrix_row)
    row["precisions"] = {p: ("none" if p not in advertised else
                             (host.get(p) if emulating and host.get(p, "none") != "none"
                              else "native")) for p in PRECISIONS}
    row["id"] = "its advertised precisions"
    info.matrix_row = row
    info.backend = str(plat.get("backend"))
    info.board = str(plat.get("board") or info.board)
    d = decide(precision, info, fallback=fallback, buildable=BUILDABLE)
    if d.ok and not plat.get("backend"):  # the device checks the precision first
        return {"status": "rejected", "precision": None, "emulated": False,
                "reason": "no usable backend: {}".format(plat.get("backend_problem") or "?")}
    return {"status": d.status, "precision": d.precision, "reason": d.reason,
            "emulated": d.emulated}


def _age(ts: Any, now: float) -> Optional[str]:
    if not isinstance(ts, (int, float)):
        return None
    s = max(0.0, now - ts)
    return "{:.0f}s ago".format(s) if s < 120 else "{:.0f}m ago".format(s / 60) \
        if s < 7200 else "{:.0f}h ago".format(s / 3600)


def dry_run_plan(rollout_id: str, spec: Mapping[str, Any], stages: Sequence[Sequence[str]],
                 registry: Mapping[str, Mapping[str, Any]], job_ids: Sequence[str],
                 now: Optional[float] = None) -> Dict[str, Any]:
    """``registry``: device -> {status, last_seen} (its last status carries the platform)."""
    now = time.time() if now is None else now
    precision, fallback = str(spec.get("precision")), str(spec.get("fallback") or "reject")
    devices: List[Dict[str, Any]] = []
    for i, stage in enumerate(stages):
        for dev in stage:
            entry = registry.get(dev) or {}
            status = entry.get("status") or {}
            plat = status.get("platform") or {}
            seen = entry.get("last_seen", status.get("ts"))
            devices.append({"device": dev, "stage": i + 1, "board": plat.get("board"),
                            "online": status.get("online"), "last_seen": seen,
                            "last_seen_ago": _age(seen, now),
                            "decision": device_decision(precision, fallback, plat),
                            # gets model_name/model_version (its status lists named_models)
                            "named": "named_models" in (plat.get("features") or [])})
    artifacts = {role: {k: ref.get(k) for k in ("sha256", "size", "name", "url")
                        if ref.get(k) is not None}
                 for role, ref in (spec.get("artifacts") or {}).items()}
    return {"dry_run": True, "published": False, "rollout_id": rollout_id,
            "job_ids": list(job_ids), "model_path": spec.get("model_path"),
            "model_name": spec.get("model_name"), "model_version": spec.get("model_version"),
            "precision": precision, "fallback": fallback, "search": spec.get("search"),
            "artifacts": artifacts, "gate": gate_of(spec), "policy": spec.get("policy"),
            "stages": [list(s) for s in stages], "devices": devices}


def dry_run_text(plan: Mapping[str, Any]) -> str:
    from agent.fleet.rollouts.report import format_table

    lines = ["dry run of rollout {}: nothing was published".format(plan["rollout_id"]),
             "model:     {} ({}, fallback {}{})".format(
                 plan.get("model_path"), plan["precision"], plan["fallback"],
                 ", search " + str(plan["search"]) if plan.get("search") else ""),
             "name:      {}".format("{}@{} (to the devices that list named_models; the "
                                    "others name it sha-<12 hex>)".format(
                                        plan["model_name"], plan.get("model_version"))
                                    if plan.get("model_name") else "none (devices name it "
                                    "sha-<12 hex of the model>)"),
             "jobs:      {}".format(", ".join(plan["job_ids"])),
             "gate:      {}".format(gate_text(plan["gate"])), "artifacts:"]
    for role, ref in sorted(plan["artifacts"].items()):
        lines.append("  {:<12} {} bytes  sha256 {}{}".format(
            role, ref.get("size"), str(ref.get("sha256"))[:16],
            "  url " + ref["url"] if ref.get("url") else ""))
    pol = plan.get("policy") or {}
    lines.append("stages:    {} (success threshold {:.0%}{})".format(
        len(plan["stages"]), float(pol.get("success_threshold", 1.0)),
        ", abort above {:.0%} failed".format(pol["abort_failure_rate"])
        if pol.get("abort_failure_rate") is not None else ""))
    rows = []
    for d in plan["devices"]:
        dec = d["decision"]
        what = dec["status"] if dec["status"] in ("unknown", "rejected") else "{} {}{}".format(
            dec["status"], dec["precision"], " (emulated)" if dec.get("emulated") else "")
        rows.append([str(d["stage"]), d["device"], str(d.get("board") or "-"),
                     {True: "yes", False: "no"}.get(d["online"], "?"),
                     d.get("last_seen_ago") or "-", what,
                     "" if dec["status"] == "accepted" else dec["reason"][:90]])
    lines.append(format_table(["STAGE", "DEVICE", "BOARD", "ONLINE", "LAST SEEN", "WOULD",
                               "WHY"], rows))
    return "\n".join(lines)
