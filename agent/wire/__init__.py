"""The wire: what crosses the network between devices and the controller (Python >= 3.8).

Owns ``protocol`` (vocabulary, ids, the message codec, artifact blocks) with ``json_schema``
(the validator of the JSON Schemas in agent/data/schemas), ``topics`` (topic names),
``job_semantics`` (a job document beyond its schema) and ``status_messages`` (device, job and
command-reply messages); ``message_caps`` (every message within its topic's limit); ``mqtt``
(the MQTT edge) with ``mqtt_types`` (its events and options, no paho) and ``mqtt_errors`` (why
a connection failed): ``mqtt`` and ``mqtt_errors`` are the only modules that import paho;
resumable block ``transfer`` with ``block_server`` and ``http_fetch``; the content-addressed
``artifacts`` store (one download assembled by ``block_assembly``); ``signing`` (signed job
manifests, the device's check, replay protection) with ``job_signer`` (the controller's keys
and signatures) and ``security_posture`` (diag's view); ``limits`` (size and rate limits, the
byte-bounded event queue).

May import: only the base modules (``errors``, ``fsio``, ``log``, ``progress``); collaborators
from the device (the journal) are handed in. Never ``device``, ``fleet``, ``engines``,
``precision`` or ``cli``. tests/unit/test_import_rules.py enforces this.
"""
