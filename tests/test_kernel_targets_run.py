"""``benchmarks/kernel_targets_run.py``: issue 34's targets measured in rounds, each step's rows tagged and checked
as they come, a step skipped where the budget no longer fits it."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import kernel_targets_run as ktr

S = 131072


def _kernel(name, seq, density, fb, fwd=1.0):
    pairs = density * 16 * seq * (seq + 1) / 2
    return dict(name=name, seq=seq, density=density, fb_ms=fb, fb_spread_ms=[fb, fb], fwd_ms=fwd,
                fwd_spread_ms=[fwd, fwd], fb_tflops=3.5 * 4 * pairs * 128 / (fb / 1e3) / 1e12)


def _train(backend, step, peak, compile_s=15.0):
    return dict(backend=backend, seq_len=S, step_ms=step, step_ms_all=[step - 1, step, step + 1], peak_gib=peak,
                compile_s=compile_s, error=None)


class FakeMachine:
    """A runner that returns canned rows per process and advances a clock by each step's cost."""

    def __init__(self, cost):
        self.now, self.cost, self.calls = 0.0, cost, []

    def clock(self):
        return self.now

    def runner(self, argv, work, timeout):
        self.calls.append((argv[0], argv[-1], work, timeout))
        if argv[0] == "benchmarks.train_throughput":
            self.now += self.cost["train"] / 2
            return [_train("mtraining", 1500.0, 33.3)] if argv[-1] == "mtraining" else [_train("cudnn", 7000.0, 32.1)]
        if "32768" in argv:
            self.now += self.cost["full32"]
            return [_kernel("cudnn", 32768, 1.0, 28.0, fwd=7.0), _kernel("auto_full", 32768, 1.0, 30.0, fwd=7.2)]
        sparsity = argv[argv.index("--sparsities") + 1]
        self.now += self.cost["fam5" if sparsity == "0.95" else "fam2"]
        d = 0.05 if sparsity == "0.95" else 0.02
        return [_kernel("cudnn", S, 1.0, 470.0), _kernel(f"triton_band{int(100 - 100 * d)}", S, d, 37.0),
                _kernel(f"auto_band{int(100 - 100 * d)}", S, d, 29.0 if d == 0.05 else 14.0)]


def test_rounds_tag_rows_and_every_target_is_checked(tmp_path):
    m = FakeMachine({"fam5": 100, "fam2": 80, "full32": 40, "train": 90})
    rows = ktr.run(str(tmp_path / "out"), str(tmp_path / "work"), 2, list(ktr.STEPS), runner=m.runner, clock=m.clock)
    assert [(r["run"], r["round"]) for r in rows if r.get("name") == "cudnn" or r.get("backend") == "cudnn"] == [
        (s, rnd) for rnd in (1, 2) for s in ("fam5", "fam2", "full32", "train")]
    saved = [json.loads(line) for line in open(tmp_path / "out" / "rows.jsonl")]
    assert saved == rows and {r["table"] for r in saved} == {"families", "train"}
    md = (tmp_path / "out" / "targets.md").read_text()
    for line in ("| fam5 | x cuDNN at 5 % | band95 | 16.21 | 16.21-16.21 | 16 | met | 16.21 / 16.21 |",
                 "| fam2 | TFLOP/s at 2 % | band98 |", "| full32 | fb x cuDNN, full 32K | full | 0.93 |",
                 "| train | train x all-cuDNN | train 128K | 4.67 | 4.66-4.67 | 4.5 | met | 4.67 / 4.67 |",
                 "| train | train peak / cuDNN's | train 128K | 1.04 |",
                 "| train | train compile s | train 128K | 15.00 |"):
        assert line in md, (line, md)
    # the kernels' processes get the model index; work folders are per (round, step, process)
    assert m.calls[0][0] == "benchmarks.kernels" and ktr.MODEL_INDEX in ktr.STEPS["fam5"][0][0]
    assert len({c[2] for c in m.calls}) == len(m.calls) == 2 * 5


def test_budget_skips_a_step_that_no_longer_fits(tmp_path, capsys):
    m = FakeMachine({"fam5": 200, "fam2": 150, "full32": 40, "train": 90})
    rows = ktr.run(str(tmp_path), str(tmp_path / "w"), 2, ["fam5", "fam2", "full32"], budget=500, runner=m.runner,
                   clock=m.clock)
    # round 1: 200 + 150 + 40 = 390 s; round 2: fam5 (its 200 s > 110 left) and fam2 skipped, full32 fits
    assert [(r["run"], r["round"]) for r in rows if r["name"] == "cudnn"] == [
        ("fam5", 1), ("fam2", 1), ("full32", 1), ("full32", 2)]
    assert "round 2 fam5: needs ~200 s, 110 s left: skipped" in capsys.readouterr().out
    assert m.calls[-1][3] == pytest.approx(110)  # the process's timeout: what the budget leaves (500 - 390)


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        ktr.main(["--out", "x", "--steps", "fam5,nope"])
    with pytest.raises(ValueError, match=r"unknown \['nope'\]"):
        ktr.run("x", "y", 1, ["nope"])
    with pytest.raises(ValueError, match="--rounds must be >= 1, got 0"):
        ktr.run("x", "y", 0, ["fam5"])


def test_a_step_process_returns_its_json_rows_and_nothing_past_its_timeout(tmp_path):
    """One real ``python -m benchmarks.kernels`` process at a toy size through ``step_rows`` (its ``--json``
    rows with provenance), and one stopped by its timeout (no rows)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    argv = ["benchmarks.kernels", "--seqs", "256", "--sparsities", "0.9", "--families", "band", "--dense-max", "256",
            "--mha-max", "0", "--reps", "1", "--impls", "xla"]
    cwd = os.getcwd()
    os.chdir(root)
    try:
        rows = ktr.step_rows(argv, str(tmp_path / "a"), 300)
        assert ktr.step_rows(argv, str(tmp_path / "b"), 0.01) == []
    finally:
        os.chdir(cwd)
    assert {r["name"] for r in rows} == {"cudnn", "xla_full", "xla_band90"}, rows
    assert all(r["command"].startswith("python -m benchmarks.kernels --seqs 256") for r in rows)
