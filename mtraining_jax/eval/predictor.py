"""Next-token predictions of a model on long sequences, run as in training.

A *predictor* is any callable ``predict(inputs, labels) -> (pred, nll)``: ``inputs, labels`` int
``[B, S]`` in natural order (``labels[t] = inputs[t + 1]``), ``pred`` int32 ``[B, S]`` the greedy
next token, ``nll`` float32 ``[B, S]`` ``-log p(labels[t] | inputs[:t+1])``. Every scorer of this
package takes one (tests pass stubs). :class:`ModelPredictor` lays the sequence out and shards it
as the trainer does (:func:`~mtraining_jax.train.loop.to_global`), runs the model's own attention
backends, and walks the vocabulary in chunks (never ``[S, vocab]`` logits).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtraining_jax.layouts import Layout, validate_layout
from mtraining_jax.mesh import num_cp_ranks
from mtraining_jax.model.config import ModelConfig
from mtraining_jax.model.qwen2 import Qwen2ForCausalLM
from mtraining_jax.train.loop import to_global
from mtraining_jax.train.state import bind, split_model
from mtraining_jax.train.step import batch_shardings


def head_predictions(hidden, weight, labels, vocab_chunk: int = 8192):
    """``(pred int32 [...], nll float32 [...])`` of ``hidden [..., H] @ weight [H, V]`` without
    materialising more than ``[..., vocab_chunk]`` logits (float32 math)."""
    H, V = weight.shape
    labels = jnp.asarray(labels, jnp.int32)
    h = jnp.asarray(hidden).astype(jnp.float32)
    w = jnp.asarray(weight).astype(jnp.float32)
    c = min(int(vocab_chunk), V)
    n = -(-V // c)
    w = jnp.pad(w, ((0, 0), (0, n * c - V))).reshape(H, n, c).transpose(1, 0, 2)
    neg = jnp.float32(-jnp.inf)

    def body(carry, xs):
        m, s, best, arg, lab = carry
        wc, j = xs
        z = jnp.einsum("...h,hv->...v", h, wc, precision="highest")
        ids = j * c + jnp.arange(c, dtype=jnp.int32)
        z = jnp.where(ids < V, z, neg)
        zm = z.max(-1)
        new_m = jnp.maximum(m, zm)
        s = s * jnp.exp(m - new_m) + jnp.exp(z - new_m[..., None]).sum(-1)
        za = jnp.argmax(z, -1).astype(jnp.int32)
        better = zm > best
        arg = jnp.where(better, j * c + za, arg)
        best = jnp.where(better, zm, best)
        in_chunk = (labels >= j * c) & (labels < (j + 1) * c)
        lz = jnp.take_along_axis(z, jnp.clip(labels - j * c, 0, c - 1)[..., None], -1)[..., 0]
        lab = jnp.where(in_chunk, lz, lab)
        return (new_m, s, best, arg, lab), None

    shape = labels.shape
    init = (jnp.full(shape, neg), jnp.zeros(shape, jnp.float32), jnp.full(shape, neg),
            jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32))
    (m, s, _, arg, lab), _ = jax.lax.scan(body, init, (w, jnp.arange(n, dtype=jnp.int32)))
    return arg.astype(jnp.int32), (m + jnp.log(s) - lab).astype(jnp.float32)


def layout_for(cfg: ModelConfig, seq_len: int, num_ranks: int) -> Layout:
    """The sequence layout the model runs ``seq_len`` tokens in on ``num_ranks`` CP ranks
    (``cfg.layout`` with the sparse block size as stripe); ``ValueError`` naming the bad length."""
    stripe = int((cfg.sparsity or {}).get("block_size", 64))
    try:
        validate_layout(cfg.layout, seq_len, num_ranks, stripe)
        if "mtraining" in cfg.layer_backends:
            cfg.mtraining_config().sparsity.check(seq_len, cfg.num_heads, num_ranks)
    except ValueError as e:
        raise ValueError(f"context length {seq_len} cannot run on {num_ranks} rank(s): {e}") from None
    return Layout(cfg.layout, seq_len, num_ranks, stripe)


class ModelPredictor:
    """Predictor of a :class:`Qwen2ForCausalLM` parameter dict on ``mesh`` (``None``: one device).

    ``mesh`` must not have a ``data`` axis larger than 1 unless the batches divide it.
    """

    def __init__(self, cfg: ModelConfig, params, mesh=None, *, vocab_chunk: int = 8192):
        self.cfg, self.mesh = cfg, mesh
        self.num_ranks = 1 if mesh is None else num_cp_ranks(mesh)
        self._parts, _ = split_model(Qwen2ForCausalLM, cfg, 0)
        self._sh = batch_shardings(mesh, False)
        self.set_params(params)
        parts, chunk = self._parts, vocab_chunk

        def fwd(params, tokens, labels, positions):
            model = bind(parts, params)
            hidden = model(tokens, positions, mesh=mesh)
            return head_predictions(hidden, model.lm_head_weight(), labels, chunk)

        self._fwd = jax.jit(fwd)

    def set_params(self, params) -> None:
        """Predict with ``params`` from now on (same structure: the compiled functions are reused)."""
        rep = None if self.mesh is None else jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        self.params = params if rep is None else jax.device_put(params, rep)

    @functools.lru_cache(maxsize=16)
    def layout(self, seq_len: int) -> Layout:
        return layout_for(self.cfg, seq_len, self.num_ranks)

    def __call__(self, inputs, labels):
        inputs, labels = np.asarray(inputs, np.int32), np.asarray(labels, np.int32)
        if inputs.ndim != 2 or inputs.shape != labels.shape:
            raise ValueError(f"inputs and labels must both be [B, S], got {inputs.shape} and {labels.shape}")
        lay = self.layout(inputs.shape[1])
        tok, lab = lay.permute(inputs, axis=1), lay.permute(labels, axis=1)
        pos = lay.perm.astype(np.int32)
        if self._sh is not None:
            tok, lab = to_global(tok, self._sh.tokens), to_global(lab, self._sh.labels)
            pos = to_global(pos, self._sh.positions)
        pred, nll = jax.device_get(self._fwd(self.params, tok, lab, pos))
        return lay.unpermute(np.asarray(pred), axis=1), lay.unpermute(np.asarray(nll), axis=1)
