"""End-to-end training through the CLI, exact resume, non-finite stop, interrupted saves, bad input.

All runs use configs/tiny_cpu.yaml with overrides that shrink it to CI size (2 layers, 64 wide,
512-token sequences) on the 8 virtual CPU devices of conftest.py in the config's 2 x 4 mesh.
"""

import json
import math
import os
import re
import shutil

import jax
import numpy as np
import pytest

from mtraining_jax.train import cli
from mtraining_jax.train.checkpoint import Checkpointer
from mtraining_jax.train.config import load_config
from mtraining_jax.train.loop import NonFiniteLossError, run

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_cpu.yaml")
SMALL = [
    "model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2",
    "model.num_heads=2", "model.num_kv_heads=1", "data.seq_len=512", "eval.batches=1",
    "eval.passkey_samples=1", "logging.progress=false", "optim.warmup_steps=1",
]


pytestmark = pytest.mark.usefixtures("jax_compilation_cache")


def _cfg(tmp_path, *extra):
    return load_config(CONFIG, SMALL + [f"run_dir={tmp_path}"] + list(extra))


@pytest.mark.slow(seconds=33)
def test_cli_end_to_end_loss_falls_with_checkpoint_and_plot(tmp_path, capsys):
    rc = cli.main(["--config", CONFIG, *SMALL, f"run_dir={tmp_path}", "steps=6", "checkpoint.every=3",
                   "eval.every=3"])
    assert rc == 0
    recs = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    train = [r["loss"] for r in recs if r["split"] == "train"]
    assert len(train) == 6
    assert train[0] == pytest.approx(math.log(512), abs=0.15)  # uniform over the vocab at init
    assert train[-1] < train[0] - 1.0, train
    evals = [r for r in recs if r["split"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    assert evals[1]["loss"] < evals[0]["loss"]
    assert evals[1]["perplexity"] == pytest.approx(math.exp(evals[1]["loss"]), rel=1e-6)
    assert 0.0 <= evals[1]["passkey_accuracy"] <= 1.0
    assert sorted(n for n in os.listdir(tmp_path / "checkpoints") if n.isdigit()) == ["3", "6"]
    assert (tmp_path / "checkpoints" / "model.yaml").is_file()  # for mtraining-convert ours-to-hf
    assert (tmp_path / "loss.png").stat().st_size > 1000
    events = os.listdir(tmp_path / "tensorboard")
    assert len(events) == 1 and events[0].startswith("events.out.tfevents")
    assert (tmp_path / "tensorboard" / events[0]).stat().st_size > 100
    assert "done: step 6" in capsys.readouterr().out


@pytest.mark.slow(seconds=34)
def test_resume_is_exact(tmp_path):
    straight = run(_cfg(tmp_path / "a", "steps=4", "checkpoint.every=2", "eval.every=0"))
    first = run(_cfg(tmp_path / "b", "steps=4", "run_steps=2", "checkpoint.every=10", "eval.every=0"))
    assert first.final_step == 2 and first.checkpoint_steps == [2]
    second = run(_cfg(tmp_path / "b", "steps=4", "checkpoint.every=10", "eval.every=0", "checkpoint.resume=true"))
    assert [s for s, _ in second.train_losses] == [3, 4]
    got = dict(first.train_losses + second.train_losses)
    want = dict(straight.train_losses)
    for s in range(1, 5):
        assert abs(got[s] - want[s]) <= 1e-6, (s, got[s], want[s])
    for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(second.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path):
    # lr = 1e30: the first update blows the weights up, the next loss is not finite.
    cfg = _cfg(tmp_path, "steps=5", "optim.lr=1e30", "optim.clip_norm=0", "checkpoint.every=1",
               "checkpoint.async_save=false", "eval.every=0")
    with pytest.raises(NonFiniteLossError, match=r"non-finite loss .* at step (\d+).*last good checkpoint is step"):
        run(cfg)
    ck = Checkpointer(cfg.checkpoint_dir)
    steps = ck.all_steps()
    assert steps, "no checkpoint kept"
    recs = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
    bad = [r for r in recs if not isinstance(r["loss"], float)][0]
    assert steps[-1] == bad["step"] - 1  # nothing saved at or after the failing step
    assert math.isfinite(ck.run_info(steps[-1])["loss"])
    restored, data_state, _ = ck.restore(steps[-1])
    assert data_state["index"] == steps[-1]
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored["params"]))
    ck.close()


def test_interrupted_save_leaves_previous_checkpoint_usable(tmp_path):
    state = {"step": np.int32(2), "params": {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}}
    ck = Checkpointer(str(tmp_path), keep=3, async_save=True)
    ck.save(1, {"step": np.int32(1), "params": {"w": np.zeros((2, 3), np.float32)}}, {"index": 1, "epoch": 0, "seed": 0})
    ck.save(2, state, {"index": 2, "epoch": 0, "seed": 0})
    ck.close()
    # A process killed while writing step 3 leaves an unfinalised temporary folder behind
    # (orbax writes "<step>.orbax-checkpoint-tmp-<n>" and renames it only when complete).
    tmp = tmp_path / "3.orbax-checkpoint-tmp-1234567"
    shutil.copytree(tmp_path / "2", tmp)
    for root, _, files in os.walk(tmp):
        for f in files[: len(files) // 2 + 1]:
            os.remove(os.path.join(root, f))
    ck2 = Checkpointer(str(tmp_path))
    assert ck2.latest_step() == 2
    restored, data_state, _ = ck2.restore(2, state)
    np.testing.assert_array_equal(restored["params"]["w"], state["params"]["w"])
    assert data_state["index"] == 2
    ck2.close()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.seq_len=500"], "sequence length 500 is not divisible by stripe x ranks = 64 x 8"),
        (["data.layout=zigzag", "data.seq_len=520"], "not divisible by 2 x ranks = 16"),
        (["data.source=tokens", "data.path=/nonexistent/tokens.bin"], "/nonexistent/tokens.bin"),
        (["model.vocab_size=100"], "tokenizer 'byte' has 259 tokens but model.vocab_size is 100"),
        (["mesh.shape=[3,4]"], "needs 12 devices, but 8 are available"),
        (["data.batch_size=3", "mesh.shape=[1,4]", "mesh.data=2"], "data.batch_size=3 is not divisible by mesh.data=2"),
        (["model.dense_backend=cudnn"], "'cudnn' runs on one device (natural token order); the mesh has 8 CP ranks"),
    ],
)
def test_bad_run_inputs_are_rejected_up_front(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        run(_cfg(tmp_path, "steps=1", *overrides))
    assert not (tmp_path / "checkpoints").exists()


def test_cli_reports_bad_config_with_exit_code_2(tmp_path, capsys):
    assert cli.main(["--config", CONFIG, "optim.learning_rate=1e-3"]) == 2
    assert "optim.learning_rate" in capsys.readouterr().err
    assert cli.main(["--config", CONFIG, "optim.lr=fast"]) == 2
    assert "optim.lr must be a number, got 'fast'" in capsys.readouterr().err
    assert cli.main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert cli.main(["--config", CONFIG, *SMALL, "data.source=text", "data.path=/no/such.jsonl",
                     f"run_dir={tmp_path}"]) == 2
    assert "/no/such.jsonl" in capsys.readouterr().err
