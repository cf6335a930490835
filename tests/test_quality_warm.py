"""benchmarks/quality_warm.py (``quality_study.py --warm-start W``): every arm of a seed continues one dense
run from its step W. Checked at --smoke size on the CPU: the dense arm continued from the warm start is the
run that was never split (same losses at every later step), the MTraining arm starts from the same step,
a second call reuses the warm start, the report says so, and a bad W is refused by name."""

import json
import os

import numpy as np
import pytest

from benchmarks import quality_study
from benchmarks.quality_seeds import read_rows, seed_values

pytestmark = pytest.mark.usefixtures("jax_compilation_cache")


def _rows(out):
    return {r["arm"]: r for r in (json.loads(line) for line in open(os.path.join(out, "quality.jsonl")))}


@pytest.mark.slow(seconds=40)
def test_arms_continue_one_dense_run(tmp_path):
    work = str(tmp_path / "work")
    common = ["--work", work, "--smoke", "--steps", "4", "--recall-ps", "0.9", "--no-untrained-recall",
              "--cross-eval", "none"]
    assert quality_study.main(["--out", str(tmp_path / "a"), "--variant", "both", "--warm-start", "2", *common]) == 0
    rows = _rows(tmp_path / "a")
    ck = os.path.join(work, "seed0", "warm", "checkpoints")
    for arm in ("dense", "mtraining"):
        r = rows[arm]
        assert r["warm_start"]["steps"] == 2 and r["warm_start"]["checkpoints"] == ck, arm
        # whole-schedule curves: the warm start's steps 1-2, then the arm's own 3-4
        assert [s for s, _ in r["train_loss"]] == [1, 2, 3, 4] and r["steps"] == 4 and np.isfinite(r["heldout_loss"])
        assert [s for s, _ in r["train_time"]] == [1, 2, 3, 4]
    warm = rows["dense"]["warm_start"]
    assert [s for s, _ in warm["train_loss"]] == [1, 2] and not warm["reused"]
    # both arms paid the same measured dense prefix (not two steps at their own speed), then their own steps
    for arm in ("dense", "mtraining"):
        assert rows[arm]["train_time"][:2] == warm["train_time"] and rows[arm]["train_loss"][:2] == warm["train_loss"]
        assert rows[arm]["train_compute_seconds"] > rows[arm]["train_time"][1][1] > 0
    # the dense arm of a run that was never split: the same losses at steps 3-4 (same state, schedule, data)
    assert quality_study.main(["--out", str(tmp_path / "one"), "--work", str(tmp_path / "w1"), "--variant", "dense",
                               "--no-eval", *common[2:]]) == 0
    one = _rows(tmp_path / "one")["dense"]
    np.testing.assert_allclose([v for _, v in one["train_loss"]],
                               [v for _, v in rows["dense"]["train_loss"]], rtol=1e-6)
    # the MTraining arm restored the same state: at this size its index keeps every block of the 512-token
    # window, so its steps 3-4 are the unsplit dense run's up to float rounding (a fresh start: 6.14 at step 1)
    np.testing.assert_allclose([v for _, v in rows["mtraining"]["train_loss"][2:]],
                               [v for _, v in one["train_loss"][2:]], rtol=1e-5)
    _, notes = seed_values(read_rows([os.path.join(tmp_path / "a", "quality.jsonl")]))
    assert any("every arm continues one dense run from its step 2" in n for n in notes)
    # a second call reuses the warm start; an arm without one is not paired with one that has it
    assert quality_study.main(["--out", str(tmp_path / "b"), "--variant", "mtraining", "--warm-start", "2",
                               "--no-eval", *common]) == 0
    again = _rows(tmp_path / "b")["mtraining"]
    assert again["warm_start"]["reused"] and again["warm_start"]["train_loss"] == warm["train_loss"]
    assert "eval" not in again["warm_start"]
    # --warm-start-eval: the evaluator on the step-2 checkpoint (where the arms start), kept for later calls
    assert quality_study.main(["--out", str(tmp_path / "c"), "--variant", "dense", "--warm-start", "2",
                               "--warm-start-eval", "--recall-budgets", ";vertical_max=512,slash_max=8", "--no-eval",
                               *common]) == 0
    ev = _rows(tmp_path / "c")["dense"]["warm_start"]
    assert ev["reused"] and np.isfinite(ev["heldout_loss"]) and 0 <= ev["niah_accuracy"] <= 1
    # ... and the budget sweep on the same parameters: the defaults' entry is the evaluation's recall
    own, wide = ev["recall_budgets"]
    assert own["budget"] == {} and wide["budget"] == {"vertical_max": 512, "slash_max": 8}
    assert abs(own["mean_recall"] - ev["eval"]["recall"]["mean_recall"]["0.9"]) < 1e-6
    assert wide["mean_recall"] >= own["mean_recall"] - 1e-6 and "mean_vertical_capped" in own
    assert ev["eval"]["label"] == "warm start seed 0, dense step 2"
    assert ev["heldout_loss"] != rows["dense"]["heldout_loss"]  # step 2's parameters, not step 4's
    _, notes = seed_values(read_rows([os.path.join(tmp_path / "c", "quality.jsonl")]))
    assert any(f"there NIAH {ev['niah_accuracy']:.3f}, held-out loss {ev['heldout_loss']:.4f}" in n for n in notes)
    np.testing.assert_allclose([v for _, v in again["train_loss"]],
                               [v for _, v in rows["mtraining"]["train_loss"]], rtol=1e-6)
    vals, notes = seed_values([rows["dense"] | {"warm_start": None}, rows["mtraining"]])
    assert vals[("dense", 0)].get("unpaired") and any("differ in warm_start" in n for n in notes)


@pytest.mark.parametrize("argv, message", [
    (("--warm-start", "4"), "--warm-start 4 must be below the arms' steps \\(4\\)"),
    (("--warm-start", "-1"), "--warm-start must be >= 0, got -1"),
    (("--warm-start", "2", "--gpu-per-arm", "--gpus", "0,1", "--pretrain-steps", "0"),
     "--warm-start 2 with --gpu-per-arm needs copy pretraining"),
])
def test_a_bad_warm_start_is_refused_by_name(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        quality_study.main(["--out", str(tmp_path), "--steps", "4", *argv])
