"""Random :class:`StepIndex` generators honouring the index contract (tests and benchmarks).

``index_family`` builds the benchmark's index shapes (issue 34): a local band, slash-heavy
(near band + far diagonals), slash diagonals spread over distances, vertical-heavy, and mixed.

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


def diagonal_index(batch: int, heads: int, seq: int, offsets: np.ndarray, columns: np.ndarray, *,
                   block_size: int = DEFAULT_BLOCK) -> StepIndex:
    """Vertical-slash index on one device (positions ``arange``) from per-head block-diagonal
    ``offsets`` (``int [heads, m]``, distinct per head; query block ``i`` takes KV block ``i - o``
    where that is ``>= 0``; an offset ``>= seq // block_size`` is padding) and per-head vertical ``columns``
    (``int [heads, c]``, ascending, distinct: each row uses the prefix up to its last position)."""
    bs, n = block_size, seq // block_size
    offsets = np.asarray(offsets, np.int64)
    columns = np.asarray(columns, np.int64)
    blocks = np.arange(n)[None, :, None] - offsets[:, None, :]  # [H, n, m]
    blocks = np.sort(np.where(blocks >= 0, blocks, n + 10**6), axis=-1)
    bcnt = (blocks < n).sum(-1).astype(np.int32)
    bidx = np.where(blocks < n, blocks, 0).astype(np.int32)
    ccnt = np.stack([np.searchsorted(columns[h], (np.arange(n) + 1) * bs - 1, side="right") for h in range(heads)])
    pos = jnp.arange(seq, dtype=jnp.int32)
    bidx_j = jnp.broadcast_to(jnp.asarray(bidx), (batch, heads, n, offsets.shape[1]))
    flags = causal_flags(pos, pos, bidx_j, bs)
    return StepIndex(bidx_j, jnp.broadcast_to(jnp.asarray(bcnt), (batch, heads, n)), flags,
                     jnp.broadcast_to(jnp.asarray(columns.astype(np.int32)), (batch, heads, columns.shape[1])),
                     jnp.broadcast_to(jnp.asarray(ccnt.astype(np.int32)), (batch, heads, n)))


#: the index families of the kernel benchmark (issue 34)
INDEX_FAMILIES = ("band", "slash", "spread", "vert", "mixed")


def _columns(rng, heads: int, seq: int, count: int, sinks: int = 64) -> np.ndarray:
    count = max(count, sinks)
    return np.stack([np.concatenate([np.arange(sinks), np.sort(rng.choice(np.arange(sinks, seq), count - sinks,
                                                                          replace=False))]) for _ in range(heads)])


def index_family(rng: np.random.Generator, family: str, batch: int, heads: int, seq: int, density: float, *,
                 block_size: int = DEFAULT_BLOCK, vert_cols: int = 4096) -> StepIndex:
    """A synthetic index of one family at about ``density`` of the causal (query, key) pairs:

    * ``band``: a local window — the diagonal block and the ones just below it — and 64 sink columns;
    * ``slash``: :func:`vertical_slash_index` (near band + 2 far diagonals, 256 verticals);
    * ``spread``: the diagonal block plus diagonals at distances drawn log-uniformly over the whole
      sequence (different per head: adjacent query blocks rarely share a tile), 256 verticals;
    * ``vert``: ``vert_cols`` verticals per head, the rest of the budget in slash blocks;
    * ``mixed``: 1024 verticals (at most ~40 % of the pairs) plus spread diagonals.
    """
    if family not in INDEX_FAMILIES:
        raise ValueError(f"family must be one of {INDEX_FAMILIES}, got {family!r}")
    if not 0 < density <= 1:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    bs, n = block_size, seq // block_size
    if family == "slash":
        return vertical_slash_index(rng, batch, heads, seq, 1 - density, block_size=bs)
    if family == "vert":  # columns: up to 70 % of the pairs (a column is causal for ~half the rows: ~1/seq each)
        cols = max(64, min(vert_cols, int(0.7 * density * seq) // 64 * 64))
        block_sp = min(0.999, 1 - density + cols / seq)
        return vertical_slash_index(rng, batch, heads, seq, block_sp, block_size=bs, far_slashes=1, max_cols=cols)
    ncols = {"band": 64, "spread": 256, "mixed": 1024}[family]
    if family == "mixed":  # at most ~40 % of the pairs in columns (short sequences)
        ncols = max(64, min(ncols, int(0.4 * density * seq) // 64 * 64))
    # blocks per row for the density, less what the columns give (each covers ~half the rows: 1/bs of a block)
    budget = max(1, int(round(density * (n + 1) / 2 - ncols * 0.5 / bs)))
    if family == "band":
        offsets = np.broadcast_to(np.arange(budget), (heads, budget))
    else:  # diagonal o covers the n - o rows below it: draw until the head holds budget * n blocks
        rows = []
        for _ in range(heads):
            far, blocks = set(), n
            while blocks < budget * n and len(far) < n - 1:
                o = int(np.exp(rng.uniform(0, np.log(n - 1)))) if n > 2 else 1
                if o not in far:
                    far.add(o)
                    blocks += n - o
            rows.append([0, *sorted(far)])
        m = max(map(len, rows))
        offsets = np.array([r + [n] * (m - len(r)) for r in rows], np.int64)  # n: padding (no block)
    return diagonal_index(batch, heads, seq, offsets, _columns(rng, heads, seq, ncols), block_size=bs)


def lowering_inputs(seed: int):
    """``(B, S, H, q, k, pos, idx)`` for lowering the Mosaic kernels for CUDA on any host: zero bf16
    ``q`` ``[1, 256, 4, 128]`` and ``k`` ``[1, 256, 2, 128]``, positions ``0..255`` and a random
    :class:`StepIndex` (block size 64, up to 3 blocks and 70 columns per row) from ``seed``."""
    B, S, H, Hkv, D = 1, 256, 4, 2, 128
    pos = jnp.arange(S, dtype=jnp.int32)
    idx = random_step_index(np.random.default_rng(seed), B, H, S, S, pos, pos, max_blocks=3, max_cols=70)
    return B, S, H, jnp.zeros((B, S, H, D), jnp.bfloat16), jnp.zeros((B, S, Hkv, D), jnp.bfloat16), pos, idx
