"""Hand-off adapters: how a new model version reaches the inference application.

``base`` (``ModelVersion``, ``Adapter``), one module per adapter type (``triton``,
``deepstream``, ``command``), each with its own ``from_config(section, where)``.
"""
