"""The global vertical-slash index (MTraining Algorithm 1, "sparseformat(i_v, i_s)").

``VerticalSlashIndex`` is per batch element and per QUERY head (GQA heads of one KV group may pick
different lines) and identical on every context-parallel rank:

* ``v_idx   int32 [B, H, MV]``  global token positions of the vertical columns, the first
  ``v_count`` sorted ascending and distinct; padding entries hold ``S`` (out of range).
* ``v_count int32 [B, H]``
* ``s_idx   int32 [B, H, MS]``  block-diagonal offsets ``d = q // bs - k // bs >= 0`` (in blocks),
  the first ``s_count`` sorted ascending and distinct, always containing ``0``; padding holds
  ``S // bs`` (out of range).
* ``s_count int32 [B, H]``

Meaning (global, natural order): query ``q`` may attend key ``k`` iff ``k <= q`` and
(``k`` is a vertical or ``q // bs - k // bs`` is a slash). ``MV`` and ``MS`` are static.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class VerticalSlashIndex(NamedTuple):
    """Global per-head vertical-slash index; see the module docstring."""

    v_idx: jax.Array
    v_count: jax.Array
    s_idx: jax.Array
    s_count: jax.Array

    @property
    def max_verticals(self) -> int:
        return self.v_idx.shape[-1]

    @property
    def max_slashes(self) -> int:
        return self.s_idx.shape[-1]


@functools.partial(jax.jit, static_argnames=("num_blocks",))
def active_diagonals(index: VerticalSlashIndex, num_blocks: int):
    """``bool [B, H, num_blocks]``: whether block-diagonal ``d`` is a slash (``num_blocks = S // bs``)."""
    B, H, ms = index.s_idx.shape
    valid = jnp.arange(ms) < index.s_count[..., None]
    d = jnp.where(valid, index.s_idx, num_blocks)
    out = jnp.zeros((B, H, num_blocks + 1), bool)
    out = out.at[jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], d].max(True)  # deterministic
    return out[..., :num_blocks]


@functools.partial(jax.jit, static_argnames=("seq_len",))
def vertical_flags(index: VerticalSlashIndex, seq_len: int):
    """``bool [B, H, S]``: whether token ``k`` is a vertical column."""
    B, H, mv = index.v_idx.shape
    valid = jnp.arange(mv) < index.v_count[..., None]
    v = jnp.where(valid, index.v_idx, seq_len)
    out = jnp.zeros((B, H, seq_len + 1), bool)
    out = out.at[jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], v].max(True)  # deterministic
    return out[..., :seq_len]


@functools.partial(jax.jit, static_argnames=("size",))
def compact_sorted(flags, values, size: int, pad):
    """First ``size`` of ``values`` where ``flags`` (last axis), sorted ascending, padded with ``pad``.

    ``flags bool [..., n]``, ``values int [..., n]`` (distinct where flagged).
    Returns ``(idx int32 [..., size], count int32 [...])``; ``count`` is NOT clipped to ``size``.
    """
    big = jnp.iinfo(jnp.int32).max
    key = jnp.where(flags, values.astype(jnp.int32), big)
    srt = jnp.sort(key, axis=-1)
    n = srt.shape[-1]
    if size > n:
        srt = jnp.concatenate([srt, jnp.full(srt.shape[:-1] + (size - n,), big, jnp.int32)], -1)
    srt = srt[..., :size]
    count = flags.sum(axis=-1).astype(jnp.int32)
    return jnp.where(srt == big, jnp.int32(pad), srt), count


@functools.partial(jax.jit, static_argnames=("size",))
def compact_in_order(flags, values, size: int, pad):
    """The first ``size`` flagged entries of ``values`` in their order (last axis), by a prefix sum
    and a scatter (``O(n)``, no sort); equals :func:`compact_sorted` when ``values`` is ascending.

    Returns ``(idx int32 [..., size], count int32 [...])``; ``count`` is NOT clipped to ``size``.
    """
    slot = jnp.cumsum(flags, axis=-1, dtype=jnp.int32) - 1
    # unflagged / overflow entries go to distinct out-of-range slots (dropped): with the flagged
    # ones' distinct prefix-sum slots every index is unique, so XLA scatters without atomics and
    # does not serialise the scatter into a loop under --xla_gpu_deterministic_ops
    n = flags.shape[-1]
    slot = jnp.where(flags & (slot < size), slot, size + jnp.arange(n, dtype=jnp.int32))
    lead = jnp.indices(flags.shape[:-1], sparse=True)
    lead = [a[..., None] for a in lead]
    out = jnp.full(flags.shape[:-1] + (size,), pad, jnp.int32)
    out = out.at[(*lead, slot)].set(values.astype(jnp.int32), mode="drop", unique_indices=True)
    count = flags.sum(axis=-1, dtype=jnp.int32)
    return out, count


def random_index(seed: int, batch: int, heads: int, seq_len: int, block_size: int = 64,
                 max_verticals: int = 16, max_slashes: int = 4) -> VerticalSlashIndex:
    """A random valid index (host NumPy -> int32 arrays), for property tests and benchmarks.

    Counts are uniform in ``[0, MV]`` / ``[1, MS]``; slashes always contain diagonal 0.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    nb = seq_len // block_size
    mv, ms = min(max_verticals, seq_len), min(max_slashes, nb)
    v_idx = np.full((batch, heads, mv), seq_len, np.int32)
    s_idx = np.full((batch, heads, ms), nb, np.int32)
    v_count = rng.integers(0, mv + 1, (batch, heads)).astype(np.int32)
    s_count = rng.integers(1, ms + 1, (batch, heads)).astype(np.int32)
    for b in range(batch):
        for h in range(heads):
            v = np.sort(rng.choice(seq_len, v_count[b, h], replace=False))
            s = np.sort(np.r_[0, 1 + rng.choice(nb - 1, s_count[b, h] - 1, replace=False)])
            v_idx[b, h, : len(v)] = v
            s_idx[b, h, : len(s)] = s
    return VerticalSlashIndex(jnp.asarray(v_idx), jnp.asarray(v_count), jnp.asarray(s_idx), jnp.asarray(s_count))


@functools.partial(jax.jit, static_argnames=("batch", "heads", "seq_len", "block_size"))
def full_index(batch: int, heads: int, seq_len: int, block_size: int) -> VerticalSlashIndex:
    """Every block diagonal active, no verticals: the index whose mask is the full causal mask."""
    nb = seq_len // block_size
    s_idx = jnp.broadcast_to(jnp.arange(nb, dtype=jnp.int32), (batch, heads, nb))
    return VerticalSlashIndex(
        v_idx=jnp.full((batch, heads, 1), seq_len, jnp.int32),
        v_count=jnp.zeros((batch, heads), jnp.int32),
        s_idx=s_idx,
        s_count=jnp.full((batch, heads), nb, jnp.int32),
    )
