"""The app's donated inputs at work on the device (docs/using-models.md, "Live inputs"):

- **The live check before commit.** A new version of a name, while a committed one runs and at
  least ``models.live_check.min_samples`` donated rows exist, is run beside the running one on
  them (``agent.precision.live.live_check``); the figures come back to the main loop as a
  ``live`` event and are one more confirmation the pending version needs (``commit_logic``):
  below the thresholds it is refused (``live_check_failed``) and rolled back. Without
  samples, or with nothing running, the check is skipped and says why. The figures (or the
  reason) go into the version's meta.json, so a version still pending after a restart takes
  its recorded end back (``recorded``) or, when the restart cut the check short, runs it
  again before it can commit.
- **INT8 ranges in the field.** Every ``every_s``, one committed INT8 version at a time with
  donated rows and a calibration cache (when a donation came or the version changed since
  its last figures): its clipping rates and input drift
  (``agent.precision.live.field_ranges``), kept per name (``field.json`` beside the samples),
  in telemetry (``int8_clip_rate.<name>``, ``int8_input_drift.<name>``) and, above
  ``max_clip_rate`` or with an input drifted beyond ``max_drift``, the name's
  ``calibration_stale`` problem naming the tensors and inputs (gone again once the figures
  of newer donations are back within both).

Each runs in a child process (``python -m agent.worker.live``, the ``worker_python``), waited
for on a thread: the daemon loads no runtime, no model and no numpy for it, keeps serving
while it runs, and gets the memory back after it.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from agent.device.models.directory import CALIBRATION, ENGINE, ONNX, ModelsDir, read_meta
from agent.device.models.live_samples import SampleStore
from agent.device.worker_supervisor import worker_env
from agent.fsio import state_dir as default_state_dir

log = logging.getLogger("agent.device.daemon")  # one logger name for the whole daemon

Post = Callable[..., None]  # post(token, kind, value, error=None): a SwitchEvent to the loop
CHILD_TIMEOUT_S = 600.0  # a check's child process at most (a pending one: its deadline first)
MAX_REPLY = 4 << 20
# What a refusal read back after a restart needs (``switch_machine``'s note_live action).
RECORDED = ("samples", "agreement", "error", "error_stat", "min_agreement", "max_error", "worst")


def child(python: str, state_dir: str, request: Dict[str, Any],
          timeout: float = CHILD_TIMEOUT_S) -> Any:
    """Run ``agent.worker.live`` on ``request``; its figures, or RuntimeError saying why not."""
    try:
        out = subprocess.run([python, "-m", "agent.worker.live"],
                             input=json.dumps(request).encode("utf-8"), capture_output=True,
                             timeout=timeout, env=worker_env(state_dir), cwd=state_dir,
                             start_new_session=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(str(exc)[:300])
    lines = out.stdout[-MAX_REPLY:].decode("utf-8", "replace").strip().splitlines()
    try:
        reply = json.loads(lines[-1])
    except (IndexError, ValueError):
        raise RuntimeError("exit {}: {}".format(out.returncode, out.stderr.decode(
            "utf-8", "replace").strip()[-300:]))
    if not reply.get("ok"):
        error = reply.get("error") or {}
        raise RuntimeError("{}: {}".format(error.get("code"), error.get("message")))
    return reply["figures"]


def fixed_batch(meta: Dict[str, Any]) -> Optional[int]:
    """The engine's fixed batch (the first input's first dimension), None when dynamic."""
    shape = ((meta.get("inputs") or [{}])[0].get("shape") or [None])
    first = shape[0] if shape else None
    return first if isinstance(first, int) and not isinstance(first, bool) and first > 0 \
        else None


def _distance(figures: Dict[str, Any], name: str) -> str:
    """``input 0.39``: a drifted input with its histogram distance."""
    d = (((figures.get("inputs") or {}).get(name) or {}).get("drift") or {}).get("hist_distance")
    return "{} {:.2f}".format(name, d) if isinstance(d, (int, float)) else name


class LiveCheck(object):
    def __init__(self, cfg: Any, models: ModelsDir, post: Post) -> None:
        self.lc = cfg.models.live_check
        self.backend = cfg.backend
        self.python = cfg.worker_python or sys.executable
        self.state_dir = cfg.state_dir or default_state_dir()
        self.models, self.post = models, post
        self.samples = SampleStore.for_config(cfg)
        self.field: Dict[str, Dict[str, Any]] = {}
        self.next_field = time.monotonic() + self.lc.every_s
        self.field_running = False
        self.cursor = 0  # which INT8 name the next field check looks at
        self.measured: Dict[str, Any] = {}  # name -> (version, newest donation) measured

    # -- before commit -----------------------------------------------------------------------
    def skip_reason(self, name: str, running: Optional[str]) -> Optional[str]:
        """Why the live check does not run for a new version of ``name`` (None: it runs)."""
        if not self.lc.enabled:
            return "models.live_check.enabled is false"
        if running is None:
            return "no committed version runs to compare with"
        have = self.samples.count(name)
        if have < self.lc.min_samples:
            return "{} donated samples, fewer than models.live_check.min_samples ({})".format(
                have, self.lc.min_samples)
        return None

    def recorded(self, name: str, version: str) -> Optional[Dict[str, Any]]:
        """The version's live check as its meta.json recorded it (``_note_live``: the figures,
        or why it was skipped); None when none ended (a restart cut the check short)."""
        try:
            f = read_meta(self.models.version_dir(name, version)).get("live_check")
        except (OSError, ValueError):
            return None
        if not isinstance(f, dict) or not (isinstance(f.get("skipped"), str) or (
                isinstance(f.get("passed"), bool) and all(k in f for k in RECORDED))):
            return None
        return f

    def start(self, token: int, name: str, version: str, running: str) -> None:
        new_dir = self.models.version_dir(name, version)
        old_dir = self.models.version_dir(name, running)
        lc = self.lc

        def work() -> None:
            try:
                meta = read_meta(new_dir)
                figures = child(self.python, self.state_dir, {
                    "op": "check", "new": os.path.join(new_dir, ENGINE),
                    "running": os.path.join(old_dir, ENGINE),
                    "backend": str(meta.get("backend") or self.backend),
                    "samples": self.samples.newest(name), "keep": self.samples.keep,
                    "batch": fixed_batch(meta), "min_agreement": lc.min_agreement,
                    "max_error": lc.max_error, "error_stat": lc.error_stat})
                figures["running"] = running
                self.post(token, "live", figures)
            except Exception as exc:  # noqa: BLE001 - a check that cannot run refuses nothing
                log.warning("model %s@%s: live check could not run: %s", name, version, exc)
                self.post(token, "live", {"skipped": "the check could not run: {}".format(
                    str(exc)[:300])}, error=str(exc)[:300])

        threading.Thread(target=work, name="live-check", daemon=True).start()

    # -- in the field --------------------------------------------------------------------------
    def note_calibration_set(self, name: str, version: str, path: str) -> None:
        """The calibration set's input statistics into the version's meta.json
        (``calibration_inputs``): the field's drift is measured against them."""
        try:
            stats = child(self.python, self.state_dir, {"op": "calibration", "path": path})
            if stats:
                self.models.update_meta(name, version, {"calibration_inputs": stats})
        except Exception as exc:  # noqa: BLE001 - the drift figure goes, the version stays
            log.warning("model %s@%s: no calibration statistics: %s", name, version, exc)

    def tick(self, committed: Callable[[], List[Dict[str, Any]]]) -> None:
        """``committed()``: the journal's committed active versions (asked only when due)."""
        if not self.lc.enabled or self.field_running or time.monotonic() < self.next_field:
            return
        self.next_field = time.monotonic() + self.lc.every_s
        int8 = [r for r in committed() if r.get("precision") == "int8" and os.path.isfile(
            os.path.join(self.models.version_dir(r["name"], r["version"]), CALIBRATION))]
        for name in list(self.field):  # a name no longer INT8 (or gone) has no figures
            if name not in {r["name"] for r in int8}:
                del self.field[name]
        for r in int8:  # after a restart: the last figures until new ones are measured
            if r["name"] not in self.field:
                kept = self.samples.read_field(r["name"])
                if kept is not None and kept.get("version") == r["version"] and \
                        isinstance(kept.get("stale"), list) and \
                        all(isinstance(kept.get(k), (int, float))
                            for k in ("clip_max", "max_clip_rate", "samples")):
                    self.field[r["name"]] = kept
        if not int8:
            return
        row = int8[self.cursor % len(int8)]
        self.cursor += 1
        name, path = row["name"], self.models.version_dir(row["name"], row["version"])
        samples = self.samples.newest(name)
        seen = (row["version"], samples[0] if samples else None)
        if not samples or self.measured.get(name) == seen:
            return  # nothing new since the last figures: no child process for the same ones
        self.measured[name] = seen
        lc = self.lc
        self.field_running = True

        def work() -> None:
            figures: Optional[Dict[str, Any]] = None
            try:
                meta = read_meta(path)
                figures = child(self.python, self.state_dir, {
                    "op": "field", "onnx": os.path.join(path, ONNX),
                    "cache": os.path.join(path, CALIBRATION), "samples": samples,
                    "keep": self.samples.keep, "batch": fixed_batch(meta),
                    "max_clip_rate": lc.max_clip_rate, "max_drift": lc.max_drift,
                    "reference": meta.get("calibration_inputs")})
                figures.update(version=row["version"], at=time.time())
            except Exception as exc:  # noqa: BLE001 - tried again at the next period
                log.warning("model %s: INT8 range check failed: %s", name, exc)
            self.post(0, "field", (name, figures))

        threading.Thread(target=work, name="live-field", daemon=True).start()

    def on_field(self, name: str, figures: Optional[Dict[str, Any]]) -> bool:
        """A field check's figures (main loop); True when the name's problem changed."""
        self.field_running = False
        if figures is None:
            return False
        before = self.problem(name)
        self.field[name] = figures
        try:
            self.samples.write_field(name, figures)
        except OSError as exc:
            log.warning("model %s: cannot keep the INT8 range figures: %s", name, exc)
        if self.problem(name) and before is None:
            log.warning("model %s: %s", name, self.problem(name))
        return self.problem(name) != before

    def _figures(self, name: str, version: Optional[str]) -> Optional[Dict[str, Any]]:
        """The name's last figures, if they are of ``version`` (None: whichever)."""
        f = self.field.get(name)
        return f if f is not None and version in (None, f.get("version")) else None

    def problem(self, name: str, version: Optional[str] = None) -> Optional[str]:
        """``calibration_stale: ...`` while the figures of ``version`` name stale tensors or
        drifted inputs."""
        f = self._figures(name, version) or {}
        stale, drifted = f.get("stale") or [], f.get("drifted") or []
        parts = []
        if stale:
            parts.append("{:.1%} of activations beyond the calibrated range (more than {:.1%}) "
                         "in {}".format(f["clip_max"], f["max_clip_rate"], ", ".join(stale[:8])))
        if drifted:
            parts.append("inputs drifted from the calibration set (histogram distance beyond "
                         "{:g}) in {}".format(f.get("max_drift") or 0.0, ", ".join(
                             _distance(f, n) for n in drifted[:8])))
        return "calibration_stale: " + "; ".join(parts) if parts else None

    def summary(self, name: str, version: Optional[str] = None) -> Optional[Dict[str, Any]]:
        """What the models message carries of the field figures (small)."""
        f = self._figures(name, version)
        if f is None:
            return None
        return {"clip_max": round(float(f["clip_max"]), 6), "stale": f["stale"][:8],
                "drifted": (f.get("drifted") or [])[:8], "samples": f["samples"],
                "version": f.get("version")}

    def forget(self, name: str) -> None:
        """A removed name: its donated inputs and its figures go."""
        self.field.pop(name, None)
        self.measured.pop(name, None)
        shutil.rmtree(self.samples.dir(name), ignore_errors=True)

    def telemetry(self) -> Dict[str, Any]:
        """Per INT8 name: its worst tensor's clipping rate and its inputs' largest histogram
        distance from the calibration set (where that was measured)."""
        out: Dict[str, Any] = {}
        for n, f in sorted(self.field.items())[:64]:
            out["int8_clip_rate.{}".format(n)] = round(float(f["clip_max"]), 6)
            drift = [d for d in (((i or {}).get("drift") or {}).get("hist_distance")
                                 for i in (f.get("inputs") or {}).values())
                     if isinstance(d, (int, float))]
            if drift:
                out["int8_input_drift.{}".format(n)] = round(float(max(drift)), 6)
        return out
