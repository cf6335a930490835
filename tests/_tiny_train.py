"""A tiny training config on CPU devices (2 layers, 64 wide, dense ring attention, contiguous
layout, 128 tokens) over a random token file: shared by the FSDP and offload tests."""

import os

import numpy as np

from mtraining_jax.train.config import load_config

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_cpu.yaml")
SEQ = 128
TINY = [
    "model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=2", "model.num_heads=2",
    "model.num_kv_heads=1", "model.attention_backend=ring", "model.dense_layers=[]", "model.layout=contiguous",
    f"model.max_position_embeddings={SEQ}", f"data.seq_len={SEQ}", "data.layout=contiguous",
    "data.source=tokens", "data.heldout_percent=10", "optim.warmup_steps=1", "optim.lr=1e-2",
    "eval.every=0", "eval.passkey_samples=0", "logging.progress=false", "logging.tensorboard=false",
    "logging.plot=false", "checkpoint.async_save=false",
]


def token_file(tmp_path_factory) -> str:
    """A ``uint16`` token file of 12,000 random byte-vocabulary ids."""
    path = tmp_path_factory.mktemp("data") / "tokens.npy"
    np.save(path, np.random.default_rng(0).integers(0, 259, 12000).astype(np.uint16))
    return str(path)


def tiny_config(tokens: str, *extra, base=()):
    """:data:`TINY` (+ ``base``) on ``tokens``, then ``extra`` overrides."""
    return load_config(CONFIG, TINY + list(base) + [f"data.path={tokens}", *extra])


def training_parts(cfg):
    """``(Training, loader, batch shardings)`` of ``cfg`` built as the trainer's setup does (no run dir)."""
    from mtraining_jax.train import data as data_lib
    from mtraining_jax.train.loop import build_mesh, build_training, check_run_config
    from mtraining_jax.train.state import build_model_config
    from mtraining_jax.train.step import batch_shardings
    from mtraining_jax.train.tokenizer import load_tokenizer

    mesh = build_mesh(cfg.mesh)
    model_cls, model_cfg = build_model_config(cfg.model, cfg.config_dir)
    tok = load_tokenizer(cfg.data.tokenizer)
    layout = check_run_config(cfg, model_cfg, mesh, tok)
    t = build_training(cfg, mesh, model_cls, model_cfg)
    stream, _ = data_lib.build_streams(cfg.data, tok, model_cfg.vocab_size)
    loader = data_lib.build_train_loader(cfg.data, tok, layout, stream, accum=1)
    return t, loader, batch_shardings(mesh, True)
