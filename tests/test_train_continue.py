"""Continued pre-training (issue 26, finding 3): a small Hugging Face Qwen2 checkpoint ->
``mtraining-train`` with ``model.init_from=hf:`` and YaRN from the training config -> ``mtraining-convert
ours-to-hf`` on the run directory -> transformers, logits equal; ``init_from=ckpt:`` from that run.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from mtraining_jax.model.checkpoint import load_model_checkpoint
from mtraining_jax.model.convert_cli import main as convert_main
from mtraining_jax.train import cli
from mtraining_jax.train import data as data_lib
from mtraining_jax.train.config import load_config
from mtraining_jax.train.loop import run, run_layout
from mtraining_jax.train.state import build_model_config
from mtraining_jax.train.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("jax_compilation_cache")
CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_cpu.yaml")
VOCAB, SEQ = 320, 128
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
MODEL = [  # the HF checkpoint's architecture; RoPE extended by YaRN x4 for 128-token training
    f"model.vocab_size={VOCAB}", "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2",
    "model.num_heads=4", "model.num_kv_heads=2", "model.tie_word_embeddings=false", "model.rope_theta=10000.0",
    "model.rms_norm_eps=1e-5", "model.max_position_embeddings=256",
    "model.rope_scaling={rope_type: yarn, factor: 4.0, original_max_position_embeddings: 64}",
]
FAST = MODEL + [
    "model.attention_backend=reference", "model.dense_layers=[]", "mesh.shape=[1,1]", f"data.seq_len={SEQ}",
    "data.source=tokens", "data.heldout_percent=10", "eval.every=0", "logging.progress=false",
    "logging.tensorboard=false", "logging.plot=false", "optim.warmup_steps=1", "optim.lr=1e-2",
    "checkpoint.async_save=false",
]


def _qwen_config(yarn: bool):
    return transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256 if yarn else 64, tie_word_embeddings=False,
        rope_theta=10000.0, rms_norm_eps=1e-5, rope_scaling=dict(YARN) if yarn else None,
    )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(_qwen_config(False)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("hf")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, VOCAB, 4000).astype(np.uint16))
    return str(path)


def _hf_model(path, yarn=True):
    """The pretrained checkpoint, with the training config's YaRN when ``yarn``."""
    return transformers.Qwen2ForCausalLM.from_pretrained(path, config=_qwen_config(yarn), torch_dtype=torch.float32).eval()


def _first_batch(cfg):
    """The first training batch of ``cfg`` (natural order: one rank, the layout is the identity)."""
    tok = load_tokenizer(cfg.data.tokenizer)
    stream, _ = data_lib.build_streams(cfg.data, tok)
    _, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    loader = data_lib.build_train_loader(cfg.data, tok, run_layout(cfg, model_cfg, 1), stream, accum=1)
    b = next(loader)
    return np.asarray(b.tokens[0]), np.asarray(b.labels[0])


def _hf_loss(model, toks, labels):
    with torch.no_grad():
        logits = model(torch.tensor(toks, dtype=torch.long)).logits.float()
    return float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), torch.tensor(labels, dtype=torch.long).reshape(-1)))


def _logits_hf(model, toks):
    with torch.no_grad():
        return model(torch.tensor(toks, dtype=torch.long)).logits.float().numpy()


def test_continue_from_hf_then_back_to_hf_with_equal_logits(tmp_path, hf_dir, tokens, capsys):
    rd = tmp_path / "run"
    args = [*FAST, f"data.path={tokens}", f"run_dir={rd}", "steps=2", "checkpoint.every=2", f"model.init_from=hf:{hf_dir}"]
    assert cli.main(["--config", CONFIG, *args]) == 0
    assert f"initialised from hf:{hf_dir}" in capsys.readouterr().out
    recs = [json.loads(line) for line in open(rd / "metrics.jsonl")]
    # Step 1's loss is the pretrained model's (with the config's YaRN) on the first batch.
    cfg = load_config(CONFIG, args)
    toks, labels = _first_batch(cfg)
    assert recs[0]["loss"] == pytest.approx(_hf_loss(_hf_model(hf_dir), toks, labels), rel=1e-4)
    assert _hf_loss(_hf_model(hf_dir, yarn=False), toks, labels) != pytest.approx(recs[0]["loss"], rel=1e-4)

    out = tmp_path / "hf_out"
    assert convert_main(["ours-to-hf", str(rd), str(out), "--dtype", "float32"]) == 0
    assert "training step 2" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["factor"] == 4.0
    exported = transformers.Qwen2ForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    _, ours = load_model_checkpoint(rd)
    x = np.random.default_rng(1).integers(0, VOCAB, (2, SEQ))
    mine = np.asarray(ours.logits(jnp.asarray(x), jnp.arange(SEQ, dtype=jnp.int32)))
    theirs = _logits_hf(exported, x)
    assert np.abs(mine - theirs).max() <= 1e-4 * max(1.0, np.abs(theirs).max())
    assert np.abs(theirs - _logits_hf(_hf_model(hf_dir), x)).max() > 1e-3  # training changed the weights

    # ckpt: init from that run's checkpoint (weights only, step 0): its first loss is the exported model's.
    res = run(load_config(CONFIG, [*FAST, f"data.path={tokens}", f"run_dir={tmp_path / 'run2'}", "steps=1",
                                   "checkpoint.every=0", f"model.init_from=ckpt:{rd}/checkpoints/2"]))
    assert res.train_losses[0][0] == 1
    assert res.train_losses[0][1] == pytest.approx(_hf_loss(exported, toks, labels), rel=1e-4)


def test_init_from_checks_the_architecture_and_paths(tmp_path, hf_dir, tokens, capsys):
    base = ["--config", CONFIG, *FAST, f"data.path={tokens}", f"run_dir={tmp_path / 'r'}", "steps=1"]
    assert cli.main([*base, f"model.init_from=hf:{hf_dir}", "model.num_heads=8", "model.head_dim=4"]) == 2
    err = capsys.readouterr().err
    assert "model.num_heads=8 but the checkpoint has 4" in err and "model.init_from=" in err
    assert cli.main([*base, f"model.init_from=ckpt:{tmp_path / 'nothing'}"]) == 2
    assert f"model checkpoint not found: {tmp_path / 'nothing'}" in capsys.readouterr().err
