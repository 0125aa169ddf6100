"""The messages that report state: a device's status (birth, Last Will, and whether one is
stale), a job's status, a command's reply (Python >= 3.8).

Pure builders, shared by the device daemon, the simulators and the controller's checks, so
every sender produces one shape; each result stays within its topic's ``MAX_BYTES``.
"""

from typing import Any, Dict, List, Mapping, Optional

from agent.wire import message_caps as caps
from agent.wire.protocol import MAX_BYTES, PROTOCOL_VERSION, Publication, encode
from agent.wire.topics import Topics


def status_is_stale(last_boot: Optional[int], msg: Mapping[str, Any]) -> bool:
    """Whether a device status (birth or Will) is older than the newest boot seen: a late Will
    from a previous connection must not mark a restarted device offline."""
    boot = msg.get("boot")
    if not isinstance(boot, int) or isinstance(boot, bool):
        return True
    return last_boot is not None and boot < last_boot


def status_message(
    device: str,
    online: bool,
    boot: int,
    agent_version: Optional[str] = None,
    platform: Optional[Mapping[str, Any]] = None,
    active_engines: Optional[List[Mapping[str, Any]]] = None,
    reason: Optional[str] = None,
    ts: Optional[float] = None,
) -> Dict[str, Any]:
    msg: Dict[str, Any] = {"protocol": PROTOCOL_VERSION, "device": device, "online": online,
                           "boot": boot}
    if ts is not None:
        msg["ts"] = ts
    if agent_version is not None:
        msg["agent_version"] = agent_version
    if platform is not None:
        msg["platform"] = dict(platform)
    if active_engines is not None:
        keys = ("model", "engine_key", "precision", "activated", "job_id")
        msg["active_engines"] = [{k: e.get(k) for k in keys if e.get(k) is not None}
                                 for e in active_engines]
    if reason is not None:
        msg["reason"] = reason
    return msg


def will_message(device: str, boot: int, platform: Optional[Mapping[str, Any]] = None
                 ) -> Dict[str, Any]:
    """The Last Will: offline, with the boot counter of the connection it belongs to (and
    the platform, so an offline device keeps its board in ``fleet devices``)."""
    return status_message(device, False, boot, reason="connection_lost", platform=platform)


def job_status_message(device: str, row: Mapping[str, Any],
                       ts: Optional[float] = None) -> Dict[str, Any]:
    """The job status message for a ``Journal.job()`` row, within ``MAX_BYTES["job_status"]``
    by construction (``agent.wire.message_caps``: long texts cut, long lists summarised)."""
    details = {str(k): str(v) for k, v in (row.get("details") or {}).items()}
    msg: Dict[str, Any] = {
        "protocol": PROTOCOL_VERSION,
        "job_id": row["job_id"],
        "device": device,
        "kind": row.get("kind") or "",
        "state": row["state"],
        "version": row["version"],
        "ts": row.get("updated") if ts is None else ts,
    }
    if row.get("stage"):
        msg["stage"] = row["stage"]
        details.setdefault("stage", row["stage"])
    if row.get("progress"):
        msg["progress"] = {"done": row["progress"]["done"], "of": row["progress"]["of"]}
    if row.get("error"):
        msg["error"] = caps.fit_error(row["error"])
        details.setdefault("error_code", str(row["error"].get("code")))
    if row.get("result") is not None:
        msg["result"] = row["result"]
    msg["statusDetails"] = caps.fit_details(details)
    if msg["ts"] is None:
        del msg["ts"]
    limit = MAX_BYTES["job_status"] - caps.ENVELOPE
    try:
        return caps.fit_message("job_status", msg, limit, keep=(
            "protocol", "job_id", "device", "kind", "state", "version", "ts", "stage",
            "progress", "statusDetails"))
    except ValueError:
        return caps.short_job_status(msg)


def job_status_publication(topics: Topics, device: str, row: Mapping[str, Any]) -> Publication:
    """Retained QoS 1 job status for the outbox (``Journal.set_state(..., emit=...)``)."""
    return Publication(topics.job_status(device, row["job_id"]),
                       encode(job_status_message(device, row)), 1, True)


def command_reply(
    device: str,
    command: Mapping[str, Any],
    ok: bool,
    result: Optional[Mapping[str, Any]] = None,
    error: Optional[Mapping[str, Any]] = None,
) -> Dict[str, Any]:
    """Reply to a command; echoes its request_id and correlation."""
    name = command.get("command")
    msg: Dict[str, Any] = {"protocol": PROTOCOL_VERSION, "device": device,
                           "command": name if isinstance(name, str) else "", "ok": ok}
    for key in ("request_id", "correlation"):
        if isinstance(command.get(key), str):
            msg[key] = command[key]
    if result is not None:
        msg["result"] = dict(result)
    if error is not None:
        msg["error"] = dict(error)
    return msg
