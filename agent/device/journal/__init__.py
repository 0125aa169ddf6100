"""The journal: the daemon's durable state in one SQLite file. ``store`` (the ``Journal``:
jobs, boot counter, the parts below wired in), ``schema`` (tables, opening, migrations),
``models`` (named models: active, pending, kept versions), ``outbox`` (messages kept until
the broker acknowledges them) and ``transfers`` (partial downloads and their bitmaps)."""
