"""benchmarks/determinism_cost.py: step times summarised after the skipped warm-up, the deterministic run's
slowdown against its own arm's other run, rows rebuilt from saved metrics with provenance, the trainer runs'
configs resolving to the arm's backend and flag, and bad settings refused by name. (The timed runs themselves
are a GPU measurement: results/quality/determinism_cost.jsonl.)"""

import json

import pytest

from benchmarks.determinism_cost import main, rows, summarise, trainer_args
from mtraining_jax.train.config import load_config


def records(times, losses=None):
    losses = losses or [5.0 - 0.1 * i for i in range(len(times))]
    out = [{"step": i + 1, "split": "train", "loss": losses[i], "step_time": t} for i, t in enumerate(times)]
    return out + [{"step": len(times), "split": "eval", "loss": 9.9}]  # eval records are not steps


def test_summarise_skips_the_warm_up_and_reads_the_last_training_loss():
    s = summarise(records([30.0, 0.5, 0.2, 0.4, 0.3]), skip=1)
    assert s["steps_timed"] == 4 and s["step_s_median"] == pytest.approx(0.35)
    assert (s["step_s_min"], s["step_s_max"]) == (0.2, 0.5) and s["final_loss"] == pytest.approx(4.6)
    with pytest.raises(ValueError, match="after step 5"):
        summarise(records([1.0, 1.0]), skip=5)


def test_rows_give_the_deterministic_run_its_arms_slowdown():
    got = rows({("dense", True): records([9, 0.3, 0.3]), ("mtraining", False): records([9, 0.1, 0.2, 0.1]),
                ("mtraining", True): records([9, 0.4, 0.4, 0.5]), ("dense", False): records([9, 0.2, 0.2])}, skip=1)
    assert [(r["arm"], r["deterministic"]) for r in got] == [("mtraining", False), ("mtraining", True),
                                                             ("dense", False), ("dense", True)]
    assert "slowdown" not in got[0] and got[1]["slowdown"] == pytest.approx(4.0)
    assert got[3]["slowdown"] == pytest.approx(1.5)
    # without its arm's other run a deterministic row has no slowdown
    assert "slowdown" not in rows({("dense", True): records([9, 0.3])}, skip=1)[0]


def test_from_metrics_writes_rows_with_provenance(tmp_path):
    src = tmp_path / "m"
    src.mkdir()
    for name, t in (("mtraining-false", 0.15), ("mtraining-true", 0.375), ("dense-false", 0.2), ("dense-true", 0.25)):
        (src / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records([20.0] + [t] * 5)))
    argv = ["--out", str(tmp_path / "o"), "--from-metrics", str(src), "--skip", "1", "--device", "NVIDIA H200",
            "--jax", "0.11.2"]
    assert main(argv) == 0
    got = [json.loads(line) for line in open(tmp_path / "o" / "determinism_cost.jsonl")]
    assert len(got) == 4 and [r.get("slowdown") for r in got] == [None, pytest.approx(2.5), None,
                                                                     pytest.approx(1.25)]
    for r in got:
        assert r["steps_timed"] == 5 and all(r.get(k) for k in ("commit", "date", "command"))
        assert "--from-metrics" in r["command"] and (r["device"], r["jax"]) == ("NVIDIA H200", "0.11.2")


def test_repeats_alternate_the_flag_and_give_each_repeat_its_slowdown(tmp_path, capsys):
    src = tmp_path / "m"
    src.mkdir()
    for rep, (fast, slow) in enumerate(((0.1, 0.25), (0.1, 0.3), (0.1, 0.2))):
        for arm in ("mtraining", "dense"):
            for det, t in ((False, fast), (True, slow)):
                name = f"{arm}-{str(det).lower()}-r{rep}"
                (src / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records([20.0] + [t] * 3)))
    assert main(["--out", str(tmp_path / "o"), "--from-metrics", str(src), "--skip", "1", "--device", "H200",
                 "--jax", "0.11.2", "--repeats", "3"]) == 0
    got = [json.loads(line) for line in open(tmp_path / "o" / "determinism_cost.jsonl")]
    assert [r["repeat"] for r in got] == [0] * 4 + [1] * 4 + [2] * 4
    assert [r["slowdown"] for r in got if "slowdown" in r] == pytest.approx([2.5, 2.5, 3.0, 3.0, 2.0, 2.0])
    assert "mtraining: deterministic=true slowdown over 3 repeats: median 2.50x, range 2.00-3.00x" in capsys.readouterr().out


def test_repeats_run_the_flag_in_alternating_order(tmp_path, monkeypatch):
    import benchmarks.determinism_cost as dc

    order = []
    monkeypatch.setattr(dc, "train", lambda arm, det, *a: order.append((arm, det)) or 1)
    assert main(["--out", str(tmp_path), "--repeats", "2", "--smoke"]) == 0  # no metrics: no rows, no failure
    assert order == [("mtraining", False), ("mtraining", True), ("dense", False), ("dense", True),
                     ("mtraining", True), ("mtraining", False), ("dense", True), ("dense", False)]


@pytest.mark.parametrize("smoke", [False, True])
@pytest.mark.parametrize("arm", ["mtraining", "dense"])
def test_trainer_runs_resolve_to_the_arms_backend_and_flag(arm, smoke, tmp_path):
    config, sets = trainer_args(arm, True, 12, str(tmp_path / "r"), smoke)
    cfg = load_config(config, sets)
    assert cfg.deterministic is True and cfg.steps == 12 and cfg.run_dir == str(tmp_path / "r")
    assert cfg.eval.every == 0 and cfg.checkpoint.every == 0
    sparse = cfg.model.fields["attention_backend"] == "mtraining"
    assert sparse == (arm == "mtraining")
    if not smoke:  # the study's own arm configs, on data that needs no files
        assert cfg.data.source == "stdlib" and cfg.data.path is None and cfg.data.seq_len == 32768
        assert load_config(config, []).model.fields["attention_backend"] == cfg.model.fields["attention_backend"]
    assert load_config(*trainer_args(arm, False, 12, "x", smoke)).deterministic is False


@pytest.mark.parametrize("argv, message", [
    (["--skip", "-1"], "--skip must be >= 0 \\(got -1\\)"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--steps", "10", "--skip", "10"], "--steps above it \\(got 10\\)"),
    (["--from-metrics", "m"], "--from-metrics needs --device and --jax"),
    (["--from-metrics", "m", "--device", "H200"], "got --from-metrics 'm', --device 'H200', --jax None"),
    (["--device", "H200", "--jax", "0.11.2"], "--from-metrics needs --device and --jax"),
])
def test_bad_settings_are_refused_by_name(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main(["--out", str(tmp_path)] + argv)
