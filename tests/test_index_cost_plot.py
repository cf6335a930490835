"""``benchmarks/index_cost_plot.py``: the committed rows of run s33 give the step times and the estimate's
per-layer times that ``results/quality/quality.md`` quotes; a run without a cuDNN row is refused by name."""

import json
import os

import pytest

from benchmarks.index_cost_plot import ESTIMATE, THROUGHPUT, _rows, estimates, main, steps


def test_committed_run_gives_what_the_results_say(tmp_path):
    got = steps(_rows(THROUGHPUT, "s33-index-settings-128k"))
    assert [g[0] for g in got] == ["all cuDNN", "defaults", "last_q=1024",
                                   "last_q=1024 vertical_min=1024 slash_max=256"]
    assert [round(g[2], 2) for g in got] == [1.0, 3.30, 2.25, 1.78]
    assert [round(g[3], 3) for g in got[1:]] == [0.055, 0.054, 0.144]
    est = estimates(_rows(ESTIMATE, "s33-estimate-cost"))
    assert sorted(est) == [32768, 131072]
    assert est[131072]["last_q"] == [64, 256, 1024]
    assert [round(x, 1) for x in est[131072]["ms"]] == [4.7, 14.8, 54.4]
    assert round(est[131072]["cudnn_fwd_bwd"]) == 428
    out = tmp_path / "c.png"
    assert main(["--run", "s33-index-settings-128k", "--estimate-run", "s33-estimate-cost", "--out", str(out)]) == 0
    assert os.path.getsize(out) > 10_000


def test_run_without_cudnn_row_is_refused(tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"run": "x", "backend": "mtraining", "step_ms": 1.0, "overrides": []}) + "\n")
    with pytest.raises(ValueError, match="no cuDNN row"):
        steps(_rows(str(path), "x"))
    assert main(["--run", "x", "--throughput", str(path), "--estimate-run", "s33-estimate-cost",
                 "--out", str(tmp_path / "o.png")]) == 1
    assert "no cuDNN row" in capsys.readouterr().err
