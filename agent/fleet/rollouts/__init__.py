"""Rollouts: the pure parts (``policy``: targets, stages, abort and success; ``rollout``: the
state machine; ``device_run``: its record of one device; ``documents``: job documents and the
checks done before publishing; ``preview``: the gate in words and ``--dry-run``; ``report``:
results and progress; ``signing_check``: whether unsigned jobs would reach their targets) and
the durable ones (``spec``: a rollout's stored specification; ``durable``: a rollout saved and
loaded with its outbox; ``rollback`` and ``rollback_log``: rollbacks sent and answered).

May import: ``database``, ``transfer`` and the base modules, plus ``wire``, ``engines``,
``precision``, ``platform``, ``calib``; never ``deployments``, ``admission``, ``web`` or
``commands``.
"""
