"""What a rollout shows its user: the results (``result_row``, ``results_table``,
``rollout_report``, ``summary_line``) and the live progress view (``ProgressView``)."""

import sys
import time
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Sequence

from agent.fleet.rollouts.device_run import PENDING, DeviceRun
from agent.fleet.rollouts.preview import NOT_GATED
from agent.fleet.rollouts.rollout import Rollout

# ============================================================================ results


def _pct(value: Any) -> str:
    return "{:.1%}".format(value) if isinstance(value, (int, float)) else "-"


def _num(value: Any, fmt: str = "{:.3g}") -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-"
    return fmt.format(value)


def _short(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _stat_error(accuracy: Mapping[str, Any], stat: str) -> Any:
    """The worst absolute error under the gate's statistic: the outputs' ``required_atol``
    (the atol that statistic needed), else the summary's max/mean."""
    if stat not in ("max", "elemwise"):
        outputs = accuracy.get("outputs")
        values: List[float] = [
            float(o["required_atol"]) for o in outputs.values()
            if isinstance(o, dict) and isinstance(o.get("required_atol"), (int, float))
        ] if isinstance(outputs, dict) else []
        if values:
            return max(values)
        if accuracy.get(stat + "_abs_error") is not None:
            return accuracy[stat + "_abs_error"]
    return None


def accuracy_summary(accuracy: Optional[Mapping[str, Any]], stat: Optional[str] = None,
                     gated: bool = True) -> str:
    """One cell: for classifiers with labels, the label accuracy next to the fp32 reference's
    and the top-1 agreement with the goldens; else the worst absolute error under the gate's
    statistic ``stat`` (``median|err|`` when the gate is median; ``max|err|`` for max and
    elemwise) and top-1 when the gate asked for it; "pass"/"FAIL" from the gate; "not gated"
    for a rollout without goldens."""
    if not gated:
        return NOT_GATED
    if not accuracy:
        return "-"
    parts = []
    value = _stat_error(accuracy, stat) if stat else None
    if accuracy.get("label_accuracy") is not None:
        parts.append("acc {} (fp32 {})".format(_pct(accuracy["label_accuracy"]),
                                               _pct(accuracy.get("golden_label_accuracy"))))
    elif value is not None:
        parts.append("{}|err| {}".format(stat, _num(value)))
    elif accuracy.get("max_abs_error") is not None:
        parts.append("max|err| {}".format(_num(accuracy["max_abs_error"])))
    if accuracy.get("top1_agreement") is not None and (
            accuracy.get("label_accuracy") is not None or accuracy.get("min_top1") is not None):
        parts.append("top-1 {}".format(_pct(accuracy["top1_agreement"])))
    verdict = accuracy.get("passed")
    if verdict is not None:
        parts.append("pass" if verdict else "FAIL")
    return ", ".join(parts) or "-"


def result_row(run: DeviceRun, status: Optional[Mapping[str, Any]] = None,
               gate: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """Everything the table and ``--json`` show for one device; ``gate``: the rollout's
    (``preview.gate_of``), for the statistic shown and "not gated"."""
    result = run.result or {}
    error = run.error or {}
    accuracy = result.get("accuracy")
    if accuracy is None and isinstance(error.get("details"), dict):
        accuracy = error["details"].get("accuracy")
    platform = dict((status or {}).get("platform") or {})
    kept: Dict[str, str] = {}
    if isinstance(result.get("layers_kept"), dict):
        kept = {str(k): str(v) for k, v in result["layers_kept"].items()}
    elif run.sent_layers:
        kept = dict(run.sent_layers)
    latency = result.get("latency_ms") or {}
    row: Dict[str, Any] = {
        "device": run.device,
        "stage": run.stage + 1,
        "board": platform.get("board"),
        "online": (status or {}).get("online"),
        "state": run.state,
        "precision": result.get("precision") or (run.search or {}).get("precision"),
        "fallback_reason": result.get("fallback_reason"),
        "emulated": result.get("emulated"),
        "layers_kept": kept,
        "accuracy": accuracy,
        "gated": bool((gate or {}).get("gated", True)),
        "gate_stat": (gate or {}).get("stat"),
        "throughput_qps": result.get("throughput_qps"),
        "latency_p50_ms": latency.get("median", latency.get("p50")),
        "latency_p99_ms": latency.get("p99"),
        "error_code": error.get("code"),
        "error_message": error.get("message"),
        "note": run.note,
        "job_id": run.job_id,
        "cache_hit": result.get("cache_hit"),
        # named models: {name, version, previous, state} as the device activated it
        "model": result.get("model") if isinstance(result.get("model"), dict) else None,
        "share": share_of(run, result),
        "search": ({k: run.search.get(k) for k in ("mode", "keep", "evaluations", "builds",
                                                   "seconds", "passed", "prediction_passed",
                                                   "one_minimal", "untested_removals",
                                                   "untested_removals_count")}
                   if run.search else None),
        "seconds": (round(run.finished - run.started, 2)
                    if run.finished is not None and run.started is not None else None),
    }
    return row


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [len(h) for h in header]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(header, widths)).rstrip()]
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)


def _kept_text(kept: Mapping[str, str]) -> str:
    if not kept:
        return "-"
    by_prec: Dict[str, List[str]] = {}
    for name, prec in sorted(kept.items()):
        by_prec.setdefault(prec, []).append(name)
    return "; ".join("{}:{}".format(",".join(names), {"float32": "fp32", "float16": "fp16"}.get(
        prec, prec)) for prec, names in sorted(by_prec.items()))


def results_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The results table plus numbered notes (fallback reasons, errors, cancellations)."""
    header = ["DEVICE", "BOARD", "STATE", "PRECISION", "KEPT IN HIGHER PRECISION", "ACCURACY",
              "QPS", "P50 ms", "P99 ms", "ERROR"]
    body, notes = [], []
    emulated = False
    for row in rows:
        precision = row.get("precision") or "-"
        if row.get("emulated"):
            precision += "*"
            emulated = True
        if row.get("fallback_reason"):
            notes.append("{}: fell back: {}".format(row["device"], row["fallback_reason"]))
            precision += " (fallback [{}])".format(len(notes))
        share = row.get("share") or {}  # engine sharing: adopted, or why it built
        if share.get("mode") == "adopted":
            precision += " (shared engine)"
        elif share.get("reason") and share["reason"] != row.get("note"):
            notes.append("{}: built its own engine: {}".format(row["device"], share["reason"]))
            precision += " (built [{}])".format(len(notes))
        for refused in share.get("refused") or []:  # uploads its builder did not report
            notes.append("{}: engine upload {} refused: {}".format(
                row["device"], str(refused.get("sha256"))[:16], refused.get("why")))
        error = row.get("error_code") or ("see" if row.get("note") else "-")
        if row.get("error_message"):
            # A device cancelled by the controller says only that: the note says why.
            notes.append("{}: {} {}: {}{}".format(
                row["device"], row["state"], row["error_code"], row["error_message"],
                " ({})".format(row["note"]) if row.get("note") else ""))
            error += " [{}]".format(len(notes))
        elif row.get("note"):
            notes.append("{}: {}".format(row["device"], row["note"]))
            error += " [{}]".format(len(notes))
        body.append([row["device"], _short(str(row.get("board") or "-"), 34), row["state"],
                     precision, _kept_text(row.get("layers_kept") or {}),
                     accuracy_summary(row.get("accuracy"), row.get("gate_stat"),
                                      row.get("gated", True)), _num(row.get("throughput_qps"),
                                                                 "{:.0f}"),
                     _num(row.get("latency_p50_ms")), _num(row.get("latency_p99_ms")), error])
    text = format_table(header, body)
    if emulated:
        text += "\n* emulated by the onnxruntime backend: numerics are faithful, speed is not"
    for i, note in enumerate(notes, 1):
        text += "\n[{}] {}".format(i, _short(note, 400))
    return text


def preflight_summary(preflight: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> str:
    """fleet rollout --preflight: the host's predicted set, then per device whether its one
    verifying build passed and how many evaluations its search took."""
    keep = list(preflight.get("keep") or [])
    lines = ["pre-flight on the host emulation ({}): {} evaluation(s), predicted {} layer(s){}"
             .format(preflight.get("backend", "onnxruntime"), preflight.get("evaluations"),
                     len(keep), ": " + _short(", ".join(keep), 200) if keep else "")]
    for row in rows:
        search = row.get("search") or {}
        if not search:
            continue
        passed = search.get("prediction_passed")  # the device's word: only True/False count
        verdict = "verified with one build" if passed is True else \
            "the prediction failed, searched" if passed is False else "not verified"
        lines.append("  {}: {}; {} device evaluation(s)".format(
            row["device"], verdict, search.get("evaluations")))
    return "\n".join(lines)


def summary_line(rollout: Rollout) -> str:
    counts = rollout.counts()
    parts = ["{} {}".format(n, s) for s, n in sorted(counts.items())]
    text = "rollout {}: {} ({})".format(rollout.rollout_id, rollout.final_outcome(),
                                        ", ".join(parts))
    if rollout.reason:
        text += ": " + rollout.reason
    return text


def rollout_report(rollout: Rollout, statuses: Mapping[str, Mapping[str, Any]],
                   extra: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    report: Dict[str, Any] = {
        "rollout_id": rollout.rollout_id,
        "job_ids": rollout.job_ids,
        "outcome": rollout.final_outcome(),
        "reason": rollout.reason or None,
        "stages": rollout.stages,
        "policy": rollout.policy._asdict(),
        "counts": rollout.counts(),
        "gate": rollout.gate,
        "devices": [result_row(r, statuses.get(r.device), rollout.gate)
                    for r in rollout.ordered()],
    }
    report.update(extra or {})
    return report


# ============================================================================ live progress

class ProgressView(object):
    """Per-device progress on stderr: bars redrawn in place on a terminal, a line per change
    otherwise (so logs stay readable)."""

    def __init__(self, stream: Optional[IO[str]] = None, enabled: bool = True,
                 tty: Optional[bool] = None, min_interval: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = (hasattr(self.stream, "isatty") and self.stream.isatty()) if tty is None \
            else tty
        self.min_interval = min_interval
        self.clock = clock
        self.t0 = clock()
        self._drawn = 0
        self._last_draw = 0.0
        self._seen: Dict[str, Any] = {}

    @staticmethod
    def describe(run: DeviceRun, status: Optional[Mapping[str, Any]]) -> str:
        what = run.state
        if run.phase and not run.terminal and run.state != PENDING:
            what += " " + run.phase
        if run.job_stage and not run.terminal:
            what += ": " + run.job_stage
        if status is not None and status.get("online") is False and not run.terminal:
            what += " (device offline)"
        return what

    def _bar(self, run: DeviceRun) -> str:
        p = run.progress or {}
        done, of = int(p.get("done") or 0), int(p.get("of") or 0)
        if run.terminal or of <= 0:
            return ""
        width = 20
        fill = int(width * min(done, of) / of)
        return " [{}{}] {}/{}".format("#" * fill, "." * (width - fill), done, of)

    def update(self, rollout: Rollout, statuses: Mapping[str, Mapping[str, Any]],
               force: bool = False) -> None:
        if not self.enabled:
            return
        runs = rollout.ordered()
        if self.tty:
            now = self.clock()
            if not force and now - self._last_draw < self.min_interval:
                return
            self._last_draw = now
            width = max(len(r.device) for r in runs)
            lines = ["{} stage {}/{}  {:.0f} s".format(
                rollout.rollout_id, max(rollout.current + 1, 1), len(rollout.stages),
                now - self.t0)]
            for r in runs:
                lines.append("  {}  {}{}".format(r.device.ljust(width),
                                                 self.describe(r, statuses.get(r.device)),
                                                 self._bar(r)))
            out = "\x1b[{}F".format(self._drawn) if self._drawn else ""
            out += "".join("\x1b[2K" + line + "\n" for line in lines)
            self.stream.write(out)
            self._drawn = len(lines)
        else:
            for r in runs:
                p = r.progress or {}
                finished = bool(p.get("of")) and p.get("done") == p.get("of")
                key = (r.state, r.phase, r.job_stage, finished,
                       (statuses.get(r.device) or {}).get("online"))
                if self._seen.get(r.device) == key:
                    continue
                self._seen[r.device] = key
                self.stream.write("[{:6.1f}s] {}: {}{}\n".format(
                    self.clock() - self.t0, r.device, self.describe(r, statuses.get(r.device)),
                    self._bar(r) if finished else ""))
        self.stream.flush()


def share_of(run: Any, result: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """Engine sharing: whether the device built its engine or adopted its class's, and why
    it fell back (the device's reason, or the controller's: no engine came)."""
    from agent.fleet.transfer.sharing import share_summary

    return share_summary(getattr(run, "share", None) or {}, result.get("share"))

