"""A job's life on the device: ``intake`` (documents in, validated, queued; cancels),
``scheduler`` (the next job, checked), ``run`` (the job in hand) and ``end`` (how any job ends,
whatever stage it reached)."""
