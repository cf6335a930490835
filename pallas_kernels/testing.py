"""Random :class:`StepIndex` generators honouring the index contract (tests and benchmarks).

``random_step_index`` draws, per (batch, head, query block), distinct sorted active KV blocks and
distinct sorted vertical columns outside them, with padding slots filled by random in-range
values (kernels must never read them), and ``block_causal`` from :func:`causal_flags`.
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
    cidx = rng.integers(0, sk, size=(batch, heads, nqb, mc)).astype(np.int32)
    ccnt = np.zeros((batch, heads, nqb), np.int32)
    for b in range(batch):
        for h in range(heads):
            for i in range(nqb):
                u = rng.random()
                if u < p_empty:
                    nb = 0
                elif u < p_empty + p_full:
                    nb = mb
                else:
                    nb = int(rng.integers(0, mb + 1))
                blocks = np.sort(rng.choice(nkb, size=nb, replace=False))
                bidx[b, h, i, :nb] = blocks
                bcnt[b, h, i] = nb
                free = np.setdiff1d(np.arange(sk), (blocks[:, None] * bs + np.arange(bs)).ravel())
                nc = int(rng.integers(0, min(mc, free.size) + 1)) if rng.random() > p_empty else 0
                cols = np.sort(rng.choice(free, size=nc, replace=False))
                cidx[b, h, i, :nc] = cols
                ccnt[b, h, i] = nc
    bidx_j = jnp.asarray(bidx)
    flags = causal_flags(jnp.asarray(q_pos), jnp.asarray(k_pos), bidx_j, bs)
    return StepIndex(bidx_j, jnp.asarray(bcnt), flags.astype(jnp.int32), jnp.asarray(cidx), jnp.asarray(ccnt))


def vertical_slash_index(rng: np.random.Generator, batch: int, heads: int, seq: int, sparsity: float, *,
                         block_size: int = DEFAULT_BLOCK, sink_cols: int = 64, far_slashes: int = 2,
                         max_cols: int = 256) -> StepIndex:
    """Synthetic vertical-slash index on one device (positions ``arange``) at about ``sparsity``.

    Slash blocks: the diagonal block, ``near`` blocks just below it and ``far_slashes`` far
    diagonals; verticals: the first ``sink_cols`` tokens plus random columns. ``near`` is chosen so
    that the active fraction of the causal area is about ``1 - sparsity``.
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
    cidx = np.zeros((heads, n, max_cols), np.int32)
    ccnt = np.zeros((heads, n), np.int32)
    for h in range(heads):
        rand = np.sort(rng.choice(np.arange(sink_cols, seq), size=nrand, replace=False))
        cand = np.concatenate([np.arange(sink_cols), rand])
        cblk = cand // bs
        for r in range(n):
            act = set(bidx[h, r, : bcnt[h, r]].tolist())
            keep = cand[(cand <= (r + 1) * bs - 1) & ~np.isin(cblk, list(act))]
            cidx[h, r, : keep.size] = keep
            ccnt[h, r] = keep.size
    pos = jnp.arange(seq, dtype=jnp.int32)
    bidx_j = jnp.broadcast_to(jnp.asarray(bidx), (batch, heads, n, mb))
    flags = causal_flags(pos, pos, bidx_j, bs)
    return StepIndex(bidx_j, jnp.broadcast_to(jnp.asarray(bcnt), (batch, heads, n)), flags,
                     jnp.broadcast_to(jnp.asarray(cidx), (batch, heads, n, max_cols)),
                     jnp.broadcast_to(jnp.asarray(ccnt), (batch, heads, n)))
