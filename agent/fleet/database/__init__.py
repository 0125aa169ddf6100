"""The fleet database: one SQL adapter over SQLite and PostgreSQL (``db``), the source of truth
(``store``: devices, rollouts, jobs, artifacts, signing sequence, outbox), the schema declared
once (``tables``, SQLAlchemy Core), its Alembic revisions (``migrations/``) and how a database
gets there (``migrate``), the revision at open in plain SQL (``store_schema``), telemetry history
(``history``) and the models each device holds (``device_models``).

May import: nothing else of ``agent.fleet``; the base modules and ``wire``. Only ``tables``,
``migrate`` and ``migrations/`` import SQLAlchemy and Alembic, lazily
(tests/unit/test_import_rules.py).
"""
