"""Precision: is an engine accurate enough, and which layers must stay in higher precision
(worker side, Python 3.6).

Owns ``compare`` (Polygraphy-compatible comparison; pure numpy) with ``metrics`` (error
statistics, SQNR, cosine, top-1) and ``comparison`` (results and their report); ``golden``
(golden inputs/outputs) with ``golden_codec`` (Polygraphy's file encodings, bounded);
``search`` (a search in progress, pure: propose a set, observe pass/fail) with ``strategies``
(the modes as generators); ``ranking`` (per-layer error ranking from instrumented runs); and
``searcher`` (runs a strategy against a backend through the engine cache) with
``search_result`` (what it found).

May import: ``engines``, ``calib`` and the base modules (``errors``, ``fsio``, ``log``,
``progress``). Never ``device``, ``fleet``, ``wire`` or ``cli``.
tests/unit/test_import_rules.py enforces this.
"""
