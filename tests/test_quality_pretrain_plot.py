"""``benchmarks/quality_pretrain_plot.py``: the copy pretraining's stages laid end to end in tokens, from the
JSONL rows; a run without a pretraining is refused by name."""

import pytest

from benchmarks.quality_pretrain_plot import main, stage_curves


def _row(run, pretrain, arm="dense"):
    return dict(run=run, arm=arm, seed=0, pretrain=pretrain)


PRE = dict(steps=100, seq_len=256, batch=4, alphabet=256, heldout_curve=[[50, 5.5], [100, 5.0]],
           stage_results=[dict(steps=10, seq_len=1024, batch=2, heldout_curve=[[5, 5.6], [10, 5.4]])])


def test_later_stages_continue_in_tokens_where_the_one_before_ended():
    rows = [_row("x", {"steps": 0}), _row("a", {"steps": 0}), _row("a", PRE)]
    (l1, c1), (l2, c2) = stage_curves(rows, "a")
    assert c1 == [(50 * 1024, 5.5), (100 * 1024, 5.0)]
    assert c2 == [(102400 + 5 * 2048, 5.6), (102400 + 10 * 2048, 5.4)]
    assert l1 == "stage 1: 256 x 4, 100 steps" and l2 == "stage 2: 1024 x 2, 10 steps"
    with pytest.raises(ValueError, match="run 'x': no row with a copy pretraining"):
        stage_curves(rows, "x")
    # RUN@SEED: that seed's pretraining (a run of several seeds pretrains each)
    seed1 = dict(PRE, heldout_curve=[[50, 4.5], [100, 4.0]])
    rows.append(dict(_row("a", seed1), seed=1))
    assert stage_curves(rows, "a@1")[0][1] == [(50 * 1024, 4.5), (100 * 1024, 4.0)]
    assert stage_curves(rows, "a@0")[0][1] == stage_curves(rows, "a")[0][1] == c1
    with pytest.raises(ValueError, match="run 'a@2': no row"):
        stage_curves(rows, "a@2")


def test_main_writes_the_plot_and_names_a_missing_run(tmp_path, capsys):
    import json

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(_row("a", PRE)) + "\n")
    out = tmp_path / "p.png"
    assert main(["--rows", str(rows), "--run", "a", "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    assert "a, stage 2: 1024 x 2, 10 steps: held-out 5.6000 -> 5.4000" in capsys.readouterr().out
    assert main(["--rows", str(rows), "--run", "b", "--out", str(out)]) == 1
    assert "run 'b': no row" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["quality_pretrain_plot.py", "quality_gap_plot.py", "quality_niah_plot.py"])
def test_the_plot_scripts_run_as_files_from_anywhere(tmp_path, script):
    """The docstrings' commands (``python benchmarks/<script> ...``) from another folder without PYTHONPATH.
    Where the project is installed (CI) ``benchmarks`` imports either way; the scripts' own path insert is what
    makes them run from a checkout that is not installed, which this test does not isolate."""
    import os
    import subprocess
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, path, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode == 0 and "--out" in res.stdout, res.stderr[-2000:]
