"""``eval.long_context``: the trainer (a 1-layer dense model on a 1x2 mesh) runs the evaluation package's NIAH / RULER-style scoring
every N steps and logs it (metrics.jsonl, the run result); bad settings fail before the run starts.
The hook is wired in from above both layers (``mtraining_jax.apps.train``, the ``mtraining-train``
command); the trainer alone refuses the section rather than silently skipping it."""

import json
import os

import pytest

from mtraining_jax.eval.api import evaluate_params
from mtraining_jax.eval.hook import LongContextHook
from mtraining_jax.train.config import load_config
from mtraining_jax.apps.train import HOOK_FACTORIES, run
from mtraining_jax.train import loop
from mtraining_jax.train.tokenizer import load_tokenizer

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_cpu.yaml")
SMALL = ["model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=1", "model.num_heads=2",
         "model.num_kv_heads=1", "data.seq_len=512", "steps=2", "model.attention_backend=ring", "checkpoint.every=0", "eval.every=0",
         "logging.progress=false", "logging.tensorboard=false", "logging.plot=false", "optim.warmup_steps=1",
         "mesh.shape=[1,2]", "eval.long_context.every=1", "eval.long_context.lengths=[512]",
         "eval.long_context.depths=[0,1]", "eval.long_context.samples=1", "eval.long_context.tasks=[multikey]",
         "eval.long_context.task_samples=1"]
KEYS = {"long/niah_accuracy", "long/niah_token_accuracy", "long/multikey_accuracy", "long/multikey_token_accuracy"}


def test_trainer_logs_long_context_accuracy(tmp_path):
    cfg = load_config(CONFIG, SMALL + [f"run_dir={tmp_path}"])
    runs = []
    result = run(cfg, hooks=[lambda r, step, metrics: runs.append(r)])
    recs = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    ev = [r for r in recs if r["split"] == "eval"]
    assert [r["step"] for r in ev] == [1, 2] and all(set(r) == KEYS | {"step", "split", "time"} for r in ev)
    assert [m["step"] for m in result.eval_metrics] == [1, 2]
    # the step-2 numbers are evaluate_params' on the final parameters (the hook's compiled predictor)
    hook = runs[0].hooks[0]
    res = evaluate_params(runs[0].model_cfg, result.params, load_tokenizer("byte"), hook.spec, mesh=runs[0].mesh,
                          progress=False, predictor=hook.predictor)
    want = LongContextHook.summary(res)
    assert set(want) == KEYS and {k: ev[-1][k] for k in KEYS} == want
    # an untrained model does not know the needles: whole answers are wrong
    assert want["long/niah_accuracy"] == want["long/multikey_accuracy"] == 0.0
    assert all(0.0 <= v < 1.0 for v in want.values())


def test_summary_averages_grid_and_lengths():
    res = {"niah": {"lengths": [256, 512], "accuracy": [[1.0, 0.0], [1.0, 0.5]],
                    "token_accuracy": [[1.0, 0.5], [1.0, 0.5]]},
           "ruler": {"tasks": {"vartrack": {"accuracy": [1.0, 0.5], "token_accuracy": [1.0, 0.0]}}}}
    assert LongContextHook.summary(res) == {
        "long/niah_accuracy": 0.625, "long/niah_token_accuracy": 0.75, "long/niah_accuracy@256": 1.0,
        "long/niah_accuracy@512": 0.25, "long/vartrack_accuracy": 0.75, "long/vartrack_token_accuracy": 0.5}


@pytest.mark.parametrize("override, message", [
    ("eval.long_context.tasks=[nope]", "eval.long_context: unknown RULER-style task(s) ['nope']"),
    ("eval.long_context.lengths=[16384]", "eval.long_context: context length 16384 exceeds the model's "
                                          "max_position_embeddings=8192"),
])
def test_bad_settings_fail_before_the_run(tmp_path, override, message):
    cfg = load_config(CONFIG, SMALL + [override, f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(ValueError) as e:
        run(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "r")


def test_trainer_without_the_hook_refuses_the_section(tmp_path):
    cfg = load_config(CONFIG, SMALL + [f"run_dir={tmp_path / 'r'}"])
    with pytest.raises(ValueError, match=r"eval.long_context is switched on but this entry point has no hook"):
        loop.run(cfg)
    with pytest.raises(ValueError, match=r"unknown config section\(s\) \['eval.nope'\]"):
        loop.run(cfg, hook_factories={**HOOK_FACTORIES, "eval.nope": lambda *a: []})
    assert not os.path.exists(tmp_path / "r")


def test_console_script_is_the_wired_trainer():
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts["mtraining-train"] == "mtraining_jax.apps.train:main"
