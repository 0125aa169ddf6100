"""The controller's commands: what ``jetson-agent fleet ...`` does, as functions that take
plain typed arguments (never an argparse namespace) and return data or raise ``AgentError``;
``agent.cli.fleet_*`` only builds the parsers, calls these and prints. One module per command
family: ``db`` (which database and artifact store, whether a service is up on it, the schema's
migrations), ``admission`` (the policy a controller hears devices by), ``rollback``, ``serve``
(``fleet serve``'s start-up and loop), ``rollout_run`` (``fleet rollout`` submitted to a
service or embedded, and followed), ``rollouts`` (``fleet rollouts``), ``deploy``
(``fleet deploy|deployments|pin|unpin|label``), ``models`` (``fleet models``), ``engines``
(``fleet engines``), ``jobs`` (``fleet cancel``, the jobs retained on the broker),
``devices`` (``fleet devices ls``), ``telemetry`` (``fleet telemetry``).

May import every other subpackage of ``agent.fleet`` and the wiring (``service``,
``mqtt_edge``), plus ``wire``, ``engines``, ``precision``, ``platform``, ``calib`` and the base
modules; nothing in ``agent.fleet`` imports ``commands``, and nothing here imports ``cli`` or
argparse (tests/unit/test_import_rules.py).
"""
