"""Engines: turning a model into something that runs, and timing it (worker side, Python 3.6).

Owns the ``backends`` (``base``: ``BuildPlan``, ``Backend``, ``get_backend``; ``tensorrt*`` and
``cuda_buffers`` for devices; ``onnxruntime*`` with ``emulation*`` for hosts; ``onnx_model``,
``layer_precisions`` and ``graph``, the ONNX reading and rewrites both share), the engine
``cache`` (with ``cache_key``, ``cache_entry``, ``cache_lock``, ``cache_files`` and
``cache_upkeep``), ``build`` (``build_engine``, the one way to an engine), ``bench``, and the
readers of hostile model and array files (``model_check``, ``safe_npz`` with ``zip_members``).

May import: ``calib`` and the base modules (``errors``, ``fsio``, ``log``, ``progress``).
Never ``precision``, ``device``, ``fleet``, ``wire`` or ``cli``. Only this package (and
``calib``) imports tensorrt, pycuda or onnxruntime, and only lazily, so importing it stays light.
tests/unit/test_import_rules.py enforces this.
"""
