"""benchmarks/quality_args.py: the quality study's flags, unset ones taken from the protocol
(configs/quality/study.yaml), and a value out of range refused by name before anything trains."""

import os

import pytest

from benchmarks.quality_args import parser, resolve_flags
from benchmarks.quality_protocol import load_study
from benchmarks.quality_study import STUDY


def _resolve(*argv):
    args = parser("test").parse_args(["--out", "x", *argv])
    resolve_flags(args, load_study(STUDY))
    return args


def test_unset_flags_take_the_protocol_and_set_ones_win():
    study = load_study(STUDY)
    a = _resolve()
    assert (a.retrieval_mix, a.retrieval_keys, a.retrieval_share) == (
        study["retrieval"]["mix"], study["retrieval"]["keys"], study["retrieval"]["share"])
    assert a.eval_haystack == study["eval"]["haystack"] and a.cross_eval == study["eval"]["cross_eval"]
    assert a.train_overrides == list(study["train"]) and a.recall_p == float(study["eval"]["recall_p"])
    assert a.retrieval_tasks == {t: float(w) for t, w in study["retrieval"]["tasks"].items()}
    b = _resolve("--retrieval-keys", "3", "--retrieval-mix", "0.5", "--eval-haystack", "filler", "--cross-eval", "none",
                 "--set", "optim.lr=1e-3", "--set", "optim.weight_decay=0.1", "--no-cross-eval-loss-only")
    assert (b.retrieval_keys, b.retrieval_mix, b.eval_haystack, b.cross_eval) == (3, 0.5, "filler", None)
    assert b.train_overrides == ["optim.lr=1e-3", "optim.weight_decay=0.1"]  # a later lr replaces the study's
    assert b.cross_eval_loss_only is False
    assert _resolve("--smoke").cross_eval == "ring"  # no cuDNN on the CPU


@pytest.mark.parametrize("argv, message", [
    (("--copy-share", "1"), "--copy-share must lie in \\[0, 1\\), got 1.0"),
    (("--retrieval-mix", "1.5"), "--retrieval-mix must lie in \\[0, 1\\] \\(got 1.5\\)"),
    (("--retrieval-keys", "-1"), "\\(got -1\\)"),
    (("--retrieval-share", "0"), "--retrieval-share in \\(0, 1\\] \\(got 0.0\\)"),
    (("--run-steps", "0"), "--run-steps must be >= 1, got 0"),
    (("--set", "steps=5"), "'steps' is set by the study"),
    (("--set", "optim.lr"), "expected KEY=VALUE"),
])
def test_values_out_of_range_stop_the_call_naming_them(argv, message):
    with pytest.raises(SystemExit, match=message):
        _resolve(*argv)


def test_a_string_where_a_number_belongs_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        _resolve("--retrieval-keys", "many")
    assert "--retrieval-keys: invalid int value: 'many'" in capsys.readouterr().err


def test_deterministic_override_sets_the_xla_flag_before_jax_starts(monkeypatch):
    """``--set deterministic=true`` reaches the pretraining and every arm (one process), so the study asks
    XLA for deterministic GPU ops itself; false or absent leaves XLA_FLAGS alone; a non-boolean is refused."""
    from mtraining_jax.train.determinism import FLAG

    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=0")
    a = _resolve("--set", "deterministic=true")
    assert "deterministic=true" in a.train_overrides  # and so in every row's train_overrides
    assert os.environ["XLA_FLAGS"] == f"--xla_gpu_autotune_level=0 {FLAG}"
    _resolve("--set", "deterministic=true")  # asked twice: the flag once
    assert os.environ["XLA_FLAGS"].split().count(FLAG) == 1
    monkeypatch.setenv("XLA_FLAGS", "")
    _resolve("--set", "deterministic=false")
    _resolve()
    assert os.environ["XLA_FLAGS"] == ""
    with pytest.raises(SystemExit, match="deterministic must be true or false, got 'deterministic=yes please'"):
        _resolve("--set", "deterministic=yes please")


def test_the_warm_start_protocol_file_is_the_s28_command():
    """configs/quality/study_warm.yaml holds what run s28's flags set (its row's command): the same resolved
    retrieval, evaluation, trainer overrides, copy-pretraining curriculum and warm start; --warm-start and
    --smoke still win over the file's warm start, and a bad warm_start in a study file is refused by name."""
    warm = os.path.join(os.path.dirname(STUDY), "study_warm.yaml")
    s28 = ("--steps 800 --retrieval-keys 48 --no-made-up-keys --cross-eval cudnn --pretrain-steps 4000 "
           "--pretrain-stages 512x128:300,1024x64:150,2048x32:150,4096x16:150,8192x8:200,16384x4:200,32768x2:200 "
           "--set optim.lr=3e-4 --warm-start 400").split()
    by_flags = _resolve(*s28)
    by_file = parser("test").parse_args(["--out", "x", "--study", warm])
    study = load_study(warm)
    resolve_flags(by_file, study)
    keys = ("retrieval_mix", "retrieval_keys", "retrieval_share", "fresh_retrieval", "copy_share", "made_up_keys",
            "retrieval_tasks", "eval_haystack", "train_overrides", "recall_p", "cross_eval", "cross_eval_loss_only",
            "pretrain", "warm_start")
    assert {k: getattr(by_file, k) for k in keys} == {k: getattr(by_flags, k) for k in keys}
    assert by_file.warm_start == 400 and study["token_budget"] == 800 * 32768
    assert _resolve().warm_start == 0  # the default study has none
    for argv, expect in ((("--warm-start", "0"), 0), (("--warm-start", "200"), 200), (("--smoke",), 0)):
        a = parser("test").parse_args(["--out", "x", "--study", warm, *argv])
        resolve_flags(a, study)
        assert a.warm_start == expect, argv


@pytest.mark.parametrize("value", ["-1", "'400'", "true", "1.5"])
def test_a_bad_warm_start_in_a_study_file_is_refused_by_name(tmp_path, value):
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"warm_start: {value}\n")
    with pytest.raises(ValueError, match="warm_start must be an integer >= 0"):
        load_study(str(bad))
