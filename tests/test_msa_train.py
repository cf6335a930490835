"""Training with MSA layers: configs/tiny_cpu_msa.yaml shrunk to seconds (1 x 2 context-parallel
mesh, 512-token sequences, top-3 of 8 blocks) runs warm-up then sparse steps; the JSONL carries the
KL, recall, work fraction and warm-up flag; the index branch is trained and saved in checkpoints."""

import json
import os

import numpy as np
import pytest

from mtraining_jax.train import cli
from mtraining_jax.train.config import MSATrainConfig, load_config

pytestmark = pytest.mark.usefixtures("jax_compilation_cache")
CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_cpu_msa.yaml")
FAST = [
    "model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
    "model.num_kv_heads=1", "model.head_dim=32", "model.msa.top_k=3", "model.msa.index_dim=8", "mesh.shape=[1,2]",
    "data.seq_len=512", "eval.every=0", "logging.progress=false", "logging.tensorboard=false",
    "logging.plot=false", "optim.warmup_steps=1", "checkpoint.async_save=false", "msa.warmup_steps=2",
]


@pytest.mark.slow(seconds=31)
def test_msa_training_warmup_then_sparse_with_metrics_and_checkpoint(tmp_path, capsys):
    rd = tmp_path / "run"
    rc = cli.main(["--config", CONFIG, *FAST, f"run_dir={rd}", "steps=4", "checkpoint.every=4"])
    assert rc == 0, capsys.readouterr().err
    recs = [json.loads(line) for line in open(rd / "metrics.jsonl") if '"train"' in line]
    assert [r["msa/warmup"] for r in recs] == [1.0, 1.0, 0.0, 0.0]
    assert [r["attn/work_fraction"] for r in recs[:2]] == [1.0, 1.0]
    nb = 512 // 64
    want = sum(min(3, i + 1) for i in range(nb)) / (nb * (nb + 1) / 2)
    np.testing.assert_allclose([r["attn/work_fraction"] for r in recs[2:]], want, rtol=1e-6)
    for r in recs:
        assert np.isfinite(r["loss"]) and r["attn/msa_kl"] > 0 and 0 < r["attn/msa_recall"] <= 1
        assert r["msa/kl_grad_norm"] > 0
    assert os.path.isdir(rd / "checkpoints" / "4")
    # the index branch lives in the checkpointed NNX state: resuming restores the whole state tree
    rc = cli.main(["--config", CONFIG, *FAST, f"run_dir={rd}", "steps=5", "--resume"])
    assert rc == 0, capsys.readouterr().err
    recs = [json.loads(line) for line in open(rd / "metrics.jsonl") if '"train"' in line]
    assert recs[-1]["step"] == 5 and recs[-1]["msa/warmup"] == 0.0


def test_msa_train_config_validation():
    cfg = load_config(CONFIG)
    assert cfg.msa == MSATrainConfig(warmup_steps=6, kl_coef=1.0)
    with pytest.raises(ValueError, match="warmup_steps"):
        MSATrainConfig(warmup_steps=-1)
    with pytest.raises(ValueError, match="kl_coef"):
        MSATrainConfig(kl_coef=-0.5)


def test_init_from_a_dense_checkpoint_into_msa(tmp_path, capsys):
    """``init_from=ckpt:`` of a dense run into an MSA model (continued pretraining, MSA paper §4): every
    weight the dense model has is the checkpoint's, the index branch (which it has none of) starts
    fresh at the initializer's scale, and the MSA model trains from there."""
    import jax

    from mtraining_jax.model.checkpoint import load_model_checkpoint
    from mtraining_jax.model.hf_io import model_params
    from mtraining_jax.model.qwen2 import Qwen2ForCausalLM
    from mtraining_jax.train.state import build_model_config, load_init_params, split_model

    dense = tmp_path / "dense"
    assert cli.main(["--config", CONFIG, *FAST, "model.attention_backend=ring", f"run_dir={dense}", "steps=1",
                     "checkpoint.every=1"]) == 0, capsys.readouterr().err
    over = [*FAST, f"run_dir={tmp_path / 'msa'}", "steps=1", f"model.init_from=ckpt:{dense}"]
    cfg = load_config(CONFIG, over)
    _, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    assert model_cfg.has_msa
    abstract = jax.eval_shape(split_model(Qwen2ForCausalLM, model_cfg, 0)[1])
    params = load_init_params(cfg.model, model_cfg, abstract, lambda a, sharding: a)
    theirs = model_params(load_model_checkpoint(dense)[1])
    attn = params["layers"]["self_attn"]
    for name in ("index_q", "index_k"):
        k = np.asarray(attn[name]["kernel"])
        assert k.shape == abstract["layers"]["self_attn"][name]["kernel"].shape
        assert abs(k.std() - model_cfg.initializer_range) < 0.2 * model_cfg.initializer_range
    ours = {**params, "layers": {**params["layers"], "self_attn": {k: v for k, v in attn.items()
                                                                     if k not in ("index_q", "index_k")}}}
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert cli.main(["--config", CONFIG, *over]) == 0, capsys.readouterr().err  # and it trains
    assert "initialised from ckpt:" in capsys.readouterr().out
