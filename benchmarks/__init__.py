"""Benchmark scripts of mtraining-jax (a package: they import each other as ``benchmarks.x``).

Run one from the repository root as ``python -m benchmarks.NAME ...`` or, with the repository
on the path (``PYTHONPATH=.`` or an install), as ``python benchmarks/NAME.py ...``.
"""
