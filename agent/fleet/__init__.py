"""Controller side of a fleet: device directory, staged rollouts, block serving, results.

Speaks only the protocol of docs/protocol.md. Organised by concern, in subpackages (each one's
docstring says what it owns and may import; tests/unit/test_import_rules.py keeps them free of
circles):

- ``database``: the fleet database (``db``, ``store``, ``store_schema``, ``tables``,
  ``migrate``, ``migrations/``, ``history``, ``device_models``);
- ``rollouts``: the pure ``policy``, ``rollout`` state machine, ``device_run``, ``documents``,
  ``preview``, ``report``, ``signing_check``, and the durable ``spec``, ``durable``,
  ``rollback``, ``rollback_log``;
- ``deployments``: desired state (``registry``, ``labels``, ``selectors``, ``deployments``,
  ``deployment_runner``);
- ``admission``: what the controller hears from devices (``admission``, ``rollcall``,
  ``bounds``);
- ``transfer``: artifact transfer (``bytequeue``, ``http_bounds``, ``http_source``,
  ``sharing``);
- ``web``: the dashboard and ``/metrics`` (``server``, ``pages``, ``views``, ``metrics``);
- ``commands``: what ``jetson-agent fleet ...`` does, as functions of plain arguments that
  return data (the CLI parses and prints); the only subpackage that may use the wiring.
- ``parts``: the parts ``fleet serve`` is composed of (intake, registry, admission,
  deployments, adoption, rollout driver, outbox, artifacts, engine sharing, rereading).

The wiring stays here: ``mqtt_edge`` (``FleetConnection`` and ``discover``, the MQTT I/O edge)
and ``service`` (``assemble`` wires the parts; ``FleetService``, the main loop: ``fleet serve``,
and ``fleet rollout`` embedded).

Callers import every name from ``agent.fleet``; the submodules are how it is organised.

May import: ``wire``, ``engines``, ``precision``, ``platform``, ``calib`` and the base modules;
never ``worker`` or ``cli`` (nor argparse), and ``device`` only in the crossing listed in
tests/unit/test_import_rules.py (``mqtt_edge`` -> ``device.config``), to be moved.
"""

from agent.fleet.mqtt_edge import DeviceDirectory, FleetConnection, discover
from agent.fleet.rollouts.device_run import PENDING, DeviceRun
from agent.fleet.rollouts.documents import (
    LAYER_RANK,
    job_document,
    layers_above,
    new_rollout_id,
    prepare_rollout,
)
from agent.fleet.rollouts.policy import (
    EXECUTED_STATES,
    FAILURE_STATES,
    Policy,
    abort_reason,
    check_policy,
    plan_stages,
    select_devices,
    stage_verdict,
)
from agent.fleet.rollouts.report import (
    ProgressView,
    accuracy_summary,
    format_table,
    preflight_summary,
    result_row,
    results_table,
    rollout_report,
    summary_line,
)
from agent.fleet.rollouts.rollout import (
    MAX_ROLLOUT_ID,
    SEARCH_SUFFIX,
    Action,
    DocFactory,
    Rollout,
    check_rollout_id,
)
from agent.fleet.rollouts.spec import doc_factory

__all__ = [
    "EXECUTED_STATES", "FAILURE_STATES", "LAYER_RANK", "MAX_ROLLOUT_ID", "PENDING",
    "SEARCH_SUFFIX", "Action", "DeviceDirectory", "DeviceRun", "DocFactory", "FleetConnection",
    "Policy", "ProgressView", "Rollout", "abort_reason", "accuracy_summary", "check_policy",
    "check_rollout_id", "discover", "format_table", "job_document", "layers_above",
    "new_rollout_id", "plan_stages", "prepare_rollout", "result_row", "results_table",
    "rollout_report", "doc_factory", "select_devices", "stage_verdict", "summary_line",
    "preflight_summary",
]
