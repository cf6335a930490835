"""``benchmarks/quality_gap_plot.py``: the per-step held-out gap between two arms of a run, across runs of
different protocols, from the JSONL rows; bad specs are refused with the bad part named."""

import os

import pytest

from benchmarks.quality_gap_plot import ROWS, gaps, main, parse_pair
from benchmarks.quality_seeds import read_rows


def _row(run, arm, seed, curve, **kw):
    return dict(run=run, arm=arm, seed=seed, heldout_curve=[[s, v] for s, v in curve], **kw)


def test_gap_is_arm_minus_base_on_the_shared_steps():
    rows = [_row("a", "dense", 0, [(10, 3.0), (20, 2.0), (30, 1.5)]),
            _row("b", "mtraining", 0, [(10, 2.5), (30, 1.75)]),
            _row("b", "mtraining", 1, [(10, 9.0)]),  # no dense seed 1: left out
            _row("a", "dense", 2, [(10, 1.0)]), _row("b", "mtraining", 2, [(10, 1.0)], error="boom")]
    g = gaps(rows, ["a", "b"], "mtraining", "dense")
    assert list(g) == [0]
    assert g[0][2] == [(10, -0.5), (30, 0.25)]
    rows.append(_row("a", "dense", 0, [(10, 2.0), (30, 2.0)]))  # a later row of (dense, 0) wins
    assert gaps(rows, ["a", "b"], "mtraining", "dense")[0][2] == [(10, 0.5), (30, -0.25)]
    with pytest.raises(ValueError, match="seeds \\[1\\]"):
        gaps(rows, ["a", "b"], "mtraining", "dense", seeds={1})
    with pytest.raises(ValueError, match="runs a: no seed"):
        gaps(rows, ["a"], "mtraining", "dense")


@pytest.mark.parametrize("spec, msg", [("s16:mtraining-dense", "LABEL=RUN"), ("x=s16", "LABEL=RUN"),
                                       ("x=s16:mtraining", "LABEL=RUN"), ("x=s16:mt-dense", "unknown arm 'mt'"),
                                       ("x=s16:msa-base", "unknown arm 'base'")])
def test_bad_pair_specs_are_refused_naming_them(spec, msg):
    with pytest.raises(ValueError, match=msg):
        parse_pair(spec)


def test_committed_rows_give_the_gaps_the_results_state(tmp_path, capsys):
    """results/quality/quality.md (eighth session): seed 0 at step 800, trainer's held-out eval."""
    rows = read_rows([ROWS])
    scratch = gaps(rows, ["s11-dense-lr3e-4-4-seeds", "s13-mtraining-lr3e-4-3-seeds",
                          "s14-lr3e-4-mtraining-seed3-msa-seed0"], "mtraining", "dense")
    assert list(scratch) == [0, 1, 2, 3]  # s14's MSA row is not an arm of this pair
    assert [round(scratch[s][2][-1][1], 4) for s in (1, 2, 3)] == [-0.1443, -0.1092, -0.1672]
    copy = gaps(rows, ["s16-copy-pretrained-seed0"], "mtraining", "dense")
    assert list(copy) == [0] and copy[0][2][-1][0] == 800
    assert copy[0][2][-1][1] == pytest.approx(0.0028, abs=5e-5)
    assert scratch[0][2][-1][1] == pytest.approx(-0.1912, abs=5e-5)
    assert min(d for _, d in copy[0][2]) == pytest.approx(-0.121, abs=1e-3)  # MTraining's lead, closed by step 800
    out = tmp_path / "gap.png"
    assert main(["--pair", "copy=s16-copy-pretrained-seed0:mtraining-dense", "--out", str(out)]) == 0
    assert os.path.getsize(out) > 10_000 and "copy, seed 0: mtraining - dense at step 800: +0.0028" in capsys.readouterr().out
    assert main(["--pair", "copy=s16-copy-pretrained-seed0:mtraining-dense", "--seeds", "x", "--out", str(out)]) == 1
    assert main(["--pair", "copy=no-such-run:mtraining-dense", "--out", str(out)]) == 1
