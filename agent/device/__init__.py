"""The device side: the daemon and everything only it uses (Python >= 3.8).

Owns the daemon (``daemon``, with its parts: ``job_intake``, ``artifact_downloads``,
``worker_supervisor``, ``status_publisher``, ``device_commands``, ``engine_rollback``, the shared
``daemon_state`` and the current ``job_run``), the SQLite ``journal``, the YAML ``config``,
device ``telemetry``, ``sdnotify``, the per-state-dir ``state_lock`` and the start-up
``backend_check``.

May import: ``wire``, ``engines``, ``precision``, ``platform``, ``worker`` (the job spec it
hands the subprocess) and the base modules (``errors``, ``fsio``, ``log``, ``progress``).
Never ``fleet`` or ``cli``; nothing heavy at import time (numpy and the backends live in the
worker). tests/unit/test_import_rules.py enforces the direction.
"""
