"""Artifact transfer, controller side: the MQTT event queue bounded in bytes that never blocks
paho (``bytequeue``), the bounded HTTP servers (``http_bounds``), the content-addressed
artifact store over HTTP with Range requests (``http_source``) and engine sharing: who builds
per device class, engine uploads (``sharing``).

May import: the base modules, plus ``wire``, ``engines``, ``precision``, ``platform``,
``calib``; nothing else of ``agent.fleet``.
"""
