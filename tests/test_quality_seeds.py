"""benchmarks/quality_seeds.py: the quality study's statistics over seeds: t quantiles, paired
differences and their 95 % t-intervals, relative differences against the ±1 % / ±2 % target, the
dense read of a sparse arm paired with dense, losses at equal training time, and the seed plot."""

import json
import os

import numpy as np
import pytest

from benchmarks import quality_seeds, quality_stats, quality_study


def test_t_quantile_known_values():
    # two-sided 95 % critical values of Student's t (any statistics table)
    table = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 9: 2.262, 10: 2.228,
             20: 2.086, 30: 2.042}
    for df, want in table.items():
        assert abs(quality_stats.t_quantile(0.975, df) - want) < 5e-4, df
    assert abs(quality_stats.t_quantile(0.95, 4) - 2.132) < 5e-4 and abs(quality_stats.t_quantile(0.995, 2) - 9.925) < 5e-4
    assert abs(quality_stats.t_quantile(0.975, 2000) - 1.9612) < 5e-4  # -> the normal quantile 1.960
    for bad in ((0.5, 2), (1.0, 2), (0.975, 0), (0.975, 2.5)):
        with pytest.raises(ValueError):
            quality_stats.t_quantile(*bad)
    try:
        from scipy import stats
    except ImportError:
        return
    for df in (1, 2, 3, 4, 7, 15):
        for q in (0.6, 0.9, 0.975, 0.999):
            assert abs(quality_stats.t_quantile(q, df) - stats.t.ppf(q, df)) < 1e-8


def test_paired_interval_on_synthetic_numbers():
    iv = quality_stats.paired_interval([1.0, 2.0, 3.0])
    assert iv["n"] == 3 and iv["mean"] == 2.0 and abs(iv["sd"] - 1.0) < 1e-12
    half = 4.3027 / np.sqrt(3)  # t_{0.975, 2} * sd / sqrt(n)
    assert abs(iv["lo"] - (2 - half)) < 1e-3 and abs(iv["hi"] - (2 + half)) < 1e-3
    assert quality_stats.verdict(iv).startswith("no difference established")
    iv = quality_stats.paired_interval([-0.10, -0.12, -0.11, -0.13])
    sd = np.std([-0.10, -0.12, -0.11, -0.13], ddof=1)
    assert abs(iv["hi"] - (-0.115 + 3.1824 * sd / 2)) < 1e-4 and iv["hi"] < 0
    assert quality_stats.verdict(iv).startswith("lower than dense")
    one = quality_stats.paired_interval([-0.137])
    assert one["lo"] is None and one["mean"] == -0.137 and quality_stats.verdict(one).startswith("one seed")

    # pairing is per seed: a seed-level offset common to both arms cancels
    def row(arm, seed, loss, sha="x"):
        return {"arm": arm, "seed": seed, "heldout_loss": loss, "steps": 2, "tokens": 1024, "tokens_per_step": 512,
                "corpus_sha": sha, "train_loss": [[1, 3.0], [2, 2.0]], "heldout_curve": [[2, loss]],
                "train_time": [[1, 1.0], [2, 2.0]]}

    offsets = [0.0, 0.5, -0.4]
    rows = [row("dense", s, 2.0 + o) for s, o in enumerate(offsets)]
    rows += [row("mtraining", s, 2.0 + o - 0.1 + 0.01 * s) for s, o in enumerate(offsets)]
    vals, notes = quality_seeds.seed_values(rows)
    iv = quality_seeds.paired_differences(vals, "mtraining", "heldout_loss")
    assert iv["seeds"] == [0, 1, 2] and np.allclose(iv["diffs"], [-0.1, -0.09, -0.08])
    assert iv["hi"] < 0 and not notes
    # an arm trained on other data for a seed is left out of the pairing (and said so)
    rows.append(row("mtraining", 2, 1.0, sha="other"))
    vals, notes = quality_seeds.seed_values(rows)
    assert quality_seeds.paired_differences(vals, "mtraining", "heldout_loss")["seeds"] == [0, 1]
    assert any("corpus_sha" in n for n in notes) and any("several rows" in n for n in notes)


def test_relative_difference_is_per_seed_and_judges_the_target():
    def row(arm, seed, loss):
        return {"arm": arm, "seed": seed, "heldout_loss": loss, "steps": 2, "tokens": 1024, "tokens_per_step": 512,
                "corpus_sha": "x", "train_loss": [[1, 3.0], [2, 2.0]], "heldout_curve": [[2, loss]],
                "train_time": [[1, 1.0], [2, 2.0]]}

    dense = [2.0, 1.0, 4.0]
    # the same 10 % gap at every seed, whatever the seed's own loss level: exactly -10 %, no spread
    vals, _ = quality_seeds.seed_values([row("dense", s, d) for s, d in enumerate(dense)]
                                        + [row("mtraining", s, 0.9 * d) for s, d in enumerate(dense)])
    iv = quality_seeds.relative_difference(vals, "mtraining")
    assert iv["seeds"] == [0, 1, 2] and np.allclose(iv["diffs"], [-10.0] * 3) and abs(iv["mean"] + 10.0) < 1e-9
    line, trainer_line = quality_seeds.relative_lines(vals, ["dense", "mtraining"], 512, "1,024")
    assert "held-out loss @ 512 -10.00 % of dense's" in line and line.endswith("inside +-2 %: no.")
    # the trainer's final held-out (the rows' curves end at the same losses here) gets its own sentence
    assert "trainer's held-out loss, final -10.00 %" in trainer_line and trainer_line.endswith("inside +-2 %: no.")
    # within 1 % and the interval inside 2 %: yes; the interval is that of the per-seed percentages
    vals, _ = quality_seeds.seed_values([row("dense", s, d) for s, d in enumerate(dense)]
                                        + [row("mtraining", s, d * (1 + r)) for s, (d, r) in
                                           enumerate(zip(dense, [0.002, -0.004, 0.005]))])
    iv = quality_seeds.relative_difference(vals, "mtraining")
    ref = quality_stats.paired_interval([0.2, -0.4, 0.5])
    assert abs(iv["lo"] - ref["lo"]) < 1e-9 and abs(iv["hi"] - ref["hi"]) < 1e-9
    line, _ = quality_seeds.relative_lines(vals, ["dense", "mtraining"], 512, "1,024")
    assert line.endswith("inside +-2 %: yes.") == (-2 <= ref["lo"] and ref["hi"] <= 2)


def test_rows_without_the_evaluator_compare_on_the_trainers_curve():
    """``--no-eval`` rows (``eval_skipped``, no ``heldout_loss``): the note says so and the relative
    difference is the trainer's final held-out only."""
    def row(arm, seed, final):
        return {"arm": arm, "seed": seed, "heldout_loss": None, "steps": 2, "tokens": 1024, "corpus_sha": str(seed),
                "eval_skipped": "--no-eval", "train_loss": [[1, 3.0], [2, 2.0]],
                "heldout_curve": [[1, 9.0], [2, final]], "train_time": [[1, 1.0], [2, 2.0]]}

    vals, notes = quality_seeds.seed_values([row("dense", s, 2.0 + s) for s in range(3)]
                                            + [row("mtraining", s, (2.0 + s) * 1.01) for s in range(3)])
    assert sum("not evaluated (--no-eval)" in n for n in notes) == 6
    assert quality_seeds.paired_differences(vals, "mtraining", "heldout_loss")["n"] == 0
    (line,) = quality_seeds.relative_lines(vals, ["dense", "mtraining"], 512, "1,024")
    assert line.startswith("* mtraining: trainer's held-out loss, final +1.00 % of dense's") and "3 seeds" in line


def test_dense_read_is_paired_with_the_dense_arm():
    """``heldout_dense_read``: a sparse arm's cross-evaluation (its parameters read with dense attention
    in every layer) minus the dense arm's own held-out loss; no cross-evaluation, no value."""
    def row(arm, seed, loss, read=None):
        r = {"arm": arm, "seed": seed, "heldout_loss": loss, "steps": 2, "tokens": 1024, "corpus_sha": str(seed),
             "train_loss": [[1, 3.0], [2, 2.0]], "heldout_curve": [[2, loss]], "train_time": [[1, 1.0], [2, 2.0]]}
        if read is not None:
            r["cross_eval"] = {"backend": "cudnn", "eval": {"perplexity": {"mean_loss": read}}}
        return r

    rows = [row("dense", 0, 1.5), row("dense", 1, 1.4), row("dense", 2, 1.6),
            row("mtraining", 0, 1.3, read=1.35), row("mtraining", 1, 1.2, read=1.28), row("mtraining", 2, 1.45),
            row("msa", 0, 1.4)]
    vals, _ = quality_seeds.seed_values(rows)
    assert vals[("dense", 1)]["heldout_dense_read"] == 1.4 and vals[("mtraining", 2)]["heldout_dense_read"] is None
    iv = quality_seeds.paired_differences(vals, "mtraining", "heldout_dense_read")
    assert iv["seeds"] == [0, 1] and np.allclose(iv["diffs"], [-0.15, -0.12])
    assert quality_seeds.paired_differences(vals, "msa", "heldout_dense_read")["n"] == 0
    md = quality_seeds.seed_report_md(rows)
    line = [x for x in md.splitlines() if "read with dense attention in every layer | mtraining − dense" in x]
    assert len(line) == 1 and "| 2 | -0.135 |" in line[0] and "s0: -0.15, s1: -0.12" in line[0]
    assert not [x for x in md.splitlines() if "read with dense attention in every layer | msa" in x]


def test_dense_read_by_position_separates_out_of_distribution_from_a_pattern_gain():
    """The dense read's gap per position bucket, per sparse row: a rising gap and a flat one come out as
    given; rows without a bucketed cross-evaluation (the dense arm, a sparse row without it) are left out."""
    def row(arm, seed, own, read=None):
        r = {"arm": arm, "seed": seed, "heldout_loss": float(np.mean(own)), "steps": 2, "tokens": 1024,
             "corpus_sha": "c", "eval": {"perplexity": {"loss": own, "bucket_edges": [0, 10, 20, 30]}}}
        if read is not None:
            r["cross_eval"] = {"eval": {"perplexity": {"loss": read, "mean_loss": float(np.mean(read))}}}
        return r

    rows = [row("dense", 0, [1.0, 1.0, 1.0]), row("msa", 0, [1.0, 1.0, 1.0], [1.0, 1.1, 1.3]),
            row("mtraining", 0, [1.0, 0.9, 0.8], [1.2, 1.1, 1.0]), row("mtraining", 1, [1.0, 1.0, 1.0])]
    got = quality_seeds.dense_read_by_position(rows)
    assert [(a, s, e) for a, s, e, _ in got] == [("mtraining", 0, [0, 10, 20, 30]), ("msa", 0, [0, 10, 20, 30])]
    assert np.allclose(got[0][3], [0.2, 0.2, 0.2]) and np.allclose(got[1][3], [0.0, 0.1, 0.3])
    md = quality_seeds.seed_report_md(rows)
    assert "| msa | 0 | +0.000 (0-10) | +0.100 | +0.300 (20-30) | +0.000, +0.100, +0.300 |" in md
    assert "| mtraining | 0 | +0.200 (0-10) | +0.200 | +0.200 (20-30) |" in md
    assert "Dense read minus own read" not in quality_seeds.seed_report_md(rows[:1] + rows[3:])


def test_loss_at_equal_training_time():
    """Each seed's arms are read at its fastest arm's training time: the slower arm's held-out curve
    is interpolated in time, the faster arm's is its final value."""
    def row(arm, sec_per_step, curve):
        return {"arm": arm, "seed": 0, "steps": 4, "tokens": 4096, "tokens_per_step": 1024, "corpus_sha": "x",
                "heldout_loss": curve[-1][1], "train_loss": [[s, 5.0 - s] for s in range(1, 5)],
                "heldout_curve": curve, "train_time": [[s, sec_per_step * s] for s in range(1, 5)]}

    rows = [row("dense", 2.0, [[2, 3.0], [4, 2.0]]), row("mtraining", 1.0, [[2, 2.9], [4, 1.9]])]
    vals, _ = quality_seeds.seed_values(rows)
    d, m = vals[("dense", 0)], vals[("mtraining", 0)]
    assert d["equal_time"] == m["equal_time"] == 4.0
    assert m["heldout_equal_time"] == 1.9 and d["heldout_equal_time"] == 3.0  # dense at step 2 by 4 s
    assert d["train_loss_equal_time"] == 3.0 and m["train_loss_equal_time"] == 1.0  # last 5 % = 1 step
    iv = quality_seeds.paired_differences(vals, "mtraining", "heldout_equal_time")
    assert np.isclose(iv["mean"], -1.1) and iv["lo"] is None
    md = quality_seeds.seed_report_md(rows)
    assert "| held-out loss, trainer's eval, at equal training time | mtraining − dense | 1 | -1.1 | — |" in md
    assert "seed 0: 4.0" in md


def test_seed_plot_bands(tmp_path):
    """loss_vs_tokens.png from 2 arms x 3 seeds of 40 steps: mean line, min-max band, zoom on the end."""
    rows = [{"arm": arm, "seed": s, "steps": 40, "tokens": 40 * 1024, "tokens_per_step": 1024, "corpus_sha": str(s),
             "heldout_loss": 2.0, "train_loss": [[k, 4.0 - 0.05 * k + 0.01 * s - 0.1 * (arm == "msa")] for k in range(1, 41)],
             "heldout_curve": [[k, 3.9 - 0.05 * k] for k in (10, 20, 30, 40)],
             "train_time": [[k, (1.0 if arm == "dense" else 0.6) * k] for k in range(1, 41)]}
            for arm in ("dense", "msa") for s in range(3)]
    md = quality_study.write_seed_report(rows, str(tmp_path))
    assert "| msa − dense | 3 |" in md and os.path.getsize(tmp_path / "loss_vs_tokens.png") > 20_000


def test_select_runs_keeps_named_runs_and_arms():
    rows = [{"run": "a", "arm": "dense", "seed": 0}, {"run": "a", "arm": "msa", "seed": 0},
            {"run": "b", "arm": "msa", "seed": 0}, {"run": "b", "arm": "mtraining", "seed": 0}, {"arm": "dense"}]
    assert quality_seeds.select_runs(rows, "a") == rows[:2]
    assert quality_seeds.select_runs(rows, "a:dense,b") == [rows[0]] + rows[2:4]
    assert quality_seeds.select_runs(rows, "a:dense+msa, b:mtraining") == rows[:2] + [rows[3]]
    with pytest.raises(ValueError, match="unknown arm.*'sparse'"):
        quality_seeds.select_runs(rows, "a:sparse")
    with pytest.raises(ValueError, match=r"run tag\(s\) \['c'\]"):
        quality_seeds.select_runs(rows, "a,c")


def test_sparse_arms_are_paired_with_each_other():
    def row(arm, seed, loss):
        return {"arm": arm, "seed": seed, "heldout_loss": loss, "corpus_sha": f"c{seed}", "tokens": 10, "steps": 1}
    rows = [row("dense", s, 2.0) for s in range(3)] + [row("mtraining", s, 1.0 + 0.1 * s) for s in range(3)]
    rows += [row("msa", s, 1.2 + 0.1 * s + 0.01 * s * s) for s in range(3)]
    md = quality_seeds.seed_report_md(rows)
    assert "The sparse arms paired with each other" in md
    # msa - mtraining per seed: 0.2, 0.21, 0.24 -> mean 0.2167; relative: 20 %, 19.09 %, 20 %
    assert "| msa − mtraining | 3 | +0.2167 |" in md and "s0: +0.2, s1: +0.21, s2: +0.24 | higher than mtraining" in md
    assert "| msa − mtraining | 3 | +19.70 |" in md and "s0: +20.00, s1: +19.09, s2: +20.00" in md
    assert "paired with each other" not in quality_seeds.seed_report_md([r for r in rows if r["arm"] != "msa"])


def test_a_trained_arm_without_its_evaluation_is_reported_as_such():
    """Run s16 (committed): the MTraining row has the trainer's curves and no evaluation (eval_error). The
    report keeps its trainer columns, leaves the evaluator's empty and says why; the one-seed gap is the
    trainer's final held-out difference the results state (+0.0028)."""
    rows = quality_seeds.select_runs(quality_seeds.read_rows([os.path.join(os.path.dirname(__file__), "..",
                                                                          "results", "quality", "quality.jsonl")]),
                                     "s16-copy-pretrained-seed0")
    assert sorted(r["arm"] for r in rows) == ["dense", "mtraining"]
    vals, notes = quality_seeds.seed_values(rows)
    assert vals[("mtraining", 0)]["heldout_loss"] is None and vals[("dense", 0)]["heldout_loss"] == pytest.approx(1.1369, abs=1e-4)
    assert vals[("mtraining", 0)]["trainer_heldout_final"] - vals[("dense", 0)]["trainer_heldout_final"] == pytest.approx(
        0.002845, abs=1e-6)
    assert notes == ["mtraining seed 0: not evaluated (the device time ran out during the evaluation "
                     "(the trainer's held-out curve is complete)); only the trainer's columns and curves"]
    md = quality_seeds.seed_report_md(rows)
    assert "| mtraining | 0 | — | 1.0610 |" in md and "one seed: no interval, no difference established" in md
    assert "mtraining seed 0: not evaluated" in md



def test_committed_study_rows_carry_every_required_field():
    """Every row of the multi-seed study in results/quality/quality.jsonl (the rows that carry ``arm``) has
    issue 37's fields: provenance always filled in, a measurement ``None`` only where the row says why
    (``eval_error`` / ``eval_skipped`` / ``error``). The rows without ``arm`` are the single-seed runs written before
    the protocol (s1-s5; their provenance filled in later), which the report leaves out."""
    path = os.path.join(os.path.dirname(__file__), "..", "results", "quality", "quality.jsonl")
    rows = [json.loads(line) for line in open(path) if line.strip()]
    legacy = {r.get("run") for r in rows if "arm" not in r}
    assert legacy == {"s1-first-study", "s3-seed1-budget-sweep", "s4-500-steps", "s4-500-steps-rerun-cross-eval",
                      "s5-msa-500-steps"}
    for r in rows:
        for k in ("commit", "date", "device", "jax", "command"):
            assert r.get(k), (r.get("run"), k)
        if "arm" not in r:
            continue
        assert r["arm"] in quality_seeds.VARIANTS and isinstance(r["seed"], int), r.get("run")
        assert all(k in r for k in quality_study.REQUIRED), (r["run"], [k for k in quality_study.REQUIRED if k not in r])
        unmeasured = [k for k in quality_study.REQUIRED if r[k] is None]
        assert not unmeasured or any(r.get(k) for k in ("eval_error", "eval_skipped", "error")), (r["run"], unmeasured)
        if r["heldout_loss"] is not None:
            assert np.isfinite(r["heldout_loss"]) and r["tokens"] == r["steps"] * r["tokens_per_step"], r["run"]
        if r["niah_accuracy"] is not None:
            assert 0 <= r["niah_accuracy"] <= 1 and 0 < r["recall"] <= 1, r["run"]
