"""Benchmark scripts of mtraining-jax (a package: they import each other as ``benchmarks.x``).

Run one from the repository root as ``python -m benchmarks.NAME ...`` or, with the repository
on the path (``PYTHONPATH=.`` or an install), as ``python benchmarks/NAME.py ...``. The package holds
code only: measured results live in ``results/<topic>/`` (markdown reports beside one JSONL per
topic whose rows carry a ``run`` tag), design notes in ``docs/``.
"""
