"""``fleet rollback``: make devices go back to a model's previous version. A device with the
feature ``named_models`` gets the command by name (``--name``; ``--version`` to go to a kept
version); an older device gets today's form, the model's sha256 (its journal keeps the active
and the previous engine of every model). Per device (``--device``; the model defaults to the
device's one model, from its retained models message or status) or per rollout (``--rollout``:
every device of a rollout in the fleet database that succeeded, the rollout's model).

Every rollback sent is recorded in the fleet database against the rollout it undoes
(``rollback_log``) when there is one (``--rollout``, ``--db``, or a service running on the
default database); the devices' replies complete the records, so the rollout's page shows it
rolled back, or the device's reason for refusing. Here: the commands (``command``, ``send``:
what the dashboard's button calls) and the plan for one device (``plan_one``), pure; the
targets and the round trip are agent.fleet.commands.rollback's.
"""

import uuid
from typing import Any, Dict, Mapping, Optional

from agent.errors import AgentError
from agent.fleet.database import device_models
from agent.wire import model_names, protocol


def command(model: Optional[str] = None, request_id: Optional[str] = None,
            name: Optional[str] = None, version: Optional[str] = None) -> Dict[str, Any]:
    """The rollback command: by ``name`` (and ``version``) for devices with the feature
    ``named_models``, else by the ``model``'s sha256."""
    cmd: Dict[str, Any] = {"protocol": protocol.PROTOCOL_VERSION, "command": "rollback",
                           "request_id": request_id or "r" + uuid.uuid4().hex[:10]}
    if name is not None:
        cmd["name"] = model_names.validate_name(name)
        if version is not None:
            cmd["version"] = model_names.validate_version(version)
    else:
        cmd["model"] = check_sha(str(model or ""))
    return cmd


def send(conn: Any, device: str, model: Optional[str] = None, name: Optional[str] = None,
         version: Optional[str] = None) -> str:
    """Publish the command (QoS 1: kept for an offline device's session); its request id."""
    protocol.check_id("device", device)
    cmd = command(model, name=name, version=version)
    conn.client.publish(conn.topics.commands(device), protocol.encode(cmd), qos=1)
    return str(cmd["request_id"])


def check_sha(model: str) -> str:
    if not protocol.valid_sha256(model):
        raise AgentError("bad_argument", "--model wants the model's sha256 (64 lower-case hex "
                         "digits), found {!r}".format(model[:80]))
    return model


def plan_one(device: str, status: Optional[Mapping[str, Any]],
             models: Optional[Mapping[str, Any]], name: Optional[str] = None,
             version: Optional[str] = None, model: Optional[str] = None,
             rollout_sha: Optional[str] = None) -> Dict[str, Any]:
    """What to send one device: {device, name, version, model} with either ``name`` (it lists
    ``named_models``) or ``model`` (it does not: today's form). Pure."""
    if device_models.named(status):
        held = device_models.entries(status, models)
        if name is None and model is not None:  # a sha given: the name that holds it
            name = next((m["name"] for m in held if m.get("model") == model), None) or \
                model_names.derived_name(model)
        if name is None:
            names = sorted({m["name"] for m in held})
            if len(names) != 1:
                raise AgentError("bad_argument", "device {} holds {} models ({}); choose one "
                                 "with --name NAME".format(device, len(names),
                                                           ", ".join(names) or "none"))
            name = names[0]
        return {"device": device, "name": name, "version": version, "model": None}
    if version is not None:
        raise AgentError("bad_argument", "device {} does not list the feature named_models "
                         "(an earlier release): it can only go back to the previous engine; "
                         "expected no --version, found {!r}".format(device, version))
    if model is None and rollout_sha is not None:
        model = rollout_sha
    if model is None:
        if status is None:
            raise AgentError("unknown_device", "device {} has no retained status on the broker; "
                             "give --model SHA256".format(device))
        shas = sorted({str(m["model"]) for m in device_models.entries(status, None)
                       if name is None or m["name"] == name})
        if len(shas) != 1:
            raise AgentError("bad_argument", "device {} does not list the feature named_models "
                             "(an earlier release) and has {} active engines{} ({}); choose "
                             "one with --model SHA256{}".format(
                                 device, len(shas), " named " + name if name else "",
                                 ", ".join(s[:12] for s in shas) or "none",
                                 " (or --rollout ID, or --db with the rollout that deployed "
                                 "it)" if name else ""))
        model = shas[0]
    return {"device": device, "name": None, "version": None, "model": check_sha(model)}
