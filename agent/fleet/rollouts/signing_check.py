"""Whether an unsigned rollout would reach its targets: each device says in its birth status
(``platform.requires_signed_jobs``) whether it drops unsigned job documents; ``fleet rollout``
without ``--signing-key`` refuses such targets at once (``signing_required``, with the fix)
instead of showing them QUEUED until the rollout's deadline. Devices of an earlier release say
nothing: a warning (their default is to require signatures)."""

from typing import Any, Dict, List, Mapping, Sequence, Tuple

from agent.errors import AgentError

SHOWN = 20


def split(statuses: Mapping[str, Any], devices: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(devices that require signed jobs, devices that do not say)."""
    required, unknown = [], []
    for dev in devices:
        status = statuses.get(dev)
        plat = (status or {}).get("platform") if isinstance(status, dict) else None
        flag = plat.get("requires_signed_jobs") if isinstance(plat, dict) else None
        if flag is True:
            required.append(dev)
        elif flag is not False:
            unknown.append(dev)
    return required, unknown


def check_unsigned(statuses: Mapping[str, Any], devices: Sequence[str]) -> List[str]:
    """AgentError signing_required when an unsigned rollout targets a device that requires
    signed jobs; else the targets that do not say (for a warning)."""
    required, unknown = split(statuses, devices)
    if required:
        names = ", ".join(sorted(required)[:SHOWN]) + (" ..." if len(required) > SHOWN else "")
        raise AgentError(
            "signing_required",
            "{} of {} target device(s) require signed jobs (their status says "
            "platform.requires_signed_jobs) and would drop these unsigned documents: {}; "
            "expected --signing-key KEY (a key from 'jetson-agent fleet keygen' whose .pub is in "
            "the devices' security.trusted_keys), found none; or leave those devices out "
            "(--devices / --match)".format(len(required), len(devices), names),
            {"devices": sorted(required)[:100], "count": len(required)})
    return unknown


def warning(unknown: Sequence[str]) -> str:
    return ("warning: {} target device(s) run an earlier release that does not say whether it "
            "requires signed jobs ({}{}); by default it does, and drops unsigned documents "
            "(they would stay QUEUED here until the deadline): sign with --signing-key".format(
                len(unknown), ", ".join(sorted(unknown)[:SHOWN]),
                " ..." if len(unknown) > SHOWN else ""))


def statuses_of(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """device -> status, from ``Store.devices()`` rows."""
    return {r["device"]: r.get("status") for r in rows}
