"""The device side: the daemon and everything only it uses (Python >= 3.8).

Owns the daemon (``daemon``: the main loop, and ``assemble``, the one place its parts are wired)
and its parts, each handed its collaborators in its constructor, none inheriting from another:
``jobs/`` (``intake``: documents in, validated, queued; ``scheduler``: the next job checked;
``run``: the job in hand; ``end``: how any job ends), ``artifact_downloads``,
``worker_supervisor`` (with ``worker_process``, the worker as an OS process),
``status_publisher`` (the outbox, birth status), ``telemetry_publisher``, ``device_commands``;
``daemon_state`` (the little they share). Also the SQLite ``journal/``, ``models/`` (the models
directory, the switch into named versions, commit and rollback, sets, live inputs), ``app/``
(the app socket), ``handoff/`` (Triton, DeepStream, a command), the YAML ``config``, device
``telemetry``, ``sdnotify``, the per-state-dir ``state_lock`` and the start-up
``backend_check``.

May import: ``wire``, ``engines``, ``precision``, ``platform``, ``worker`` (the job spec it
hands the subprocess) and the base modules (``errors``, ``fsio``, ``log``, ``progress``).
Never ``fleet`` or ``cli``; nothing heavy at import time (numpy and the backends live in the
worker). tests/unit/test_import_rules.py enforces the direction.
"""
