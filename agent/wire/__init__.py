"""The wire: what crosses the network between devices and the controller (Python >= 3.8).

Owns ``protocol`` (vocabulary, ids, the message codec, artifact blocks) with ``json_schema``
(the validator of the JSON Schemas in agent/data/schemas), ``topics`` (topic names) and
``status_messages`` (device, job and command-reply messages); ``message_caps`` (every message
within its topic's limit); ``mqtt`` (the MQTT edge) with ``mqtt_types`` (its events and
options, no paho), ``send_gate`` and ``mqtt_errors`` (why a connection failed): ``mqtt`` and
``mqtt_errors`` are the only modules that import paho; ``block_server`` (the controller's side
of block transfer); ``signing`` (signed job manifests, the device's check, replay protection)
with ``job_signer`` (the controller's keys and signatures) and ``device_identity``;
``model_names``, ``device_labels``, ``rollcall``, ``fanout_rounds``.

``device/``: the modules only a device imports (the controller never does): resumable block
``transfer`` with ``http_fetch`` and ``block_assembly``, the content-addressed ``artifacts``
store, ``job_semantics``, ``limits`` (rate limits, the byte-bounded event queue) and
``security_posture``.

May import: only the base modules (``errors``, ``fsio``, ``log``, ``progress``); collaborators
from the device (the journal) are handed in. Never ``device``, ``fleet``, ``engines``,
``precision`` or ``cli``. tests/unit/test_import_rules.py enforces this.
"""
