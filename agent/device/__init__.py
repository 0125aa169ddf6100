"""The device side: the daemon and everything only it uses (Python >= 3.8).

Owns the daemon (``daemon``: the main loop, and ``assemble``, the one place its parts are wired)
and its parts, each handed its collaborators in its constructor, none inheriting from another:
``job_intake`` (documents in, validated, queued; cancels), ``job_scheduler`` (the next job
checked), ``artifact_downloads``, ``worker_supervisor`` (with ``worker_process``, the worker as an
OS process), ``job_end`` (how any job ends), ``status_publisher`` (the outbox, birth status),
``telemetry_publisher``, ``device_commands`` and ``engine_rollback``; ``daemon_state`` (the
little they share) and ``job_run`` (the job in hand). Also the SQLite ``journal``, the YAML
``config``, device ``telemetry``, ``sdnotify``, the per-state-dir ``state_lock`` and the start-up
``backend_check``.

May import: ``wire``, ``engines``, ``precision``, ``platform``, ``worker`` (the job spec it
hands the subprocess) and the base modules (``errors``, ``fsio``, ``log``, ``progress``).
Never ``fleet`` or ``cli``; nothing heavy at import time (numpy and the backends live in the
worker). tests/unit/test_import_rules.py enforces the direction.
"""
