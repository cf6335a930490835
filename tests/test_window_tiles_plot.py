"""``benchmarks/window_tiles_plot.py``: the committed rows of training run 29 give the numbers its report quotes;
a tiling run without an XLA row is refused by name."""

import json
import os

import pytest

from benchmarks.kernels_report import load_rows
from benchmarks.window_tiles_plot import ESTIMATE, THROUGHPUT, main, step_deltas, tilings


def test_committed_runs_give_what_the_report_says(tmp_path):
    tiles = tilings(load_rows([ESTIMATE], ("s46-window-tiles-a", "s46-window-tiles-b")))
    a, b = tiles["s46-window-tiles-a"], tiles["s46-window-tiles-b"]
    assert (round(a["xla"], 2), round(b["xla"], 2)) == (3.80, 3.66)
    assert round(a["128:2048:4:2"]["estimate"], 2) == 3.95 and round(a["64:1024:4:2"]["estimate"], 2) == 2.55
    assert [round(a["64:1024:4:2"][fn], 2) for fn in ("row_max", "exp_digit_sums", "column_digit_sums")] == \
        [0.55, 0.99, 0.82]
    d = {label: (round(m, 1), round(lo, 1), round(hi, 1))
         for label, m, lo, hi in step_deltas(load_rows([THROUGHPUT], ("s46-arms-ab", "s46-est-tiling-ab")))}
    assert d["lse (s46-arms-ab)"] == (-16.1, -30.7, -1.5)
    assert d["est2 (s46-est-tiling-ab)"] == (-22.9, -31.0, -14.8)
    out = tmp_path / "w.png"
    assert main(["--tiles-runs", "s46-window-tiles-a", "--ab-runs", "s46-est-tiling-ab", "--out", str(out)]) == 0
    assert os.path.getsize(out) > 10_000


def test_a_failed_tiling_is_left_out_and_a_run_without_xla_refused(tmp_path, capsys):
    rows = [{"run": "x", "fn": "estimate", "impl": "triton", "tiling": "256:4096:8:3", "error": "RESOURCE_EXHAUSTED"},
            {"run": "x", "fn": "estimate", "impl": "triton", "tiling": "64:1024:4:2", "ms": 2.5}]
    with pytest.raises(ValueError, match="'x' has no XLA estimate row"):
        tilings(rows)
    assert tilings(rows + [{"run": "x", "fn": "estimate", "impl": "xla", "tiling": None, "ms": 3.7}]) == \
        {"x": {"64:1024:4:2": {"estimate": 2.5}, "xla": 3.7}}
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["--tiles-runs", "x", "--estimate", str(path), "--ab-runs", "s46-arms-ab", "--out",
                 str(tmp_path / "o.png")]) == 1
    assert "no XLA estimate row" in capsys.readouterr().err
