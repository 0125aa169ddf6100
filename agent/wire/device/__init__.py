"""The wire modules only a device imports: the controller (agent/fleet/, the fleet CLI) never
does, not even through another wire module (tests/unit/test_import_rules.py enforces it).
Resumable block ``transfer`` (with ``block_assembly`` and ``http_fetch``), the
content-addressed ``artifacts`` store, ``job_semantics`` (a job document beyond its schema),
``limits`` (the daemon's rate limits and byte-bounded event queue) and ``security_posture``
(diag's view of the device's security settings). May import the rest of agent/wire/."""
