"""benchmarks/quality_stats.py's score intervals of proportions (Wilson, Newcombe) against published
values, and benchmarks/quality_niah.py: NIAH hits pooled over passkeys (paired by passkey when the rows
carry per-sample outcomes) and the training x inference 2 x 2 from the cross reads."""

import numpy as np
import pytest

from benchmarks import quality_niah, quality_stats


def test_proportion_intervals_known_values():
    # Newcombe (Stat. Med. 1998): Wilson 81/263 = [0.2553, 0.3662]; his method 10 for 56/70 - 48/80 = [0.0524, 0.3339]
    lo, hi = quality_stats.wilson(81, 263)
    assert abs(lo - 0.2553) < 5e-5 and abs(hi - 0.3662) < 5e-5
    d, lo, hi = quality_stats.newcombe_unpaired(56, 70, 48, 80)
    assert abs(d - 0.2) < 1e-12 and abs(lo - 0.0524) < 5e-5 and abs(hi - 0.3339) < 5e-5
    assert quality_stats.wilson(0, 5)[0] == 0.0 and quality_stats.wilson(5, 5)[1] == 1.0
    # paired: the difference is (b - c) / n; swapping the two arms mirrors the interval
    D, lo, hi = quality_stats.newcombe_paired(12, 9, 2, 21)
    assert abs(D - 7 / 44) < 1e-12 and lo < D < hi
    D2, lo2, hi2 = quality_stats.newcombe_paired(12, 2, 9, 21)
    assert np.allclose((D2, lo2, hi2), (-D, -hi, -lo))
    assert quality_stats.newcombe_paired(10, 0, 0, 10)[:1] == (0.0,)
    # the same margins with agreeing pairs are tighter paired than as independent samples
    _, plo, phi_ = quality_stats.newcombe_paired(60, 20, 5, 15)
    _, ulo, uhi = quality_stats.newcombe_unpaired(80, 100, 65, 100)
    assert phi_ - plo < uhi - ulo
    for bad in ((-1, 1, 1, 1), (0, 0, 0, 0)):
        with pytest.raises(ValueError, match="non-negative counts"):
            quality_stats.newcombe_paired(*bad)
    with pytest.raises(ValueError, match="k=6, n=5"):
        quality_stats.wilson(6, 5)


def test_niah_is_pooled_over_passkeys_and_paired_by_passkey_when_recorded():
    def row(arm, seed, correct, per_sample=True):
        acc = [[float(np.mean(c)) for c in r] for r in correct]
        niah = {"samples": len(correct[0][0]), "accuracy": acc, **({"correct": correct} if per_sample else {})}
        return {"arm": arm, "seed": seed, "heldout_loss": 1.0, "steps": 2, "tokens": 1024, "eval": {"niah": niah}}

    dense = [[[1, 1], [1, 0]], [[1, 1], [1, 1]]]  # 7 / 8 right per seed
    sparse = [[[1, 0], [0, 0]], [[1, 1], [1, 1]]]  # 5 / 8, every hit also a dense hit
    rows = [row("dense", s, dense) for s in (0, 1)] + [row("mtraining", s, sparse) for s in (0, 1)]
    text = "\n".join(quality_niah.niah_pooled_lines(rows, ["dense", "mtraining"]))
    assert "| dense | 0, 1 | 14 / 16 | 0.875 |" in text and "| mtraining | 0, 1 | 10 / 16 | 0.625 |" in text
    D, lo, hi = quality_stats.newcombe_paired(10, 0, 4, 2)
    assert f"{D:+.3f}, 95 % interval [{lo:+.3f}, {hi:+.3f}], paired by passkey (0 right only in mtraining, 4 only" in text
    assert "within ±0.05 of dense with the interval inside: no" in text
    # rows from before the per-sample outcomes: counts from accuracy x samples, compared unpaired
    old = [row(r["arm"], r["seed"], dense if r["arm"] == "dense" else sparse, per_sample=False) for r in rows]
    text = "\n".join(quality_niah.niah_pooled_lines(old, ["dense", "mtraining"]))
    D, lo, hi = quality_stats.newcombe_unpaired(10, 16, 14, 16)
    assert f"{D:+.3f}, 95 % interval [{lo:+.3f}, {hi:+.3f}], unpaired" in text
    assert quality_niah.niah_pooled_lines([{"arm": "dense", "seed": 0}], ["dense"]) == []


def _ev(loss, correct):
    return {"perplexity": {"mean_loss": loss},
            "niah": {"samples": len(correct[0][0]), "correct": correct,
                     "accuracy": [[float(np.mean(c)) for c in r] for r in correct]}}


def test_training_and_inference_effects_come_apart_in_the_two_by_two():
    """Dense-trained parameters read with MTraining's attention (``sparse_read``) and MTraining-trained ones read
    densely (``cross_eval``): the 2 x 2 of means, and per seed the inference effect (same parameters, two reads),
    the training effect (both read densely) and both together (each arm as trained)."""
    full, half = [[[1, 1], [1, 1]]], [[[1, 0], [1, 0]]]
    rows = []
    for s, off in ((0, 0.0), (1, 0.1)):
        rows.append({"arm": "dense", "seed": s, "eval": _ev(1.0 + off, full),
                     "sparse_read": {"config": "mtraining.yaml", "eval": _ev(1.3 + off, half)}})
        rows.append({"arm": "mtraining", "seed": s, "eval": _ev(1.2 + off, half),
                     "cross_eval": {"backend": "cudnn", "eval": _ev(1.05 + off, full)}})
    assert quality_niah.read_eval(rows[0], "mtraining") is rows[0]["sparse_read"]["eval"]
    assert quality_niah.read_eval(rows[1], "dense") is rows[1]["cross_eval"]["eval"]
    text = "\n".join(quality_niah.train_infer_lines(rows))
    assert "| dense | 1.0500 ± 0.0707 (n=2) | 1.0000 ± 0.0000 (n=2) | 1.3500 ± 0.0707 (n=2) | 0.5000" in text
    assert "| mtraining | 1.1000 ± 0.0707 (n=2) | 1.0000" in text
    D, lo, hi = quality_stats.newcombe_paired(4, 0, 4, 0)  # per seed 2 of 4 passkeys lost, 2 kept
    line = next(x for x in text.splitlines() if x.startswith("| inference |"))
    assert "trained dense read mtraining − trained dense read dense, seeds 0, 1 | +0.3000 [+0.3000, +0.3000]" in line
    assert f"| -0.500 [-0.500, -0.500] | {D:+.3f} [{lo:+.3f}, {hi:+.3f}], paired by passkey |" in line
    line = next(x for x in text.splitlines() if x.startswith("| training |"))
    D, lo, hi = quality_stats.newcombe_paired(8, 0, 0, 0)  # every passkey right both ways: 0, the width of n = 8
    assert f"| +0.0500 [+0.0500, +0.0500] | +0.000 [+0.000, +0.000] | {D:+.3f} [{lo:+.3f}, {hi:+.3f}]" in line
    assert next(x for x in text.splitlines() if x.startswith("| both |")).count("+0.2000") == 3
    # without the cross reads there is no table; a read without its NIAH grid leaves the NIAH columns empty
    assert quality_niah.train_infer_lines([{"arm": "dense", "seed": 0, "eval": _ev(1.0, full)}]) == []
    del rows[0]["sparse_read"]["eval"]["niah"]
    assert ("| inference | trained dense read mtraining − trained dense read dense, seeds 0, 1 | +0.3000 [+0.3000, "
            "+0.3000] | -0.500 (one seed) | — |") in "\n".join(quality_niah.train_infer_lines(rows))


def test_needle_recall_lines_split_the_passkeys_by_their_outcome():
    def row(arm, seed, kept, correct):  # the grid at lengths 256 and 512, the needle recall at 512 only
        grid = [[[1, 1], c[0]] for c in correct]
        return {"arm": arm, "seed": seed, "eval": {"niah": {"samples": 2, "correct": grid, "lengths": [256, 512],
                                                            "accuracy": [[float(np.mean(c)) for c in r] for r in grid]}},
                "needle_recall": {"kept": kept, "mean_kept": float(np.mean(kept)), "layers": [1, 2],
                                  "lengths": [512]}}

    rows = [row("mtraining", 0, [[[0.9, 0.2]], [[0.8, 0.95]]], [[[1, 0]], [[1, 1]]]),
            row("mtraining", 1, [[[0.7, 0.1]], [[0.9, 0.9]]], [[[1, 0]], [[0, 1]]]),
            {"arm": "dense", "seed": 0}]
    text = "\n".join(quality_niah.needle_lines(rows, ["dense", "mtraining"]))
    right = np.mean([0.9, 0.8, 0.95, 0.7, 0.9])
    missed = np.mean([0.2, 0.1, 0.9])
    mean = np.mean([np.mean([0.9, 0.2, 0.8, 0.95]), np.mean([0.7, 0.1, 0.9, 0.9])])
    assert f"| mtraining | 0, 1 | {mean:.3f} | {right:.3f} (5) | {missed:.3f} (3) | 0.100 |" in text
    assert "| dense |" not in text  # no needle recall in its row
    assert quality_niah.needle_lines([{"arm": "dense", "seed": 0}], ["dense"]) == []


def _niah(acc, lengths=(4096, 8192), depths=(0.0, 1.0), samples=2):
    return {"task": "passkey", "lengths": list(lengths), "depths": list(depths), "samples": samples, "accuracy": acc}


def test_niah_plot_panels_per_training_and_inference_read_averaged_over_seeds(tmp_path, capsys):
    import json

    from benchmarks import quality_niah_plot

    rows = [{"run": "r", "arm": "dense", "seed": 0, "eval": {"niah": _niah([[1.0, 0.5], [1.0, 1.0]])}},
            {"run": "r", "arm": "dense", "seed": 1, "eval": {"niah": _niah([[0.0, 0.5], [1.0, 1.0]])},
             "sparse_read": {"eval": {"niah": _niah([[0.5, 0.5], [0.5, 0.5]])}}},
            {"run": "r", "arm": "mtraining", "seed": 1, "eval": {"niah": _niah([[0.0, 0.0], [0.5, 1.0]])},
             "cross_eval": {"eval": {"niah": _niah([[1.0, 1.0], [0.0, 0.0]])}}},
            {"run": "other", "arm": "dense", "seed": 0, "eval": {"niah": _niah([[0.0, 0.0], [0.0, 0.0]])}}]
    panels = quality_niah_plot.grids(rows, ["r"])
    assert [label for label, _ in panels] == [
        "trained dense, read dense\nseeds 0, 1", "trained dense, read mtraining\nseed 1",
        "trained mtraining, read dense\nseed 1", "trained mtraining, read mtraining\nseed 1"]
    assert panels[0][1]["accuracy"] == [[0.5, 0.5], [1.0, 1.0]] and panels[0][1]["samples"] == 4
    assert panels[2][1]["accuracy"] == [[1.0, 1.0], [0.0, 0.0]] and panels[2][1]["samples"] == 2
    assert [label for label, _ in quality_niah_plot.grids(rows, ["r"], seeds={0})] == [
        "trained dense, read dense\nseed 0"]
    # one run's dense arm beside another run's MTraining arm trained with more dense layers: its own panel
    rows.append({"run": "other", "arm": "mtraining", "seed": 0, "eval": {"niah": _niah([[1.0, 1.0], [1.0, 1.0]])},
                 "train_overrides": ["optim.lr=3e-4", "model.dense_layers=[0, 4, 8]"]})
    mixed = quality_niah_plot.grids(rows, ["r:dense", "other:mtraining"])
    assert [label for label, _ in mixed] == [
        "trained dense, read dense\nseeds 0, 1", "trained dense, read mtraining\nseed 1",
        "trained mtraining\n(dense layers 0,4,8), read mtraining\nseed 0"]
    assert mixed[2][1]["accuracy"] == [[1.0, 1.0], [1.0, 1.0]]
    with pytest.raises(ValueError, match="unknown arm\\(s\\) \\['msa'\\]"):
        quality_niah_plot.grids(rows, ["r:msa"])
    rows.pop()
    with pytest.raises(ValueError, match="runs r, seeds \\[7\\]: no row with a NIAH grid"):
        quality_niah_plot.grids(rows, ["r"], seeds={7})
    rows[1]["eval"]["niah"] = _niah([[1.0], [1.0]], lengths=(4096,))
    with pytest.raises(ValueError, match="different lengths / depths"):
        quality_niah_plot.grids(rows, ["r"])
    del rows[1]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "niah.png"
    assert quality_niah_plot.main(["--rows", str(path), "--run", "r", "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    printed = capsys.readouterr().out
    assert "trained mtraining, read dense, seed 1: NIAH 0.500 (2 passkeys per cell)" in printed
    assert quality_niah_plot.main(["--rows", str(path), "--run", "nope", "--out", str(out)]) == 1
    assert "runs nope: no row with a NIAH grid" in capsys.readouterr().err
