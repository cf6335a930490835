"""The kernel benchmarks' inputs (``benchmarks/kernels.py`` and its ``--passes``): the benchmark's shape
(16 query heads, 2 KV heads, head_dim 128, 64-row blocks), bf16 ``q, k, v`` and cotangent, the index
families (:func:`pallas_kernels.testing.index_family`, plus ``"full"``), the pairs a kernel computes and the timed
forward + backward (:func:`fwd_bwd`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.index_format import full_step_index, row_columns
from pallas_kernels.testing import index_family

H, HKV, D, BS = 16, 2, 128, 64
#: how a forward + backward row is timed (:func:`fwd_bwd`): ``do`` (a bf16 ``dO`` given, the default) or ``loss``
COTANGENTS = ("do", "loss")


def inputs(S, seed, last_dtype, shape=(H, HKV, D)):
    """``q, k, v`` bf16 and the cotangent / dO (``last_dtype``); ``shape``: (query heads, KV heads,
    head_dim), the benchmark's by default."""
    hq, hkv, d = shape
    kq, kk, kv, kc = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(kq, (1, S, hq, d), jnp.bfloat16), jax.random.normal(kk, (1, S, hkv, d), jnp.bfloat16),
            jax.random.normal(kv, (1, S, hkv, d), jnp.bfloat16), jax.random.normal(kc, (1, S, hq, d), last_dtype))


def family_index(rng, fam, S, sp, vert_cols, heads=H):
    """``(index, name)`` of family ``fam`` at sparsity ``sp`` (``"full"``: the full causal index)."""
    if fam == "full":
        pos = jnp.arange(S, dtype=jnp.int32)
        return full_step_index(1, heads, S, S, pos, pos, BS), "full"
    idx = index_family(rng, fam, 1, heads, S, 1 - sp, block_size=BS, vert_cols=vert_cols)
    return idx, f"{'vs' if fam == 'slash' else fam}{int(round(sp * 100))}"


def active_pairs(idx, S):
    """``(block pairs, column pairs)`` the kernels compute (``bs*bs`` per active block tile,
    ``bs`` per column outside the row's blocks)."""
    bc = float(np.asarray(idx.block_count, np.float64).sum())
    cc = float(np.asarray(row_columns(idx, S, BS)[1]).sum())
    return bc * BS * BS, cc * BS


def cotangent_dtype(cotangent: str):
    """The dtype of the cotangent :func:`fwd_bwd` takes: bf16 for ``"do"``, float32 for ``"loss"``."""
    if cotangent not in COTANGENTS:
        raise ValueError(f"cotangent must be one of {COTANGENTS}, got {cotangent!r}")
    return jnp.bfloat16 if cotangent == "do" else jnp.float32


def fwd_bwd(f, cotangent: str = "do"):
    """Jitted forward + backward of ``f(q, k, v, *data)``, called as ``(q, k, v, ct, *data) -> (dq, dk, dv)``;
    ``data`` (positions, index) are arguments of the call, as in training, not constants XLA could fold.

    ``"do"``: the VJP at a given ``dO`` (``ct``) of the output's dtype, bf16: what an attention layer's backward
    receives in training, and all the timed program does besides the attention. ``"loss"`` (the rows of
    ``results/kernels`` runs up to 39): ``grad`` of ``sum(f(...).astype(float32) * ct)`` with a float32 ``ct``:
    the program also converts ``ct`` to bf16 (at 128K, 16 heads, d128: 1.07 GB read, 0.54 GB written per call,
    in every row, cuDNN's too)."""
    cotangent_dtype(cotangent)
    if cotangent == "loss":
        def loss(q, k, v, ct, *data):
            return jnp.sum(f(q, k, v, *data).astype(jnp.float32) * ct)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    def fb(q, k, v, do, *data):
        return jax.vjp(lambda q, k, v: f(q, k, v, *data), q, k, v)[1](do)
    return jax.jit(fb)
