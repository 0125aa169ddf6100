"""Controller side of a fleet: device directory, staged rollouts, block serving, results.

Speaks only the protocol of docs/protocol.md. The pure policy comes first, the I/O edge last:

- ``policy``: target selection (``select_devices``), staging (``plan_stages``), the abort
  criteria (``abort_reason``) and the stage success threshold (``stage_verdict``);
- ``documents``: job documents (``job_document``) and ``prepare_rollout``, what devices would
  refuse, checked on the controller before anything is published;
- ``rollout``: the ``Rollout`` state machine, fed job statuses, answering with ``Action``s;
  ``device_run``: its record of one device (``DeviceRun``);
- ``report``: the results (``result_row``, ``results_table``, ``rollout_report``) and the live
  progress view (``ProgressView``);
- ``mqtt_edge``: ``FleetConnection`` and ``discover``, the MQTT I/O edge;
- ``store`` (the database: devices, rollouts, jobs, history, artifacts, signing sequence,
  outbox; its tables declared in ``tables``, reached by the Alembic revisions of
  ``migrations/`` through ``migrate``, checked at open by ``store_schema``), ``device_models``
  (the models each device holds: named models, or an older daemon's active engines),
  ``rollback_log`` (rollbacks and the devices' answers, against their rollout), ``durable``
  (a ``Rollout`` saved and loaded), ``spec`` (a rollout's stored specification, its job
  documents), ``service`` (``FleetService``: ``fleet serve``, and ``fleet rollout``
  embedded), ``bytequeue`` (the event queue that never blocks paho).

Callers import every name from ``agent.fleet``; the submodules are how it is organised.

May import: ``wire``, ``engines``, ``precision``, ``platform``, ``calib`` and the base modules;
never ``worker``, and ``device``/``cli`` only in the two crossings listed in
tests/unit/test_import_rules.py (``mqtt_edge`` -> ``device.config``, ``rollback`` ->
``cli.fleet_db``), to be moved.
"""

from agent.fleet.device_run import PENDING, DeviceRun
from agent.fleet.documents import (
    LAYER_RANK,
    job_document,
    layers_above,
    new_rollout_id,
    prepare_rollout,
)
from agent.fleet.mqtt_edge import DeviceDirectory, FleetConnection, discover
from agent.fleet.policy import (
    EXECUTED_STATES,
    FAILURE_STATES,
    Policy,
    abort_reason,
    check_policy,
    plan_stages,
    select_devices,
    stage_verdict,
)
from agent.fleet.report import (
    ProgressView,
    accuracy_summary,
    format_table,
    preflight_summary,
    result_row,
    results_table,
    rollout_report,
    summary_line,
)
from agent.fleet.rollout import (
    MAX_ROLLOUT_ID,
    SEARCH_SUFFIX,
    Action,
    DocFactory,
    Rollout,
    check_rollout_id,
)
from agent.fleet.spec import doc_factory

__all__ = [
    "EXECUTED_STATES", "FAILURE_STATES", "LAYER_RANK", "MAX_ROLLOUT_ID", "PENDING",
    "SEARCH_SUFFIX", "Action", "DeviceDirectory", "DeviceRun", "DocFactory", "FleetConnection",
    "Policy", "ProgressView", "Rollout", "abort_reason", "accuracy_summary", "check_policy",
    "check_rollout_id", "discover", "format_table", "job_document", "layers_above",
    "new_rollout_id", "plan_stages", "prepare_rollout", "result_row", "results_table",
    "rollout_report", "doc_factory", "select_devices", "stage_verdict", "summary_line",
    "preflight_summary",
]
