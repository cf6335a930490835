"""benchmarks/pretrain_determinism.py: two runs' losses compared bit for bit (the first differing step, the
largest difference), a run's losses read from its metrics, and bad settings refused by name before any run
starts. (The four-process run itself is a GPU measurement: results/quality/determinism.jsonl.)"""

import json

import pytest

from benchmarks.pretrain_determinism import compare, losses, main


def test_compare_finds_the_first_differing_step():
    a = [[1, 6.0], [2, 5.5], [3, 5.25], [4, 5.0]]
    same = compare(a, [list(p) for p in a])
    assert same["identical"] and same["first_diff_step"] is None and same["max_abs_diff"] == 0.0
    assert same["steps"] == 4 and same["losses"] == {"1": [6.0, 6.0], "2": [5.5, 5.5], "4": [5.0, 5.0]}
    b = [[1, 6.0], [2, 5.5], [3, 5.25 + 2e-7], [4, 5.0 - 1e-4]]
    d = compare(a, b)
    assert not d["identical"] and d["first_diff_step"] == 3 and d["max_abs_diff"] == pytest.approx(1e-4)
    # only the steps both runs logged are compared
    assert compare(a, b[:2])["identical"] and compare(a, b[:2])["steps"] == 2
    with pytest.raises(ValueError, match="no common step"):
        compare(a, [[9, 1.0]])


def test_losses_reads_the_first_stages_training_losses(tmp_path):
    run = tmp_path / "seed0" / "pretrain" / "run"
    run.mkdir(parents=True)
    rows = [{"step": 1, "split": "train", "loss": 6.5}, {"step": 1, "split": "eval", "loss": 6.4},
            {"step": 2, "loss": 6.25}, {"step": 2, "split": "train", "tokens_per_s": 5.0}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert losses(str(tmp_path)) == [[1, 6.5], [2, 6.25]]
    assert losses(str(tmp_path / "missing")) == []


@pytest.mark.parametrize("argv, message", [
    (["--steps", "1"], "--steps must be >= 2 \\(got 1\\)"),
    (["--batch", "0"], "--batch >= 1 \\(got 0\\)"),
    (["--mem-fraction", "0.3"], "--mem-fraction in \\(0, 0.25\\] \\(got 0.3\\)"),
])
def test_bad_settings_are_refused_by_name(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["--out", str(tmp_path), *argv])
    assert not list(tmp_path.iterdir())  # refused before anything was written or started
