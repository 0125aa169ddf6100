"""Pure rollout policy: which devices, in which stages, and when to stop.

- target selection (``select_devices``) and staging (``plan_stages``: ``--batch N`` or
  ``--percent P`` devices per stage, in the order given);
- ``abort_reason`` (AWS IoT Jobs abort criteria: once at least ``min_executed`` devices have
  finished, stop when more than ``abort_failure_rate`` of them FAILED / REJECTED / TIMED_OUT)
  and ``stage_verdict`` (hawkBit-style success threshold: the next stage starts once enough
  devices of the current one SUCCEEDED; a stage that can no longer reach it halts the rollout).
"""

import fnmatch
import math
from typing import Any, Iterable, List, NamedTuple, Optional, Sequence

from agent.errors import AgentError
from agent.wire import protocol

FAILURE_STATES = frozenset(("FAILED", "REJECTED", "TIMED_OUT"))
EXECUTED_STATES = FAILURE_STATES | {"SUCCEEDED"}


# ============================================================================ targets and stages

def select_devices(known: Iterable[str], ids: Optional[Sequence[str]] = None,
                   all_devices: bool = False, pattern: Optional[str] = None) -> List[str]:
    """The targeted device ids. ``known``: ids with a retained status (online or not).
    Explicit ids keep their order (duplicates dropped); ``--all`` / ``--match`` are sorted.
    AgentError unknown_device when an id has never reported or nothing matches."""
    known_set = set(known)
    chosen = [bool(ids), bool(all_devices), pattern is not None]
    if sum(chosen) != 1:
        raise AgentError("bad_argument", "name the target devices with exactly one of "
                         "--devices ID..., --all or --match PATTERN")
    if ids:
        out: List[str] = []
        for dev in ids:
            if not protocol.valid_id(dev):
                raise AgentError("bad_argument", "device id must be 1-64 characters of "
                                 "[A-Za-z0-9._-], found {!r}".format(dev))
            if dev not in out:
                out.append(dev)
        unknown = [d for d in out if d not in known_set]
        if unknown:
            raise AgentError("unknown_device", "device(s) {} never reported to this broker "
                             "(no retained status); known devices: {}".format(
                                 ", ".join(unknown), ", ".join(sorted(known_set)) or "none"),
                             {"unknown": unknown, "known": sorted(known_set)})
        return out
    if all_devices:
        if not known_set:
            raise AgentError("unknown_device", "no device has reported to this broker yet "
                             "(no retained status under the topic prefix)")
        return sorted(known_set)
    matched = sorted(d for d in known_set if fnmatch.fnmatchcase(d, pattern or ""))
    if not matched:
        raise AgentError("unknown_device", "no known device matches {!r}; known devices: "
                         "{}".format(pattern, ", ".join(sorted(known_set)) or "none"))
    return matched


def plan_stages(devices: Sequence[str], batch: Optional[int] = None,
                percent: Optional[float] = None) -> List[List[str]]:
    """Split ``devices`` into consecutive stages of ``batch`` devices, or of ``percent`` % of
    them (rounded up, at least one); neither: one stage with every device."""
    if batch is not None and percent is not None:
        raise AgentError("bad_argument", "give --batch or --percent, not both")
    if not devices:
        raise AgentError("bad_argument", "a rollout needs at least one device")
    size = len(devices)
    if batch is not None:
        if int(batch) < 1:
            raise AgentError("bad_argument", "--batch must be >= 1, found {}".format(batch))
        size = int(batch)
    elif percent is not None:
        if not 0 < float(percent) <= 100:
            raise AgentError("bad_argument", "--percent must be in (0, 100], found {}".format(
                percent))
        size = max(1, int(math.ceil(len(devices) * float(percent) / 100.0 - 1e-9)))
    return [list(devices[i:i + size]) for i in range(0, len(devices), size)]


class Policy(NamedTuple):
    success_threshold: float = 1.0  # fraction of a stage that must succeed before the next
    abort_failure_rate: Optional[float] = None  # None: never abort on failures
    min_executed: int = 1  # finished devices needed before the abort rate is judged


def check_policy(policy: Policy) -> Policy:
    if not 0 < policy.success_threshold <= 1:
        raise AgentError("bad_argument", "--success-threshold must be in (0, 1], found {}"
                         .format(policy.success_threshold))
    if policy.abort_failure_rate is not None and not 0 <= policy.abort_failure_rate < 1:
        raise AgentError("bad_argument", "--abort-failure-rate must be in [0, 1), found {}"
                         .format(policy.abort_failure_rate))
    if policy.min_executed < 1:
        raise AgentError("bad_argument", "--min-executed must be >= 1, found {}".format(
            policy.min_executed))
    return policy


def abort_reason(states: Iterable[str], policy: Policy) -> Optional[str]:
    """Why the rollout must stop now, or None. Only devices that ran to an end count."""
    if policy.abort_failure_rate is None:
        return None
    executed = [s for s in states if s in EXECUTED_STATES]
    failed = [s for s in executed if s in FAILURE_STATES]
    if len(executed) < policy.min_executed or not failed:
        return None
    rate = len(failed) / float(len(executed))
    if rate <= policy.abort_failure_rate:
        return None
    return ("failure rate {}/{} = {:.0%} exceeds the abort threshold {:.0%} (after {} "
            "finished, minimum {})".format(len(failed), len(executed), rate,
                                           policy.abort_failure_rate, len(executed),
                                           policy.min_executed))


def stage_verdict(states: Sequence[str], policy: Policy) -> str:
    """"passed" once enough of the stage SUCCEEDED, "failed" once it can no longer get there,
    else "running"."""
    need = int(math.ceil(policy.success_threshold * len(states) - 1e-9))
    succeeded = sum(1 for s in states if s == "SUCCEEDED")
    open_ = sum(1 for s in states if not protocol.is_terminal(s))
    if succeeded >= need:
        return "passed"
    if succeeded + open_ < need:
        return "failed"
    return "running"


def failure_cause(runs: Sequence[Any]) -> str:
    """Which devices' own failures stopped the rollout, and why (the first in full)."""
    failed = [r for r in runs if r.terminal and r.state != "SUCCEEDED" and not r.local]
    if not failed:
        return ""
    first = failed[0]
    err = first.error or {}
    why = "{} {}".format(first.device, first.state)
    if err.get("code"):
        why += " ({}: {})".format(err["code"], str(err.get("message") or "")[:160])
    if len(failed) > 1:
        why += " and {} more ({})".format(len(failed) - 1, ", ".join(
            "{} {}".format(r.device, r.state) for r in failed[1:4]) + (
                ", ..." if len(failed) > 4 else ""))
    return why
