"""Dense-equivalent view of a :class:`VerticalSlashIndex` (tests, notebooks; ``O(S^2)`` memory)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.reference import dense_attention
from mtraining_jax.sparsity.index import VerticalSlashIndex, active_diagonals, vertical_flags


def index_to_mask(index: VerticalSlashIndex, seq_len: int, block_size: int = 64):
    """``bool [B, H, S, S]`` in natural order: ``k <= q`` and (``k`` vertical or ``q//bs - k//bs`` a slash)."""
    if seq_len % block_size:
        raise ValueError(f"seq_len={seq_len} is not a multiple of block_size={block_size}")
    return _index_to_mask(index, seq_len, block_size)


@functools.partial(jax.jit, static_argnames=("seq_len", "block_size"))
def _index_to_mask(index: VerticalSlashIndex, seq_len: int, block_size: int):
    nb = seq_len // block_size
    vert = vertical_flags(index, seq_len)  # [B, H, S]
    diag = active_diagonals(index, nb)  # [B, H, nb]
    t = jnp.arange(seq_len)
    d = t[:, None] // block_size - t[None, :] // block_size  # [S, S]
    slash = diag[:, :, jnp.clip(d, 0, nb - 1)]  # [B, H, S, S]
    causal = t[None, :] <= t[:, None]
    return causal & (slash | vert[:, :, None, :])


def masked_reference(q, k, v, index: VerticalSlashIndex, *, block_size: int = 64, sm_scale=None):
    """Dense reference attention restricted to the index's mask (natural order).

    ``q [B, S, Hq, D]``, ``k, v [B, S, Hkv, D]`` -> ``(out [B, S, Hq, D], lse [B, Hq, S])`` float32
    (float64 for float64 inputs), via :func:`pallas_kernels.reference.dense_attention`.
    """
    mask = index_to_mask(index, q.shape[1], block_size)
    return dense_attention(q, k, v, mask=mask, sm_scale=sm_scale)
