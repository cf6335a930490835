"""``benchmarks/fused_backward_plot.py``: the fused-backward timings read from their rows and drawn."""

import json

import pytest

from benchmarks.fused_backward_plot import main, variants

ROW = {"case": "full_32k", "dense:consumer:64:1_ms": 24.2, "dense:consumer:64:1_spread": [23.5, 24.6],
       "dense:consumer:64:1_first_s": 2.1, "three_pass_ms": 24.3, "three_pass_spread": [24.1, 24.7],
       "three_pass_max_rel_diff": [0, 0, 0], "device": "NVIDIA H200", "commit": "7e6dd83abc"}


def test_variants_reads_median_and_spread_baseline_first():
    v = variants([{"case": "model_L1", "three_pass_ms": 1.0, "three_pass_spread": [1, 1]}, ROW], "full_32k")
    assert v == [("three_pass", 24.3, (24.1, 24.7)), ("dense:consumer:64:1", 24.2, (23.5, 24.6))]
    with pytest.raises(ValueError, match="no row of case 'full_1m'.*full_32k"):
        variants([ROW], "full_1m")


def test_main_writes_the_chart(tmp_path):
    f = tmp_path / "fused.json"
    f.write_text(json.dumps([ROW]))
    out = tmp_path / "c.png"
    assert main([str(f), str(f), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
