"""``benchmarks/quality_budget_plot.py``: each arm's budget sweep read back by run, labelled by its overrides, printed
with the cap statistics and drawn; a run without a sweep is refused by name."""

import json
import os

from benchmarks.quality_budget_plot import budget_label, main, sweeps


def _entry(budget, recall, density, layers=3):
    return {"budget": budget, "p": 0.9, "mean_recall": recall, "min_recall": recall - 0.3, "mean_density": density,
            "layer_recall": [recall - 0.05 * i for i in range(layers)], "layer_density": [density] * layers,
            "mean_window_recall": recall + 0.07, "mean_vertical_capped": 0.5 if not budget else 0.0,
            "mean_slash_capped": 0.25}


def _rows(tmp_path):
    rows = [{"run": "r1", "arm": arm, "variant": arm, "seed": 5, "recall_budgets": [
        _entry({}, base, 0.17), _entry({"vertical_max": 32768}, base + 0.1, 0.3),
        _entry({"last_q": 1024, "slash_max": 512}, base + 0.15, 0.45)]}
        for arm, base in (("dense", 0.70), ("mtraining", 0.67))]
    rows[0]["warm_start"] = {"steps": 400, "recall_budgets": [_entry({}, 0.66, 0.16)]}  # --warm-start-eval's sweep
    rows.append({"run": "r0", "arm": "dense", "seed": 4})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_budget_label():
    assert budget_label({}) == "defaults"
    assert budget_label({"last_q": 1024, "vertical_max": 32768}) == "last_q=1024 vertical_max=32768"


def test_sweeps_are_read_per_arm_and_drawn(tmp_path, capsys):
    from benchmarks.quality_seeds import read_rows

    path = _rows(tmp_path)
    sw = sweeps(read_rows([path]), "r1")
    assert sorted(sw) == [("dense", 5), ("dense step 400", 5), ("mtraining", 5)]
    assert [e["label"] for e in sw[("dense step 400", 5)]] == ["defaults"]
    assert [e["label"] for e in sw[("mtraining", 5)]] == ["defaults", "vertical_max=32768", "last_q=1024 slash_max=512"]
    assert [round(e["mean_recall"], 2) for e in sw[("mtraining", 5)]] == [0.67, 0.77, 0.82]
    out = tmp_path / "b.png"
    assert main(["--rows", path, "--run", "r1", "--out", str(out)]) == 0 and os.path.getsize(out) > 10_000
    text = capsys.readouterr().out
    assert ("mtraining seed 5: defaults: recall 0.670 (min head 0.370), density 0.170, window_recall 0.740, "
            "vertical_capped 0.500, slash_capped 0.250") in text
    assert main(["--rows", path, "--run", "r0", "--out", str(tmp_path / "x.png")]) == 1
    assert "run 'r0': no row with recall_budgets" in capsys.readouterr().err


def test_report_table_carries_the_cap_statistics(tmp_path):
    from benchmarks.quality_report import budget_table
    from benchmarks.quality_seeds import read_rows

    rows = [r for r in read_rows([_rows(tmp_path)]) if r["run"] == "r1"]
    del rows[0]["recall_budgets"][1]["mean_window_recall"]  # older rows lack the window's recall
    lines = budget_table(rows).splitlines()
    assert len(lines) == 2 + 6
    assert lines[2] == "| dense | model's own | 0.9 | 0.700 | 0.400 | 0.170 | 0.770 | 0.500 | 0.250 |"
    assert lines[3] == "| dense | vertical_max=32768 | 0.9 | 0.800 | 0.500 | 0.300 | — | 0.000 | 0.250 |"
