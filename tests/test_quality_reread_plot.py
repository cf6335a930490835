"""``benchmarks/quality_reread_plot.py`` and the reread tables of ``seeds.md``: one trained model's held-out loss
under each index setting, from the committed rows of run s32 (the numbers ``results/quality/quality.md``
quotes), the window-paired interval computed by hand; a run without rereads is refused by name."""

import os

import numpy as np
import pytest
from scipy import stats

from benchmarks.quality_gap_plot import ROWS
from benchmarks.quality_reread_plot import main, points
from benchmarks.quality_seeds import read_rows, window_difference

RUN = "s32-warm-start-400-seed-3"


def test_window_difference_is_a_paired_t_interval_over_windows():
    a = {"perplexity": {"window_loss": [1.0, 1.2, 0.9, 1.1]}}
    b = {"perplexity": {"window_loss": [1.1, 1.25, 1.0, 1.1]}}
    d = np.array([-0.1, -0.05, -0.1, 0.0])
    half = stats.t.ppf(0.975, 3) * d.std(ddof=1) / 2
    iv = window_difference(a, b)
    assert iv["n"] == 4 and abs(iv["mean"] - d.mean()) < 1e-12 and abs(iv["hi"] - d.mean() - half) < 1e-6
    with pytest.raises(ValueError, match="4 held-out windows against 3"):
        window_difference(a, {"perplexity": {"window_loss": [1.0, 1.0, 1.0]}})


def test_committed_reread_run_gives_what_the_results_say(tmp_path, capsys):
    pts = points(read_rows([ROWS]), RUN)
    assert [p[1] for p in pts] == ["own read (defaults)", "last_q=1024", "last_q=1024 vertical_min=1024 slash_max=256",
                                   "dense attention"]
    assert [round(p[3], 4) for p in pts] == [0.7692, 0.7568, 0.7436, 0.7365]  # quality.md's s32 table
    assert [round(p[2], 3) for p in pts] == [0.173, 0.188, 0.412, 1.0]
    assert all(p[0] == 3 and round(p[5], 4) == 0.7199 for p in pts)
    # the denser index recovers 0.78 of what reading densely gains, last_q=1024 alone 0.38
    own, dense = pts[0][3], pts[3][3]
    assert [round((own - p[3]) / (own - dense), 2) for p in pts[1:3]] == [0.38, 0.78]
    assert main(["--run", RUN, "--out", str(tmp_path / "r.png")]) == 0 and os.path.getsize(tmp_path / "r.png") > 10_000
    assert main(["--run", "s31-warm-start-400-seed-2", "--out", str(tmp_path / "x.png")]) == 1
    assert "run 's31-warm-start-400-seed-2': no mtraining row with rereads" in capsys.readouterr().err
