"""Precision: is an engine accurate enough, and which layers must stay in higher precision
(worker side, Python 3.6).

Owns ``compare`` (Polygraphy-compatible comparison, SQNR, cosine; pure numpy), ``golden``
(golden inputs/outputs files), ``search`` (the search strategies, pure: propose a set, observe
pass/fail), ``ranking`` (per-layer error ranking from instrumented runs) and ``searcher`` (runs a
strategy against a backend through the engine cache).

May import: ``engines``, ``calib`` and the base modules (``errors``, ``fsio``, ``log``,
``progress``). Never ``device``, ``fleet``, ``wire`` or ``cli``.
tests/unit/test_import_rules.py enforces this.
"""
