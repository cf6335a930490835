"""``benchmarks/kernel_targets.py``: issue 34's targets against a run's rows, a verdict only where the repeats'
interval lies on one side of the target."""

from __future__ import annotations

import json

import pytest

from benchmarks import kernel_targets


def _row(name, seq, density, fb, fb_spread, fwd=1.0, fwd_spread=None, run="r1"):
    pairs = density * 16 * seq * (seq + 1) / 2
    return dict(run=run, name=name, seq=seq, density=density, fb_ms=fb, fb_spread_ms=fb_spread, fwd_ms=fwd,
                fwd_spread_ms=fwd_spread or [fwd, fwd], fb_tflops=3.5 * 4 * pairs * 128 / (fb / 1e3) / 1e12)


def _rows():
    S = 131072
    return [_row("cudnn", S, 1.0, 480.0, [470.0, 490.0]),
            _row("auto_band95", S, 0.05, 28.0, [27.5, 28.5]),       # 16.8-17.8x cuDNN; ~437 TFLOP/s
            _row("triton_band95", S, 0.05, 30.0, [29.5, 30.5]),     # 1.04-1.11x: not met
            _row("auto_spread95", S, 0.05, 30.5, [29.0, 31.0]),     # 15.2-16.9x: tie
            _row("auto[dkv=shared]_spread95", S, 0.05, 20.0, [20.0, 20.0]),  # another option tag: left out
            _row("auto_vert98", S, 0.02, 16.0, [15.0, 17.0]),       # ~306 TFLOP/s at 2 %
            _row("auto_model_L1", S, 0.061, 40.0, [39.0, 41.0]),
            _row("cudnn", 32768, 1.0, 28.5, [28.0, 29.0], fwd=7.0, fwd_spread=[6.8, 7.2], run="r2"),
            _row("auto_full", 32768, 1.0, 30.0, [29.5, 30.5], fwd=7.2, fwd_spread=[7.1, 7.3], run="r2")]


def test_verdicts_follow_the_repeats_interval():
    got = {(c["run"], c["target"], c["case"]): c for c in kernel_targets.check(_rows())}
    band = got["r1", "x cuDNN at 5 %", "band95"]
    assert band["verdict"] == "met" and band["interval"] == pytest.approx((470 / 28.5, 490 / 27.5))
    assert band["value"] == pytest.approx(480 / 28)
    assert got["r1", "TFLOP/s at 5 %", "band95"]["verdict"] == "met"
    assert got["r1", "x Triton", "band95"]["verdict"] == "not met"
    assert got["r1", "x Triton", "band95"]["interval"] == pytest.approx((29.5 / 28.5, 30.5 / 27.5))
    assert got["r1", "x cuDNN at 5 %", "spread95"]["verdict"] == "tie"
    assert got["r1", "TFLOP/s at 2 %", "vert98"]["verdict"] == "not met"
    assert ("r1", "x cuDNN at 5 %", "vert98") not in got  # 2 %: TFLOP/s only
    assert ("r1", "TFLOP/s at 5 %", "model_L1") in got  # the model's own budget (6.1 %) counts as 5 %
    full = got["r2", "fwd x cuDNN, full 32K", "full"]
    assert full["value"] == pytest.approx(7.0 / 7.2) and full["verdict"] == "tie"  # 0.93-1.01 against 0.95
    assert got["r2", "fb x cuDNN, full 32K", "full"]["verdict"] == "met"  # 28 / 30.5 = 0.92 at worst
    assert got["r1", "x cuDNN at 5 %", "spread95"]["value"] == pytest.approx(480 / 30.5)  # the tagged row left out
    tagged = [c for c in kernel_targets.check(_rows(), tag="dkv=shared")]
    assert [(c["target"], c["case"]) for c in tagged] == [("TFLOP/s at 5 %", "spread95"), ("x cuDNN at 5 %", "spread95")]
    assert tagged[1]["value"] == pytest.approx(480 / 20)


def test_cli_prints_the_table_and_refuses_rows_without_targets(tmp_path, capsys):
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    assert kernel_targets.main([str(f), "--runs", "r2"]) == 0
    out = capsys.readouterr().out
    assert "| r2 | fwd x cuDNN, full 32K | full | 0.97 | 0.93-1.01 | 0.95 | tie |" in out and "r1" not in out
    g = tmp_path / "none.jsonl"
    g.write_text(json.dumps(_row("cudnn", 4096, 1.0, 1.0, [1.0, 1.0])) + "\n")
    with pytest.raises(SystemExit):
        kernel_targets.main([str(g)])
    assert "no Mosaic rows" in capsys.readouterr().err


def test_rounds_are_checked_apart_and_pooled():
    """Two calls of one run (``round`` 1 and 2, each with its own cuDNN row): each round's cuDNN divides its own
    round's time, the median is over the rounds and the interval spans both, so one round's miss makes a tie."""
    S = 131072
    rows = [dict(_row("cudnn", S, 1.0, 480.0, [470.0, 490.0]), round=1),
            dict(_row("auto_band95", S, 0.05, 28.0, [27.5, 28.5]), round=1),
            dict(_row("cudnn", S, 1.0, 500.0, [495.0, 505.0]), round=2),
            dict(_row("auto_band95", S, 0.05, 32.0, [31.5, 32.5]), round=2)]
    got = {c["target"]: c for c in kernel_targets.check(rows)}
    x = got["x cuDNN at 5 %"]
    assert x["rounds"] == pytest.approx([480 / 28, 500 / 32])
    assert x["value"] == pytest.approx((480 / 28 + 500 / 32) / 2)
    assert x["interval"] == pytest.approx((495 / 32.5, 490 / 27.5))
    assert x["verdict"] == "tie"  # round 1 alone: met (16.5-17.8); round 2 alone: not met (15.2-16.0)
    alone = {c["target"]: c for c in kernel_targets.check(rows[:2])}
    assert alone["x cuDNN at 5 %"]["verdict"] == "met" and alone["x cuDNN at 5 %"]["rounds"] == [x["rounds"][0]]


def test_training_targets_from_the_trainer_rows():
    """``train_throughput`` rows at 128K: the speed-up's interval from single steps; peak and compile are upper
    bounds (``met`` at or below the goal); a run without both backends, or another length, checks nothing."""
    def train(backend, steps, peak, compile_s, seq=131072):
        return dict(run="t", backend=backend, seq_len=seq, step_ms=sorted(steps)[1], step_ms_all=steps,
                    peak_gib=peak, compile_s=compile_s, error=None)

    rows = [train("mtraining", [1560.0, 1550.0, 1580.0], 35.0, 25.0),
            train("cudnn", [7000.0, 7010.0, 6990.0], 32.0, 9.0)]
    got = {c["target"]: c for c in kernel_targets.check(rows)}
    ratio = got["train x all-cuDNN"]
    assert ratio["value"] == pytest.approx(7000 / 1560)
    assert ratio["interval"] == pytest.approx((6990 / 1580, 7010 / 1550))
    assert ratio["verdict"] == "tie"  # 4.42-4.52 against 4.5
    peak = got["train peak / cuDNN's"]
    assert peak["value"] == pytest.approx(35 / 32) and peak["verdict"] == "not met"
    assert got["train compile s"]["verdict"] == "not met"
    rows[0].update(peak_gib=33.0, compile_s=19.0)
    got = {c["target"]: c["verdict"] for c in kernel_targets.check(rows)}
    assert got["train peak / cuDNN's"] == got["train compile s"] == "met"
    assert kernel_targets.check(rows[:1]) == [] and kernel_targets.check([dict(r, seq_len=65536) for r in rows]) == []
