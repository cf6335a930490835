"""benchmarks/quality_study.py --smoke: trains and evaluates the MTraining and MSA variants at toy
size on CPU and writes their small result files (the GPU study is the same code at configs/quality sizes)."""

import json
import os

import numpy as np

from benchmarks import quality_study


def test_quality_study_smoke(tmp_path):
    out = str(tmp_path / "out")
    rc = quality_study.main(["--out", out, "--work", str(tmp_path / "work"), "--smoke", "--variant", "mtraining",
                             "--recall-budgets", ";vertical_max=512,slash_max=8;vertical_min=512,last_q=128",
                             "--cross-eval", "reference", "--cross-eval-loss-only"])
    assert rc == 0
    (rec,) = [json.loads(line) for line in open(os.path.join(out, "quality.jsonl"))]
    assert rec["variant"] == "mtraining" and rec["steps"] == 2 and len(rec["train_loss"]) == 2
    assert rec["eval"]["model"]["backends"] == ["ring", "mtraining"]
    # the trainer's held-out loss and the evaluator's loss by position agree on the same first window
    held = rec["eval"]["perplexity"]
    assert abs(rec["heldout_loss"][-1][1] - sum(held["window_loss"][:1])) < 1e-3
    assert set(rec["recall_untrained"]["mean_recall"]) == {"0.9", "0.5"}
    # the budget sweep: the model's own budgets equal the evaluation's p = 0.9 recall; a budget that
    # keeps every column (vertical_min = vertical_max = S) recalls everything
    own, wide, full = rec["recall_budgets"]
    assert own["budget"] == {} and abs(own["mean_recall"] - rec["eval"]["recall"]["mean_recall"]["0.9"]) < 1e-6
    assert wide["budget"] == {"vertical_max": 512, "slash_max": 8}
    assert wide["mean_recall"] >= own["mean_recall"] - 1e-6 and wide["mean_density"] >= own["mean_density"] - 1e-6
    assert full["mean_recall"] > 0.999 and full["mean_density"] > 0.999 and len(full["layer_recall"]) == 2
    # read with dense attention in every layer: a genuine second evaluation of the same parameters
    cross = rec["cross_eval"]
    assert cross["backend"] == "reference" and cross["eval"]["model"]["backends"] == ["reference", "reference"]
    own_loss, dense_loss = held["mean_loss"], cross["eval"]["perplexity"]["mean_loss"]
    assert np.isfinite(dense_loss) and abs(dense_loss - own_loss) < 0.5 and dense_loss != own_loss
    rec2 = dict(rec, variant="dense")
    quality_study.write_report([rec2, rec], out)
    files = sorted(os.listdir(out))
    assert files == ["loss_curves.png", "quality.jsonl", "quality.md", "quality_niah.png",
                     "quality_position_loss.png", "quality_recall.png"]
    md = open(os.path.join(out, "quality.md")).read()
    assert "| metric | dense | mtraining | mtraining - dense |" in md and "| mtraining | 2 |" in md
    assert "| mtraining | vertical_min=512, last_q=128 | 0.9 |" in md
    assert "| mtraining | " in md and "| reference (every layer) |" in md


def test_quality_study_msa_smoke(tmp_path):
    """The MSA variant: warm-up steps from --msa-warmup-fraction, the KL coefficient override, its
    index-branch metrics per step and the MSA table; evaluated with its own (msa) layers."""
    out = str(tmp_path / "out")
    rc = quality_study.main(["--out", out, "--work", str(tmp_path / "work"), "--smoke", "--variant", "msa",
                             "--steps", "3", "--msa-warmup-fraction", "0.34", "--msa-kl-coef", "0.5", "--recall-ps", "0.9"])
    assert rc == 0
    (rec,) = [json.loads(line) for line in open(os.path.join(out, "quality.jsonl"))]
    m = rec["msa"]
    assert m["warmup_steps"] == 1 and m["kl_coef"] == 0.5 and m["config"]["top_k"] == 3
    assert [w for _, w in m["warmup"]] == [1.0, 0.0, 0.0]
    assert [w for _, w in m["work_fraction"]][0] == 1.0 and 0 < m["work_fraction_sparse_mean"] < 1
    assert all(v > 0 for _, v in m["kl"]) and all(v > 0 for _, v in m["kl_grad_norm"])
    assert 0 < m["recall_sparse_mean"] <= 1
    assert rec["eval"]["model"]["backends"] == ["ring", "msa"] and np.isfinite(rec["eval"]["perplexity"]["mean_loss"])
    md = open(os.path.join(out, "quality.md")).read()
    assert "| msa | 1 | 0.5 |" in md
    assert quality_study.msa_warmup_steps(500, 0.1) == 50 and quality_study.msa_warmup_steps(500, 0.0) == 0
