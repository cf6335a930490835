"""``benchmarks.sparse_ring --report`` on the committed current-code records (runs v14, v15): the scaling
table's efficiency column is tokens/s at P GPUs over P x tokens/s at 1 GPU of the same length, and the
plot has its efficiency panel."""

import os
import re

import pytest

from benchmarks import sparse_ring

ROWS = os.path.join(os.path.dirname(__file__), "..", "results", "ring", "ring.jsonl")


def test_report_of_the_current_runs(tmp_path):
    table, png = tmp_path / "t.md", tmp_path / "p.png"
    sparse_ring.main(["--report", ROWS, "--runs", "v14,v15", "--table", str(table), "--plot", str(png)])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.read_text().splitlines()
            if line.startswith("| fixed total")]
    sparse = {(r[1], r[2], r[3].split(",")[0]): r for r in rows if r[4] == "sparse"}
    one = {S: float(re.sub(r" M$", "", r[6])) for (S, mesh, _), r in sparse.items() if mesh == "1x1"}
    assert set(one) == {"256K", "512K", "1024K"}
    checked = 0
    for (S, mesh, _), r in sparse.items():
        P = int(mesh.split("x")[0]) * int(mesh.split("x")[1])
        if P > 1 and r[6].endswith(" M"):
            eff = float(r[8].rstrip(" %"))
            assert eff == pytest.approx(100 * float(r[6][:-2]) / (P * one[S]), abs=1.0), r
            checked += 1
    assert checked >= 6
    assert png.stat().st_size > 20_000
