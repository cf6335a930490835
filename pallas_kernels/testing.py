"""Random :class:`StepIndex` generators honouring the index contract (tests and benchmarks).

``random_step_index`` draws, per (batch, head, query block), distinct sorted active KV blocks, per
(batch, head) one shared list of distinct columns in random order (some inside active blocks, which
kernels must skip) and per row a random prefix length; padding slots hold random in-range values
(kernels must never read them); ``block_causal`` comes from :func:`causal_flags`.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels.index_format import DEFAULT_BLOCK, StepIndex, causal_flags


def random_step_index(rng: np.random.Generator, batch: int, heads: int, sq: int, sk: int, q_pos, k_pos,
                      *, max_blocks: int | None = None, max_cols: int = 8, block_size: int = DEFAULT_BLOCK,
                      p_empty: float = 0.15, p_full: float = 0.15) -> StepIndex:
    """Random contract-respecting index; some rows empty (count 0), some with every block."""
    bs = block_size
    nqb, nkb = sq // bs, sk // bs
    mb = nkb if max_blocks is None else max_blocks
    mc = max(1, max_cols)
    bidx = rng.integers(0, nkb, size=(batch, heads, nqb, mb)).astype(np.int32)
    bcnt = np.zeros((batch, heads, nqb), np.int32)
    cidx = rng.integers(0, sk, size=(batch, heads, mc)).astype(np.int32)
    ccnt = np.zeros((batch, heads, nqb), np.int32)
    for b in range(batch):
        for h in range(heads):
            nc = int(rng.integers(0, min(mc, sk) + 1))
            cidx[b, h, :nc] = rng.choice(sk, size=nc, replace=False)  # random order, distinct
            for i in range(nqb):
                u = rng.random()
                if u < p_empty:
                    nb = 0
                elif u < p_empty + p_full:
                    nb = mb
                else:
                    nb = int(rng.integers(0, mb + 1))
                bidx[b, h, i, :nb] = np.sort(rng.choice(nkb, size=nb, replace=False))
                bcnt[b, h, i] = nb
                ccnt[b, h, i] = int(rng.integers(0, nc + 1)) if rng.random() > p_empty else 0
    bidx_j = jnp.asarray(bidx)
    flags = causal_flags(jnp.asarray(q_pos), jnp.asarray(k_pos), bidx_j, bs)
    return StepIndex(bidx_j, jnp.asarray(bcnt), flags.astype(jnp.int32), jnp.asarray(cidx), jnp.asarray(ccnt))


def vertical_slash_index(rng: np.random.Generator, batch: int, heads: int, seq: int, sparsity: float, *,
                         block_size: int = DEFAULT_BLOCK, sink_cols: int = 64, far_slashes: int = 2,
                         max_cols: int = 256) -> StepIndex:
    """Synthetic vertical-slash index on one device (positions ``arange``) at about ``sparsity``.

    Slash blocks: the diagonal block, ``near`` blocks just below it and ``far_slashes`` far
    diagonals; verticals: the first ``sink_cols`` tokens plus random columns, one list per head in
    position order, each row using the prefix up to its last position (columns inside its active
    blocks are skipped by the kernels). ``near`` is chosen so that the active fraction of the causal
    area is about ``1 - sparsity``.
    """
    bs = block_size
    n = seq // bs
    budget = max(1, int(round((1 - sparsity) * (n + 1) / 2)))  # active blocks per row, on average
    near = max(0, budget - 1 - far_slashes - 1)
    far = np.stack([rng.choice(np.arange(near + 1, max(near + 1 + far_slashes, n)), far_slashes, replace=False)
                    for _ in range(heads)])
    mb = near + 1 + far_slashes
    i = np.arange(n)[:, None]
    offs = np.concatenate([np.arange(near + 1)[None, :].repeat(heads, 0), far], axis=1)  # [H, mb]
    blocks = i[None] - offs[:, None, :]  # [H, n, mb]
    blocks = np.sort(np.where(blocks >= 0, blocks, n + 10**6), axis=-1)
    bcnt = (blocks < n).sum(-1).astype(np.int32)
    bidx = np.where(blocks < n, blocks, 0).astype(np.int32)
    nrand = max_cols - sink_cols
    cidx = np.zeros((heads, max_cols), np.int32)
    ccnt = np.zeros((heads, n), np.int32)
    for h in range(heads):
        rand = np.sort(rng.choice(np.arange(sink_cols, seq), size=nrand, replace=False))
        cidx[h] = np.concatenate([np.arange(sink_cols), rand])  # ascending position: rows use prefixes
        ccnt[h] = np.searchsorted(cidx[h], (np.arange(n) + 1) * bs - 1, side="right")
    pos = jnp.arange(seq, dtype=jnp.int32)
    bidx_j = jnp.broadcast_to(jnp.asarray(bidx), (batch, heads, n, mb))
    flags = causal_flags(pos, pos, bidx_j, bs)
    return StepIndex(bidx_j, jnp.broadcast_to(jnp.asarray(bcnt), (batch, heads, n)), flags,
                     jnp.broadcast_to(jnp.asarray(cidx), (batch, heads, max_cols)),
                     jnp.broadcast_to(jnp.asarray(ccnt), (batch, heads, n)))
