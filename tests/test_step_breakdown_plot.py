"""``benchmarks/step_breakdown_plot.py``: categories of a traced step, from the committed rows that
``train_throughput.md`` run 27 quotes."""

import pytest

from benchmarks.kernels_report import load_rows
from benchmarks.step_breakdown_plot import ROWS, categorize, main, profiled


def test_every_kernel_lands_in_one_category():
    by_source = [{"source": "pallas", "ms": 5.0}, {"source": "library", "ms": 7.0}, {"source": "loss.py:84", "ms": 2.0},
                 {"source": "estimate.py:170", "ms": 1.5}, {"source": "mosaic_index.py:163", "ms": 0.5},
                 {"source": "qwen2.py:162", "ms": 3.0}, {"source": "communication", "ms": 0.25}]
    got = categorize(by_source)
    assert got == {"sparse-attention kernels": 5.0, "cuDNN attention kernels": 0.0, "matmuls, copies (library)": 7.0,
                   "communication": 0.25, "loss": 2.0, "index estimate": 1.5, "sparse path, other XLA": 0.5,
                   "model and optimizer, other XLA": 3.0}
    top = [{"name": "cudnn_generated_fort_native_sdpa_sm90_flash_bprop", "ms": 4.0},
           {"name": "nvjet_sm90_tst_128x160", "ms": 2.0}, {"name": "fusion_fmha_like", "ms": 1.0, "src": "x.py:1"}]
    got = categorize(by_source, top)
    assert got["cuDNN attention kernels"] == 4.0 and got["matmuls, copies (library)"] == 3.0


def test_committed_rows_give_the_quoted_loss_and_estimate_times():
    rows = profiled(load_rows([ROWS]), ["s44-before-allsparse", "s44-loss-allsparse"])
    before, after = (categorize(r["profile"]["by_source"]) for r in rows)
    assert round(before["loss"], 1) == 99.6 and round(after["loss"], 1) == 74.2
    assert round(before["index estimate"], 1) == 72.3 and round(after["index estimate"], 1) == 57.7
    assert round(before["matmuls, copies (library)"], 1) == 694.6 and round(after["matmuls, copies (library)"], 1) == 679.4
    with pytest.raises(ValueError, match="no-such-run"):
        profiled(load_rows([ROWS]), ["no-such-run"])


def test_plot_is_written(tmp_path):
    out = tmp_path / "b.png"
    assert main(["--runs", "s44-before-allsparse,s44-loss-allsparse", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
