"""``benchmarks/compile_memory_plot.py``: the committed rows give the peaks ``train_throughput.md`` run 20 quotes;
series text and runs without a cuDNN row are refused by name."""

import json
import os

import pytest

from benchmarks.compile_memory_plot import ROWS, cudnn_peak, main, parse_series, peaks, placement, times
from benchmarks.kernels_report import load_rows


def test_committed_runs_give_what_the_results_say(tmp_path):
    rows = load_rows([ROWS])
    base = cudnn_peak(rows, ("s37-shared-weight-gradient",))
    assert round(base, 2) == 32.13
    after = peaks(rows, ("s37-shared-weight-gradient",), "mt")
    assert {k: round(v / base, 3) for k, v in after.items()} == {
        "[0,1]": 1.034, "[0,4,8,12,16,20]": 1.204, "[0]": 1.05, "[22,23]": 1.031, "[]": 1.037}
    before = peaks(rows, ("s34-compile-memory-structure", "s35-compile-memory-placements"), "mt")
    assert round(before["[0,1]"], 2) == 34.98 and round(before["[0,4,8,12,16,20]"], 2) == 40.45
    assert "[0]" in before and round(before["[0]"], 2) == 34.17  # the ring-backend row is not a placement
    out = tmp_path / "p.png"
    assert main(["--series", "a=s34-compile-memory-structure,s35-compile-memory-placements:mt",
                 "--series", "b=s37-shared-weight-gradient:mt", "--out", str(out)]) == 0
    assert os.path.getsize(out) > 10_000


def test_bad_series_and_missing_cudnn_are_refused(tmp_path, capsys):
    assert parse_series("x=r1,r2:mt") == ("x", ("r1", "r2"), "mt")
    with pytest.raises(ValueError, match="LABEL=RUN"):
        parse_series("no-variant=r1")
    assert placement({"overrides": ["model.dense_layers=[0]", "model.dense_backend=ring"]}) is None
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps({"run": "x", "variant": "mt", "peak_gib": 1.0,
                                "overrides": ["model.dense_layers=[]"]}) + "\n")
    assert main(["--series", "a=x:mt", "--rows", str(path), "--out", str(tmp_path / "o.png")]) == 1
    assert "no cudnn row" in capsys.readouterr().err
    assert main(["--series", "a=s37-shared-weight-gradient:nope", "--out", str(tmp_path / "o.png")]) == 1
    assert "no rows for series ['a']" in capsys.readouterr().err


def test_compile_times_of_the_committed_precompile_runs(tmp_path, capsys):
    """``--times``: the per-process seconds ``train_throughput.md`` run 26 quotes (Mosaic kernels compiled on the
    worker thread or inside the step's compile), and a run with no rows refused by name."""
    procs = times(load_rows([ROWS]), ("s43-compile-precompile",))
    by = {}
    for v, lower, comp in procs:
        by.setdefault(v, []).append(round(comp, 1))
    assert by["mt"] == [14.7, 12.8, 12.7, 12.3] and by["mt-noprecompile"] == [18.1, 18.4, 18.8, 19.6]
    assert by["cudnn"] == [8.7] and by["mt-split"] == [11.4] and by["mt-split-noprecompile"] == [18.2]
    out = tmp_path / "t.png"
    assert main(["--times", "s43-compile-precompile", "--out", str(out)]) == 0 and os.path.getsize(out) > 10_000
    assert main(["--times", "no-such-run", "--out", str(out)]) == 1
    assert "no rows in runs ['no-such-run']" in capsys.readouterr().err


def test_compile_times_of_trainer_rows(tmp_path):
    """``--rows train_throughput.jsonl``: the trainer's lower + compile per process (``train_throughput.md``
    run 35: the forward on the split stream only against ``auto``'s two forward kernels), no lowering bar."""
    rows = os.path.join(os.path.dirname(ROWS), "train_throughput.jsonl")
    procs = times(load_rows([rows]), ("s59-kernel-stream-split-ab",))
    assert [(v, lo, round(c, 1)) for v, lo, c in procs] == [
        ("kernel_stream=auto", 0.0, 21.4), ("kernel_stream=split", 0.0, 18.2), ("kernel_stream=split", 0.0, 19.0),
        ("kernel_stream=auto", 0.0, 22.5)]
    out = tmp_path / "t.png"
    assert main(["--rows", rows, "--times", "s59-kernel-stream-split-ab", "--out", str(out)]) == 0
    assert os.path.getsize(out) > 10_000
