"""Kernel indices estimated from a trained model's real queries and keys: the ``model`` index family of
``benchmarks/kernels.py`` (issue 34, family (e)), next to the synthetic ones of
``pallas_kernels.testing.index_family``.

A checkpoint (any ``load_for_eval`` path: a training run's checkpoints, ``mtraining-convert`` output, a
Hugging Face directory) reads ``S`` tokens of a token file (``uint16`` / ``int`` ``.npy``, e.g. the
quality study's ``train_tokens.npy``: consecutive 32K training documents); its decoder layers give
the RoPE'd ``q``/``k`` of each layer (:func:`mtraining_jax.eval.recall.layer_qk`); MTraining's
estimate (:func:`mtraining_jax.sparsity.estimate.estimate_index`, the model's own ``sparsity``
budgets) picks the vertical-slash index of each requested layer, and
:func:`mtraining_jax.sparsity.convert.convert_step` turns it into the kernels' ``StepIndex``.

The benchmark's kernels time random ``q``/``k``/``v`` of their own head count: the model's query
heads are repeated cyclically to fill it (head ``h`` gets the model's head ``h mod Hq``), so the
tile pattern of every head is a real one. A model trained at 32K read at 128K positions is past its
training length: its index is what such a model would ask of the kernels when extended, not a
measured 128K-trained pattern.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def read_tokens(path: str, seq_len: int, offset: int = 0) -> np.ndarray:
    """``int32 [seq_len]``: tokens ``offset .. offset + seq_len`` of the flat ``.npy`` token file ``path``;
    a ``ValueError`` naming the sizes when the file is shorter."""
    toks = np.load(path, mmap_mode="r").reshape(-1)
    if offset < 0 or offset + seq_len > toks.shape[0]:
        raise ValueError(f"{path!r} holds {toks.shape[0]} tokens: no window of {seq_len} at offset {offset}")
    return np.asarray(toks[offset:offset + seq_len], np.int32)


def cycle_heads(index, heads: int):
    """``index`` (a ``StepIndex`` with heads on axis 1) with ``heads`` heads: head ``h`` = head ``h mod Hq``."""
    hq = index.block_count.shape[1]
    pick = np.arange(heads) % hq
    return jax.tree.map(lambda a: jnp.take(a, pick, axis=1), index)


def model_step_indices(ckpt: str, tokens_path: str, seq_len: int, heads: int, *, layers=None, offset: int = 0,
                       backend: str | None = None, block_size: int = 64, sparsity: dict | None = None) -> list:
    """``[(layer, StepIndex [1, heads, ...], density of the causal pairs per model head)]`` (module
    docstring). ``layers``: layer numbers (default: the model's ``mtraining`` layers, else all);
    ``backend``: the attention backend of every layer while reading q/k (default: the model's own);
    ``sparsity``: :class:`~mtraining_jax.sparsity.config.SparsityConfig` fields replacing the model's."""
    from mtraining_jax.eval.checkpoints import load_for_eval
    from mtraining_jax.eval.recall import layer_qk
    from mtraining_jax.sparsity.convert import convert_step
    from mtraining_jax.sparsity.estimate import estimate_index
    from mtraining_jax.sparsity.metrics import density

    loaded = load_for_eval(ckpt, **({"attention_backend": backend} if backend else {}))
    cfg = loaded.config
    if seq_len > cfg.max_position_embeddings:  # RoPE is computed, not learned: read past the training length
        cfg = dataclasses.replace(cfg, max_position_embeddings=int(seq_len))
    sp = cfg.mtraining_config().sparsity
    sp = dataclasses.replace(sp, block_size=block_size, **(sparsity or {}))
    n = cfg.num_layers
    if layers is None:
        layers = [i for i, b in enumerate(cfg.layer_backends) if b == "mtraining"] or list(range(n))
    bad = [x for x in layers if not 0 <= int(x) < n]
    if bad:
        raise ValueError(f"layers {bad} are not layers of the {n}-layer model at {ckpt!r}")
    tokens = read_tokens(tokens_path, seq_len, offset)
    qs, ks, _ = layer_qk(cfg, loaded.params, tokens[None], mesh=None)
    pos = jnp.arange(seq_len, dtype=jnp.int32)
    out = []
    for layer in layers:
        vs = estimate_index(qs[layer].astype(jnp.float32), ks[layer].astype(jnp.float32), pos, sp)
        step = convert_step(vs, pos, pos, seq_len=seq_len, block_size=block_size)
        out.append((int(layer), cycle_heads(step, heads), np.asarray(density(vs, seq_len, block_size))[0]))
    return out
