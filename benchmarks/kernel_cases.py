"""The kernel benchmarks' inputs (``benchmarks/kernels.py`` and its ``--passes``): the benchmark's shape
(16 query heads, 2 KV heads, head_dim 128, 64-row blocks), bf16 ``q, k, v`` and cotangent, the index
families (:func:`pallas_kernels.testing.index_family`, plus ``"full"``) and the pairs a kernel computes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.index_format import full_step_index, row_columns
from pallas_kernels.testing import index_family

H, HKV, D, BS = 16, 2, 128, 64


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
