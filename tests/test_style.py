"""The library's lines stay at most 120 characters (``mtraining_jax/``, ``pallas_kernels/``: the width the
code is written to). Scripts and tests are not held to it yet: ~180 of their lines are longer."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
WIDTH = 120


def long_lines(paths) -> list:
    """``[(path, line number, length)]`` of every line over :data:`WIDTH` characters (not bytes) in ``paths``."""
    return [(p.name, i, len(line)) for p in paths
            for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if len(line) > WIDTH]


def test_library_lines_fit_the_width():
    files = sorted(f for pkg in ("mtraining_jax", "pallas_kernels") for f in (ROOT / pkg).rglob("*.py"))
    assert len(files) > 90  # the packages were found
    assert long_lines(files) == []


def test_a_long_line_is_found_and_counted_in_characters(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("a" * WIDTH + "\n" + "─" * WIDTH + "\n" + "b" * (WIDTH + 1) + "\n", encoding="utf-8")
    assert long_lines([f]) == [("x.py", 3, WIDTH + 1)]  # the box-drawing line is 3 x 120 bytes, 120 characters
